"""The step state machine (paper Algorithm 1): warm up, profile, solve per token bucket, apply.

Each training step runs inside ``with controller.step(tokens=n):`` (a driver that sees the step
only through hooks calls ``begin_step`` and ``end_step``). The first ``warmup_steps`` run
must-only; the next ``profile_steps`` time every op of every block (the reference block of each
region type, the first with its most common op sequence, is kept; the first profiling step also
samples the must-only step's peak memory); then each token bucket gets a plan, solved for the
most tokens seen in the bucket so far under the memory limit and cached. A later step of more
tokens keeps the plan where it is predicted to fit them, else the bucket is solved again for them
before the step runs. A new bucket first runs ``control_steps``
plain must-only steps, then one every ``control_every`` planned steps, so planned steps can be
compared with them (measured speedup); measured and predicted speedups off by more than
``speedup_band`` at ``mismatch_windows`` control steps in a row send every region back to profiling.
With ``torch_checkpoint_blocks``, a bucket is solved again each time its full-checkpointing
control steps double the number its plan priced torch's checkpoint from.
A bucket without a plan whose tokens lie more than ``resample_tolerance`` from every memory sample
is sampled first, a region is profiled again when its tokens exceed ``reprofile_factor`` times its
reference's, and an observed peak near the limit raises the fragmentation estimate (plans only
shrink). Metered must-only steps (the first profiling step, sample steps) also record the memory
timeline (``timeline.StepProbe``), from which the peak-aware model (``memory_model="peak"``,
``plan.peak``) predicts each plan's step peak; a metered planned step above its predicted peak by
more than the margin adds the error to the model and solves again. Under torch.distributed all ranks
agree each step on the largest token counts and on any flag, rank 0 solves with the smallest budget,
and every rank applies the same plan.

The parts, each a module of its own: ``TokenBuckets`` (tokens and buckets), ``MemoryBudget`` (the
limit, the capacity, the corrections metered steps ask for), ``RankAgreement`` (collectives),
``StepTimes``, ``SpeedupWatch`` and ``ReplayWalls`` (measured times), ``StepSchedule`` (which mode
each step runs, which steps are metered or verify).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ..blocks.block_settings import block_config
from ..blocks.plan_scope import use_plan
from ..blocks.trace_scope import torch_checkpointing, trace
from ..compute_device import compute_device
from ..config import TapeSACConfig
from ..errors import TapeSACError
from ..measure.memory import MemoryMeter, MemoryReading, device_memory, marker, memory_meter
from ..measure.timeline import StepProbe
from ..plan.plan import Plan
from ..tape.block import BlockTrace
from ..tape.verify import HiddenWrites
from .budget import Correction, MemoryBudget
from .measured_times import SpeedupWatch, StepTimes
from .plan_cache import ModelKey, plans_from_state, plans_state
from .profile import MemoryModel, MemorySample, RegionProfile
from .profiling import Profiling
from .ranks import RankAgreement
from .schedule import StepSchedule
from .solve import solve_plan, torch_checkpoint_gains, torch_checkpoint_peak
from .step_frontier import StepFrontier, step_frontier
from .step_report import CONTROL, FULL, PLANNED, PROFILE, SAMPLE, WARMUP, Bucket, StepReport
from .token_buckets import TokenBuckets

logger = logging.getLogger(__name__)

_STATE_VERSION = 6  # 2: plans carry the step time model; must-only steps keep their tokens
# 3: plans carry their predicted peak (the peak-aware memory model); 4: the memory model keeps
# samples at a reference static and the growth of memory outside the blocks (plans as in 3);
# 5: plans and times per bucket as (bucket indices, value) entries, not keyed "43,12"; 6: the
# model as its list of region types, not their comma-joined text


@dataclasses.dataclass(frozen=True)
class _OpenStep:
    """What ``begin_step`` set up that ``end_step`` reads and closes."""

    report: StepReport
    stack: ExitStack  # the plan, the trace, the meter
    meter: MemoryMeter | None
    probe: StepProbe | None
    static: int  # memory in use as the step began (metered steps)
    records: bool
    blocks: list[BlockTrace]
    torch_checkpointed: list[str]  # blocks a full-checkpointing step ran under torch's checkpoint
    plain: list[str]
    planned_checkpoint: list[str]  # blocks the plan ran under torch's checkpoint
    start: float


class Controller:
    """Plans which tensors TapeSAC blocks save, from one memory limit, over training steps."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        memory_limit: float | int | str | None = None,
        *,
        config: TapeSACConfig | None = None,
        device: torch.device | str | None = None,
        meter: Callable[[], MemoryMeter] | None = None,
        process_group: Any = None,
        **settings: Any,
    ) -> None:
        if config is not None and (memory_limit is not None or settings):
            # One of them would be silently dropped: say which were given and how to combine.
            given = ", ".join(["memory_limit"] * (memory_limit is not None) + sorted(settings))
            raise TypeError(
                f"Controller takes a config or settings, not both: got config= and {given}. "
                "Fix: pass only config=, with the settings in it "
                "(dataclasses.replace(config, memory_limit=...)), or only the settings"
            )
        if config is None:
            if memory_limit is None:
                raise TypeError("Controller needs memory_limit (e.g. 0.9 or '20GiB') or a config")
            config = TapeSACConfig(memory_limit=memory_limit, **settings)
        roots = [model] if isinstance(model, torch.nn.Module) else list(model)
        blocks = [c for root in roots for m in root.modules() if (c := block_config(m)) is not None]
        self.regions = sorted({c.region for c in blocks})
        # The hidden writes its blocks' verifying steps found (one table per checkpoint_modules).
        self._hidden_writes = list({id(c.hidden_writes): c.hidden_writes for c in blocks}.values())
        if not self.regions:
            raise TapeSACError(
                "the controller found no checkpointed module. Fix: call "
                "tapesac_core.checkpoint_modules(model, {BlockClass}) first"
            )
        self.config = config
        self.device = torch.device(device) if device is not None else compute_device(roots)
        self._meter = meter or (lambda: memory_meter(self.device))
        self.model_key = ModelKey(tuple(self.regions))
        self.steps = 0
        self.profiling = Profiling(config.profile_steps, config.replay_tolerance)
        self.memory = MemoryModel()
        self.plans: dict[Bucket, Plan] = {}
        self.report: StepReport | None = None
        self.times = StepTimes()
        self.buckets = TokenBuckets(self.regions, config)
        self.budget = MemoryBudget(config, lambda: device_memory(self.device))
        self.ranks = RankAgreement(process_group, self.device)
        self._speedups = SpeedupWatch(config.speedup_band, config.mismatch_windows)
        self.schedule = StepSchedule(config, self.device.type)
        self._reprofile = False  # measured speedups disagree with the model: profile again
        self._pending = Correction()  # asked by this rank's last metered step; agreed at the next
        # Per bucket, the full-checkpointing steps its plan priced torch's checkpoint from.
        self._priced_from: dict[Bucket, int] = {}
        self._open: _OpenStep | None = None  # the step between begin_step and end_step

    # ------------------------------------------------------------------ public state

    @property
    def profiles(self) -> dict[str, RegionProfile]:
        """The reference block's profile per region type (empty until profiled)."""
        return self.profiling.profiles

    @property
    def plan(self) -> Plan | None:
        """The plan applied in the last step (None while warming up, profiling or sampling)."""
        return self.report.plan if self.report else None

    @property
    def predicted_speedup(self) -> float | None:
        return self.report.predicted_speedup if self.report else None

    @property
    def measured_speedup(self) -> float | None:
        return self.report.measured_speedup if self.report else None

    def limit_bytes(self) -> int:
        """The memory limit in bytes on this device (or host, on CPU)."""
        return self.budget.limit_bytes()

    def bucket_tokens(self, key: Bucket) -> dict[str, int]:
        """Per region, the counts bucket ``key``'s plan is solved for: the most seen in it so far
        (its upper token edge before any step of it ran)."""
        return self.buckets.edges(key)

    def replan(self, memory_limit: float | int | str | None = None) -> None:
        """Forget every plan, under a new ``memory_limit`` if given: each bucket is solved again
        at its next planned step (or ``plan_for``), from the profiles already taken."""
        if memory_limit is not None:
            self.config = dataclasses.replace(self.config, memory_limit=memory_limit)
            self.budget = MemoryBudget(self.config, self.budget.total)
        self._forget_plans()

    def plan_for(self, tokens: int | Mapping[str, int]) -> Plan:
        """The plan of the bucket of ``tokens`` (as ``step`` takes them), solved now if not
        cached. Needs the profiles of a run that reached a planned step; on every rank at once
        under torch.distributed."""
        if not self.profiles:
            raise TapeSACError(
                "plan_for needs profiled blocks: run steps until one is planned first"
            )
        per_region = self._agree_tokens(self.buckets.per_region(tokens))
        key = self.buckets.key(per_region)
        self._see(key, per_region)
        return self._plan(key)

    def predicted_peak(self, plan: Plan, tokens: Mapping[str, int]) -> int:
        """The step peak ``plan`` is predicted to reach on a batch of ``tokens`` per region: its
        memory model's, solved for its bucket's tokens, scaled to these, with the memory outside
        the blocks it was solved for."""
        return self._peak_at(plan, tokens) + self.memory.static_growth

    def _peak_at(self, plan: Plan, tokens: Mapping[str, int]) -> int:
        """``plan``'s predicted peak at ``tokens``, with the memory outside the blocks as it was
        when the memory model was sampled (what ``MemoryBudget.capacity`` is compared with)."""
        primary = self.buckets.primary(tokens)
        edges = {r: p.tokens for r, p in plan.regions.items()}
        # A plan of no region (one a resumed run can hold) adds nothing to scale.
        factor = primary / self.buckets.primary(edges) if edges else 1.0
        return plan.peak_at_tokens(self.memory.base(primary), factor)

    def step_frontier(self, key: Bucket) -> StepFrontier:
        """Bucket ``key``'s predicted frontier of whole steps, with its plan on it (for plots)."""
        edges = self.buckets.edges(key)
        return step_frontier(
            self.plans[key], self.profiles, edges, self._must_only_seconds(key, edges), self.config
        )

    # ------------------------------------------------------------------ one step

    @contextmanager
    def step(self, tokens: int | Mapping[str, int]) -> Iterator[StepReport]:
        """Run one training step (forward, backward, optimizer) under TapeSAC's current plan.

        One step is one micro-batch: with gradient accumulation, open one step per micro-batch
        (under ``memory_model="sum"`` a block's forward after another block's backward in the
        same step is a TapeSACError). An exception inside ends the step unrecorded."""
        report = self.begin_step(tokens)
        try:
            yield report
        except BaseException as error:
            self.end_step(error)
            raise
        self.end_step()

    def begin_step(self, tokens: int | Mapping[str, int]) -> StepReport:
        """Open the step ``step`` runs, for drivers that see a micro-batch only through hooks;
        its report, completed by ``end_step``."""
        if self._open is not None:
            raise TapeSACError(
                f"begin_step: step {self._open.report.step} is still open. Fix: end it with "
                "end_step() (end_step(error) to discard it) before the next micro-batch's step"
            )
        local = self.buckets.per_region(tokens)
        per_region = self._agree_tokens(local)
        key = self.buckets.key(per_region)
        self._see(key, per_region)
        if self.schedule.warms_up(self.steps):
            mode = WARMUP
        else:
            profile, sample = self._agree(key, per_region, local)
            fits = not (profile or sample) and self._full_fits(key)
            mode = self.schedule.mode(key, self.times, profile, sample, fits)
        plan = self._plan(key) if mode == PLANNED else None
        report = StepReport(
            step=self.steps,
            mode=mode,
            tokens=per_region,
            bucket=key,
            plan=plan,
            limit=self.limit_bytes(),
            local_tokens=local,
        )
        with ExitStack() as stack:
            if plan is not None:
                stack.enter_context(use_plan(plan))
            torch_checkpointed = stack.enter_context(torch_checkpointing()) if mode == FULL else []
            metered = self.schedule.metered(mode, key, self.profiling.done)
            records = self.schedule.records(mode, key)
            meter = stack.enter_context(self._meter()) if metered else None
            # Must-only metered steps also measure the memory timeline (the peak-aware model).
            mark = marker(meter) if mode in (PROFILE, SAMPLE) else None
            probe = StepProbe(mark) if mark is not None else None
            # The peak-aware model knows an earlier micro-batch's blocks freed their values before
            # the next forward; Eq. 8 ("sum") would count them alive together: refused there.
            plain: list[str] = []
            planned_checkpoint: list[str] = []
            blocks = stack.enter_context(
                trace(
                    time_nodes=mode == PROFILE,
                    one_micro_batch=self.config.memory_model == "sum",
                    verify=self.schedule.verifies(mode, self.steps, self.profiling.done),
                    probe=probe,
                    plain=plain,
                    torch_checkpointed=planned_checkpoint,
                    record=records,
                )
            )
            static = meter.reading().current if meter is not None else 0
            if probe is not None:
                probe.start()
            self._synchronize()
            self._open = _OpenStep(
                report,
                stack.pop_all(),  # left open until end_step; closed here if anything above fails
                meter,
                probe,
                static,
                records,
                blocks,
                torch_checkpointed,
                plain,
                planned_checkpoint,
                time.perf_counter(),
            )
        return report

    def end_step(self, error: BaseException | None = None) -> StepReport | None:
        """Close the step ``begin_step`` opened; its report. With ``error`` (the micro-batch
        failed, or the driver discards it), nothing it measured is kept: None."""
        step, self._open = self._open, None
        if step is None:
            raise TapeSACError(
                "end_step: no step is open. Fix: call begin_step(tokens) at the start of the "
                "micro-batch (or use `with controller.step(tokens):`)"
            )
        if error is not None:
            step.stack.__exit__(type(error), error, error.__traceback__)
            return None
        report, meter, probe = step.report, step.meter, step.probe
        with step.stack:
            self._synchronize()
            report.time = time.perf_counter() - step.start
            end_peak = probe.close() if probe is not None else 0
            reading = meter.reading() if meter is not None else None
        blocks = step.blocks
        report.count_blocks(blocks)
        report.torch_checkpointed = len(step.torch_checkpointed) + len(step.planned_checkpoint)
        report.plain_blocks = len(step.plain)
        if report.plan is not None:
            report.saved_bytes += report.plan.plain_bytes(report.local_tokens)
        if probe is not None and reading is not None and blocks:
            self.memory.add_timeline(
                probe.timeline(
                    blocks,
                    end_peak,
                    tokens=self.buckets.primary(report.local_tokens),
                    static=step.static,
                )
            )
        self._finish(report, reading, step.static, step.records)
        return report

    def _finish(
        self, report: StepReport, reading: MemoryReading | None, static: int, recorded: bool
    ) -> None:
        blocks, key, mode = report.block_traces, report.bucket, report.mode
        self.budget.say_over_budget(report.over_budget)
        primary = self.buckets.primary(report.local_tokens)
        if reading is not None:
            report.peak = reading.peak
        if report.plan is not None and report.plan.predicted_peak:
            report.predicted_peak = self.predicted_peak(report.plan, report.local_tokens)
        # A rank's tapes and replays are of its own batch, not of the agreed (largest) count.
        if mode == PROFILE and self.profiling.take(blocks, report.local_tokens):
            self._forget_plans()
        if reading is not None and mode in (PROFILE, SAMPLE):
            # This rank's memory is that of its own batch: samples carry its own token count.
            self.memory.add(MemorySample.of(reading, tokens=primary, static=static))
        self._time(report, blocks, metered=reading is not None, recorded=recorded)
        if reading is not None:  # must-only steps (no plan) ask only for outside memory anew
            self._pending = self.budget.check(
                reading, static, report.plan, report.predicted_peak, self.memory
            )
        report.predicted_speedup = self.plans[key].predicted_speedup if key in self.plans else None
        report.measured_speedup = self.times.speedup(key)
        report.measured_reason = self.times.unmeasured_reason(key, key in self.plans)
        report.measured_speedup_vs_full = self.times.speedup(key, vs_full=True)
        # The controller's copy keeps no block traces: their tapes (random generator states
        # among them) belong to the step, and only the caller's report may keep them longer.
        self.report = dataclasses.replace(report, block_traces=[])
        self.steps += 1

    def _time(
        self, report: StepReport, blocks: list[BlockTrace], metered: bool, recorded: bool
    ) -> None:
        """The step's seconds into its bucket's times (``StepSchedule.timed``: which planned
        steps count)."""
        key, mode = report.bucket, report.mode
        if mode == CONTROL or (mode == WARMUP and report.step > 0):
            self.times.add_must_only(key, report.tokens, report.time)
            self.profiling.walls.add(blocks, report.local_tokens)
            if (
                mode == CONTROL
                and key in self.plans
                and self._speedups.profile_again(key, self.times.speedup(key), self.plans[key])
            ):
                self._reprofile = True
                self.times.forget_planned()
        elif mode == FULL:
            self.times.add_full(key, report.time)
            if self._priced_from_too_few(key):
                self._solve_again(
                    key,
                    f"it has {len(self.times.of(key).full)} full-checkpointing steps measured, its "
                    f"plan priced torch's checkpoint from {self._priced_from[key]}",
                )
        elif mode == PLANNED:
            self.schedule.planned(key, metered, recorded)
            self.times.add_planned(key, report.time if self.schedule.timed(metered) else None)

    # ------------------------------------------------------------------ agreement

    def _agree(
        self, key: Bucket, tokens: dict[str, int], local: dict[str, int]
    ) -> tuple[bool, bool]:
        """Whether this step profiles and whether it samples memory, agreed by every rank (any
        rank's need), and the memory corrections every rank's last metered step asked for (the
        largest), applied."""
        known = key in self.plans  # solved earlier, or restored from a checkpoint
        grown = any(
            local[r] > self.config.reprofile_factor * p.tokens for r, p in self.profiles.items()
        )
        needs_profile = grown or (not self.profiles and not known) or self._reprofile
        needs_sample = not known and not self.memory.covers(
            self.buckets.primary(local), self.config.resample_tolerance
        )
        if needs_profile and not self.profiling.done:
            self.profiling.profiles = {}
        pending = self._pending
        profile, sample, fragmentation, model_error, moved = self.ranks.largest(
            [
                int(needs_profile or self.profiling.done > 0),
                int(needs_sample),
                pending.fragmentation,
                pending.model_error,
                int(pending.outside_growth is not None),
            ]
        )
        self._pending = Correction()
        # The largest any rank asked; the memory outside the blocks stays this rank's own.
        agreed = dataclasses.replace(pending, fragmentation=fragmentation, model_error=model_error)
        # Every rank solves again if any rank's memory changed: solving takes all of them.
        if self.budget.apply(agreed, self.memory) or moved:
            self._forget_plans()
        if profile:
            self._reprofile = False
        return bool(profile), bool(sample)

    # ------------------------------------------------------------------ plans

    def _see(self, key: Bucket, tokens: Mapping[str, int]) -> None:
        """Count a step's ``tokens`` (agreed by every rank) in bucket ``key``. More than the
        bucket's plan was solved for: the plan is kept where it is predicted to fit them on every
        rank, else the bucket is solved again for them (at most once per new most)."""
        if not self.buckets.see(key, tokens) or key not in self.plans:
            return
        plan = self.plans[key]
        if all(tokens[r] <= p.tokens for r, p in plan.regions.items()):
            return
        # The "sum" memory model predicts no step peak: its plans are solved again.
        fits = bool(plan.predicted_peak) and (
            self._peak_at(plan, tokens) <= self.budget.capacity(self.memory)
        )
        if not self.ranks.largest([int(not fits)])[0]:
            return
        solved_for = {r: p.tokens for r, p in plan.regions.items()}
        self._solve_again(
            key,
            f"tokens {dict(tokens)} are more than its plan was solved for ({solved_for}) and the "
            "plan is not predicted to fit them",
        )

    def _plan(self, key: Bucket) -> Plan:
        if key not in self.plans:
            edges = self.buckets.edges(key)
            base = self.memory.base(self.buckets.primary(edges))
            budget = self.ranks.smallest(self.budget.capacity(self.memory) - base)
            self.plans[key] = self.ranks.plan_of_rank_0(
                lambda: self._solve(edges, budget + base, base, key), self.model_key
            )
            self._priced_from[key] = len(self.times.of(key).full)
            logger.info(
                "TapeSAC solved bucket %s (tokens %s):\n%s", key, edges, self.plans[key].explain()
            )
        return self.plans[key]

    def _priced_from_too_few(self, key: Bucket) -> bool:
        """With ``torch_checkpoint_blocks``, whether the bucket's plan priced torch's checkpoint
        from half the full-checkpointing steps measured now, or fewer (``full_control_every``
        steps keep coming): a few single steps misprice it on a busy host, and the measured times
        keep the last 25, so a plan is solved again at most a few times. Every rank counts the
        same steps. A plan restored from a checkpoint counts from the steps measured at its
        first check."""
        if not self.config.torch_checkpoint_blocks or key not in self.plans:
            return False
        measured = len(self.times.of(key).full)
        priced = self._priced_from.setdefault(key, measured)
        return measured > priced and measured >= max(2 * priced, self.config.torch_checkpoint_steps)

    def _solve_again(self, key: Bucket, why: str) -> None:
        """Bucket ``key`` is solved again at its next planned step, for ``why``; its planned
        steps' times, of the old plan, are dropped."""
        logger.info("TapeSAC: bucket %s is solved again: %s", key, why)
        del self.plans[key]
        self.schedule.forget_plan(key)
        self.times.forget_planned(key)

    def _full_fits(self, key: Bucket) -> bool:
        """Whether the bucket still measures full checkpointing against must-only before its
        first plan (``torch_checkpoint_blocks``): its peak predicted within the limit on every
        rank."""
        config = self.config
        if (
            not config.torch_checkpoint_blocks
            or key in self.plans
            or len(self.times.of(key).full) >= config.torch_checkpoint_steps
            or not (self.profiles and self.memory.samples)
        ):
            return False
        edges = self.buckets.edges(key)
        primary = self.buckets.primary(edges)
        timeline = self.memory.timeline(primary)
        base = self.memory.base(primary)
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        peak = (
            torch_checkpoint_peak(profiles, edges, timeline, base, config)
            if timeline is not None
            else None
        )
        fits = peak is not None and peak <= self.budget.capacity(self.memory)
        return not self.ranks.largest([int(not fits)])[0]

    def _solve(self, edges: dict[str, int], capacity: int, base: int, key: Bucket) -> Plan:
        if self.device.type == "cpu":
            self.profiling.calibrate(edges)
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        must_only_seconds = self._must_only_seconds(key, edges)
        times = self.times.of(key)
        gains = (
            torch_checkpoint_gains(
                profiles,
                edges,
                statistics.median(times.must_only),
                statistics.median(times.full),
                must_only_seconds,
            )
            if self.config.torch_checkpoint_blocks and times.full and times.must_only
            else None
        )
        plan = solve_plan(
            profiles,
            edges,
            model=self.model_key.fingerprint,
            capacity=capacity,
            base=base,
            must_only_step_time=must_only_seconds,
            config=self.config,
            timeline=self.memory.timeline(self.buckets.primary(edges)),
            torch_checkpoint_gains=gains,
        )
        # Under the peak-aware model a must-only peak above the capacity is not the end: saving
        # removes replay temporaries, so only a plan predicted above it means nothing fits.
        if plan.predicted_peak > capacity:
            self.budget.say_unfit(plan, capacity, edges, self.memory)
        return plan

    def _must_only_seconds(self, key: Bucket, edges: dict[str, int]) -> float:
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        return self.times.modelled_must_only(key, edges, profiles, self.buckets.primary)

    def _forget_plans(self) -> None:
        """Every bucket is solved again (and its first planned step metered again on CPU)."""
        self.plans.clear()
        self.schedule.forget_plans()

    # ------------------------------------------------------------------ ranks and device

    def _agree_tokens(self, tokens: dict[str, int]) -> dict[str, int]:
        """All ranks run the bucket of the largest token counts."""
        return dict(zip(self.regions, self.ranks.largest([tokens[r] for r in self.regions])))

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Plan cache, memory samples and step times: resuming needs no new profiling for known buckets."""
        return {
            "version": _STATE_VERSION,
            "model": self.model_key.to_state(),
            "steps": self.steps,
            "plans": plans_state(self.plans),
            **self.memory.state_dict(),
            **self.times.state_dict(),
            "hidden_writes": HiddenWrites.merged_state(self._hidden_writes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; plans from another model are refused."""
        if not self.model_key.matches_state(state.get("model")):
            raise TapeSACError(
                f"TapeSAC state is for region types {state.get('model')!r}, this "
                f"model has {self.model_key.to_state()!r}: it comes from another model"
            )
        self.steps = state["steps"]
        self.plans = plans_from_state(state, self.model_key, _STATE_VERSION)
        for key, plan in self.plans.items():
            if set(plan.regions) == set(self.regions):
                self.buckets.restore(key, {r: p.tokens for r, p in plan.regions.items()})
        self._priced_from.clear()  # restored plans count from the steps measured at their check
        self.memory = MemoryModel.from_state(state)
        self.times.load_state_dict(state, self.buckets.edges)
        for table in self._hidden_writes:  # absent before version 4
            table.load_state_dict(state.get("hidden_writes", {}))
