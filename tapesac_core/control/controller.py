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
each step runs, which steps are metered or verify), ``PlanCache``, ``BucketSolver`` and
``TorchCheckpointPricing`` (plans kept, solved, torch's checkpoint priced from measured steps),
``OpenStep`` (what a step runs under) and ``saved_state`` (what checkpoints keep).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..blocks.block_settings import block_config
from ..compute_device import compute_device
from ..config import TapeSACConfig
from ..errors import TapeSACError
from ..measure.memory import MemoryMeter, MemoryReading, device_memory, memory_meter
from ..plan.plan import Plan
from ..tape.block import BlockTrace
from ..tape.host_pool import HostPool
from ..tape.offload import Offload
from .budget import Correction, MemoryBudget
from .measured_times import SpeedupWatch, StepTimes
from .memory_model import MemoryModel, MemorySample
from .open_step import OpenStep
from .plan_cache import ModelKey, PlanCache, solved_for
from .profile import RegionProfile
from .profiling import Profiling
from .ranks import RankAgreement
from .repricing import TorchCheckpointPricing
from .saved_state import check_model, saved_plans, saved_state
from .schedule import StepSchedule
from .solving import BucketSolver
from .step_frontier import StepFrontier, offload_frontiers, step_frontier
from .step_report import CONTROL, FULL, PLANNED, PROFILE, SAMPLE, WARMUP, Bucket, StepReport
from .token_buckets import TokenBuckets


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
        self.report: StepReport | None = None
        self.times = StepTimes()
        self.buckets = TokenBuckets(self.regions, config)
        self.budget = MemoryBudget(config, lambda: device_memory(self.device))
        self.ranks = RankAgreement(process_group, self.device)
        self._speedups = SpeedupWatch(config.speedup_band, config.mismatch_windows)
        self.schedule = StepSchedule(config, self.device.type)
        self.plan_cache = PlanCache(self.schedule, self.times)
        self.pricing = TorchCheckpointPricing(config, self.times)
        self.solver = BucketSolver(
            self.profiling,
            self.times,
            self.buckets,
            self.ranks,
            self.pricing,
            self.model_key,
            self.device,
        )
        self._reprofile = False  # measured speedups disagree with the model: profile again
        self._solve_again = False  # this rank's profiles changed: plans solved again (agreed)
        self._pending = Correction()  # asked by this rank's last metered step; agreed at the next
        self._open: OpenStep | None = None  # the step between begin_step and end_step
        # Host buffers of offloading plans, reused from step to step (made at the first).
        self._host_pool: HostPool | None = None

    # ------------------------------------------------------------------ public state

    @property
    def plans(self) -> dict[Bucket, Plan]:
        """Each token bucket's plan (the plan cache's)."""
        return self.plan_cache.plans

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
        at its next planned step (or ``plan_for``), from the profiles already taken; under the
        same limit its blocks keep their choices unless a change clearly gains."""
        if memory_limit is not None:
            self.config = dataclasses.replace(self.config, memory_limit=memory_limit)
            self.budget = MemoryBudget(self.config, self.budget.total)
        self.plan_cache.forget(keep_previous=memory_limit is None)

    def plan_for(self, tokens: int | Mapping[str, int]) -> Plan:
        """The plan of the bucket of ``tokens`` (as ``step`` takes them), solved now if not
        cached. Needs the profiles of a run that reached a planned step; on every rank at once
        under torch.distributed."""
        if not self.profiles:
            raise TapeSACError(
                "plan_for needs profiled blocks: run steps until one is planned first"
            )
        per_region = self.ranks.largest_tokens(self.buckets.per_region(tokens), self.regions)
        key = self.buckets.key(per_region)
        self._see(key, per_region)
        return self._plan(key)

    def predicted_peak(self, plan: Plan, tokens: Mapping[str, int]) -> int:
        """The step peak ``plan`` is predicted to reach on a batch of ``tokens`` per region: its
        memory model's, solved for its bucket's tokens, scaled to these, with the memory outside
        the blocks it was solved for."""
        return self.solver.peak_at(plan, tokens, self.memory) + self.memory.static_growth

    def step_frontier(self, key: Bucket) -> StepFrontier:
        """Bucket ``key``'s predicted frontier of whole steps, with its plan on it (for plots);
        where plans may offload, the frontiers with and without offload beside each other."""
        edges, plan = self.buckets.edges(key), self.plans[key]
        seconds = self.solver.must_only_seconds(key, edges)
        frontier = step_frontier(plan, self.profiles, edges, seconds, self.config)
        link = self.solver.link
        if link is None or plan.memory_model != "peak":
            return frontier
        kept, offloaded = offload_frontiers(
            plan,
            lambda capacity, over: self.solver.at_capacity(
                key, capacity, self.memory, self.budget, over is not None
            ),
            link,
        )
        return dataclasses.replace(frontier, kept_only=kept, with_offload=offloaded)

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
        per_region = self.ranks.largest_tokens(local, self.regions)
        key = self.buckets.key(per_region)
        self._see(key, per_region)
        if self.schedule.warms_up(self.steps):
            mode = WARMUP
        else:
            profile, sample = self._agree(key, per_region, local)
            fits = not (profile or sample) and self.solver.full_fits(
                key, key in self.plans, self.memory, self.budget
            )
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
        if mode == FULL:  # what its meter, where it has one, is checked against
            report.predicted_peak = self.solver.full_step_peak(key, self.memory)
        self._open = OpenStep.open(
            report,
            meter=self._meter if self.schedule.metered(mode, key, self.profiling.done) else None,
            records=self.schedule.records(mode, key),
            verify=self.schedule.verifies(mode, self.steps, self.profiling.done),
            one_micro_batch=self.config.memory_model == "sum",
            device=self.device,
            offload=self._offload(plan),
        )
        return report

    def _offload(self, plan: Plan | None) -> Offload | None:
        """Where the step's offloading blocks copy to, if ``plan`` offloads any (no region
        forced: its blocks offload as the plan says)."""
        if plan is None or not plan.offloading():
            return None
        if self._host_pool is None:
            self._host_pool = HostPool(self.device)
        return Offload(self._host_pool, regions=frozenset())

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
            step.discard(error)
            return None
        report = step.report
        reading, timeline = step.close(self.buckets.primary(report.local_tokens))
        if report.plan is not None:
            report.saved_bytes += report.plan.plain_bytes(report.local_tokens)
        if timeline is not None:
            self.memory.add_timeline(timeline)
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
            self.plan_cache.forget()
        if report.offloaded_bytes and self.profiling.held_inputs_less(blocks, report.local_tokens):
            self.budget.say_inputs_kept()
            self._solve_again = True
        if reading is not None and mode in (PROFILE, SAMPLE):
            # This rank's memory is that of its own batch: samples carry its own token count.
            self.memory.add(MemorySample.of(reading, tokens=primary, static=static))
        self._time(report, blocks, metered=reading is not None, recorded=recorded)
        if reading is not None and mode == FULL:
            self._pending = self.budget.check_full(
                reading, static, report.predicted_peak, self.memory
            )
        elif reading is not None:  # must-only steps (no plan) ask only for outside memory anew
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
            if (why := self.pricing.reprice(key, key in self.plans)) is not None:
                self.plan_cache.solve_again(key, why)
        elif mode == PLANNED:
            self.schedule.planned(key, metered, recorded)
            self.times.add_planned(key, report.time if self.schedule.timed(metered) else None)

    def _agree(
        self, key: Bucket, tokens: dict[str, int], local: dict[str, int]
    ) -> tuple[bool, bool]:
        """Whether this step profiles and whether it samples memory, agreed by every rank (any
        rank's need), and the memory corrections every rank's last metered step asked for (the
        largest), applied."""
        known = key in self.plans  # solved earlier, or restored from a checkpoint
        grown = self.profiling.outgrown(local, self.config.reprofile_factor)
        needs_profile = grown or (not self.profiles and not known) or self._reprofile
        needs_sample = not known and not self.memory.covers(
            self.buckets.primary(local), self.config.resample_tolerance
        )
        if needs_profile and not self.profiling.done:
            self.profiling.profiles = {}
        agreed = self.ranks.step_agreement(
            needs_profile or self.profiling.done > 0, needs_sample, self._pending, self._solve_again
        )
        self._pending, self._solve_again = Correction(), False
        # Every rank solves again if any rank's memory or profiles changed: solving takes all.
        if self.budget.apply(agreed.correction, self.memory) or agreed.moved or agreed.solve_again:
            self.plan_cache.forget()
        if agreed.profile:
            self._reprofile = False
        return agreed.profile, agreed.sample

    # ------------------------------------------------------------------ plans

    def _see(self, key: Bucket, tokens: Mapping[str, int]) -> None:
        """Count a step's ``tokens`` (agreed by every rank) in bucket ``key``. More than the
        bucket's plan was solved for: the plan is kept where it is predicted to fit them on every
        rank, else the bucket is solved again for them (at most once per new most)."""
        if not self.buckets.see(key, tokens):
            return
        plan = self.plan_cache.outgrown(key, tokens)
        if plan is None or self.solver.fits(plan, tokens, self.memory, self.budget):
            return
        self.plan_cache.solve_again(
            key,
            f"tokens {dict(tokens)} are more than its plan was solved for ({solved_for(plan)}) "
            "and the plan is not predicted to fit them",
        )

    def _plan(self, key: Bucket) -> Plan:
        if key not in self.plans:
            edges = self.buckets.edges(key)
            previous = self.plan_cache.previous.get(key)
            plan = self.solver.plan(key, edges, self.memory, self.budget, previous)
            self.plan_cache.store(key, plan, edges)
        return self.plans[key]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Plan cache, memory samples and step times: resuming needs no new profiling for known buckets."""
        return saved_state(
            self.model_key, self.steps, self.plans, self.memory, self.times, self._hidden_writes
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; plans from another model are refused."""
        check_model(state, self.model_key)
        self.steps = state["steps"]
        self.plan_cache.restore(saved_plans(state, self.model_key, self.config), self.buckets)
        self.pricing.forget()  # restored plans count from the steps measured at their check
        self.memory = MemoryModel.from_state(state)
        self.times.load_state_dict(state, self.buckets.edges)
        for table in self._hidden_writes:  # absent before version 4
            table.load_state_dict(state.get("hidden_writes", {}))
