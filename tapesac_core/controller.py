"""The step state machine (paper Algorithm 1): warm up, profile, solve per token bucket, apply.

Each training step runs inside ``with controller.step(tokens=n):``. The first ``warmup_steps``
run must-only; the next ``profile_steps`` time every op of every block (the reference block of
each region type, the first with its most common op sequence, is kept; the first profiling step
also samples the must-only step's peak memory); then each token bucket gets a plan, solved at the
bucket's upper edge under the memory limit and cached. A new bucket first runs ``control_steps``
plain must-only steps, then one every ``control_every`` planned steps, so planned steps can be
compared with them (measured speedup); measured and predicted speedups off by more than
``speedup_band`` at ``mismatch_windows`` control steps in a row send every region back to
profiling. A bucket without a plan whose tokens lie more than
``resample_tolerance`` from every memory sample is sampled first, a region is profiled again when
its tokens exceed ``reprofile_factor`` times its reference's, and an observed peak near the limit
raises the fragmentation estimate (plans only shrink). Metered must-only steps (the first
profiling step, sample steps) also record the memory timeline (``timeline.StepProbe``), from which
the peak-aware model (``memory_model="peak"``, ``plan.peak``) predicts each plan's step peak; a
metered planned step above its predicted peak by more than the margin adds the error to the model
and solves again. Under torch.distributed all ranks agree
each step on the largest token counts and on any flag, rank 0 solves with the smallest budget, and
every rank applies the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import torch_checkpointing, trace, use_plan
from .config import TapeSACConfig
from .errors import TapeSACError
from .memory import MemoryMeter, MemoryReading, memory_meter, physical_memory
from .plan import bucket, upper_edge
from .plan.plan import Plan
from .profile import (
    MemoryModel,
    MemorySample,
    RegionProfile,
    ReplayWall,
    calibrated,
    merged,
    region_profiles,
)
from .solve import modelled_replay, solve_plan
from .step_time import StepTime, outside_per_token
from .timeline import StepProbe
from .units import format_bytes

logger = logging.getLogger(__name__)

WARMUP, PROFILE, SAMPLE, CONTROL, PLANNED = "warmup", "profile", "sample", "control", "planned"
FULL = "full"  # a control step under torch.utils.checkpoint (opt-in: full_control_every)
_ALL = "*"
_WINDOW = 25  # recent step times per bucket that speed comparisons use
_WALLS = 64  # recent must-only block replays per region that profiled times are checked against
_MISMATCH_REPROFILES = 2  # profiling again cannot fix a model that is off for other reasons
_STATE_VERSION = 3  # 2: plans carry the step time model; must-only steps keep their tokens
# 3: plans carry their predicted peak (the peak-aware memory model)


@dataclass(kw_only=True)
class StepReport:
    """What one step did, for logs: its mode, plan, time, memory and replay counts."""

    step: int
    mode: str
    tokens: dict[str, int]  # agreed by all ranks (the largest): they set the bucket
    bucket: tuple[int, ...]
    plan: Plan | None = None
    time: float = 0.0  # seconds, synchronised with the device
    peak: int | None = None  # bytes, when the step was metered
    limit: int = 0  # the memory limit in bytes
    saved_bytes: int = 0  # bytes blocks kept beyond S0 (all blocks, all micro-batches)
    replayed_nodes: int = 0
    over_budget: int = 0  # planned values not kept: over their block's bytes
    blocks: int = 0
    predicted_speedup: float | None = None
    measured_speedup: float | None = None  # vs must-only control steps of the bucket
    measured_speedup_vs_full: float | None = None  # vs full-checkpointing control steps
    measured_reason: str | None = None  # why measured_speedup is None
    torch_checkpointed: int = 0  # blocks run under torch.utils.checkpoint (full steps)
    predicted_peak: int | None = None  # bytes the plan's memory model predicts for the step
    local_tokens: dict[str, int] = field(default_factory=dict)  # this rank's own batch
    block_traces: list = field(default_factory=list, repr=False)


def _fsdp_compute_device(module: torch.nn.Module) -> torch.device | None:
    """The device FSDP2 computes on for a module it shards, else None.

    With ``CPUOffloadPolicy`` FSDP2 keeps the sharded parameters on the CPU and moves them to
    the accelerator for each forward; only its private state names that accelerator.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    device = getattr(get_state(), "_device", None)
    return torch.device(device) if device is not None else None


def compute_device(roots: Sequence[torch.nn.Module]) -> torch.device:
    """The device the blocks compute on: FSDP2's compute device where a root or submodule is
    sharded (with CPU offload the parameters live on the CPU), else the first parameter's
    device, else the CPU."""
    for root in roots:
        for module in root.modules():
            device = _fsdp_compute_device(module)
            if device is not None:
                return device
    params = [p for root in roots for p in root.parameters()]
    return params[0].device if params else torch.device("cpu")


def step_footprint(reading: MemoryReading, fragmentation: int) -> int:
    """Device memory one metered step needed: its peak allocated plus the measured fragmentation
    estimate plus memory outside the allocator, or, when the allocator reserved more during the
    step, the reserved high-water mark it reached.

    Reserved memory that did not grow in the step was reserved by an earlier one; the caching
    allocator keeps it, so it says nothing about this step. The controller's own raises of the
    estimate are not added: the plan was already shrunk by them.
    """
    used = reading.peak + fragmentation + reading.outside
    if reading.reserved_growth > 0:
        used = max(used, reading.reserved + reading.outside)
    return used


def step_fragmentation(reading: MemoryReading) -> int:
    """Reserved minus allocated at a sample step's peak, when the step itself set the reserved
    high-water mark; 0 when it fit in memory an earlier step reserved (nothing measured)."""
    return max(0, reading.reserved - reading.peak) if reading.reserved_growth > 0 else 0


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
        if config is None:
            if memory_limit is None:
                raise TypeError("Controller needs memory_limit (e.g. 0.9 or '20GiB') or a config")
            config = TapeSACConfig(memory_limit=memory_limit, **settings)
        self.config = config
        roots = [model] if isinstance(model, torch.nn.Module) else list(model)
        self.regions = sorted(
            {m._tapesac.region for root in roots for m in root.modules() if hasattr(m, "_tapesac")}
        )
        if not self.regions:
            raise TapeSACError(
                "the controller found no checkpointed module. Fix: call "
                "tapesac_core.checkpoint_modules(model, {BlockClass}) first"
            )
        self.device = torch.device(device) if device is not None else compute_device(roots)
        self._meter = meter or (lambda: memory_meter(self.device))
        self.group = process_group
        self.model_key = ",".join(self.regions)
        self.steps = 0
        self.profiles: dict[str, RegionProfile] = {}
        self.memory = MemoryModel()
        self.plans: dict[tuple[int, ...], Plan] = {}
        self.must_only_times: dict[tuple[int, ...], list[float]] = {}
        # (bucket, tokens, seconds) of recent must-only steps: the time outside replay
        self.must_only_steps: list[tuple[tuple[int, ...], dict[str, int], float]] = []
        self._replay_walls: dict[str, list[ReplayWall]] = {}
        self._mismatches: dict[tuple[int, ...], int] = {}  # control steps in a row off the band
        self._mismatch_reprofiles = 0
        self._reprofile = False
        self.planned_times: dict[tuple[int, ...], list[float]] = {}
        self.full_times: dict[tuple[int, ...], list[float]] = {}
        self.report: StepReport | None = None
        self._profile_steps_done = 0
        self._secondary_max: dict[str, int] = {}
        self._checked: set[tuple[int, ...]] = set()
        self._planned_since_control: dict[tuple[int, ...], int] = {}
        self._planned_since_full: dict[tuple[int, ...], int] = {}
        self._raise_fragmentation = 0  # seen near the limit; applied at the next step, on all ranks
        self._raise_model_error = 0  # a peak above its prediction; likewise
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ public state

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
        return self.config.memory_limit.of(self._device_total())

    def replan(self, memory_limit: float | int | str | None = None) -> None:
        """Forget every plan, under a new ``memory_limit`` if given: each bucket is solved again
        at its next planned step (or ``plan_for``), from the profiles already taken."""
        if memory_limit is not None:
            self.config = dataclasses.replace(self.config, memory_limit=memory_limit)
        self._forget_plans()

    def plan_for(self, tokens: int | Mapping[str, int]) -> Plan:
        """The plan of the bucket of ``tokens`` (as ``step`` takes them), solved now if not
        cached. Needs the profiles of a run that reached a planned step; on every rank at once
        under torch.distributed."""
        if not self.profiles:
            raise TapeSACError(
                "plan_for needs profiled blocks: run steps until one is planned first"
            )
        per_region = self._agree_tokens(self._per_region(tokens))
        return self._plan(self._bucket(per_region), per_region)

    # ------------------------------------------------------------------ one step

    @contextmanager
    def step(self, tokens: int | Mapping[str, int]) -> Iterator[StepReport]:
        """Run one training step (forward, backward, optimizer) under TapeSAC's current plan.

        One step is one micro-batch: with gradient accumulation, open one step per micro-batch
        (under ``memory_model="sum"`` a block's forward after another block's backward in the
        same step is a TapeSACError)."""
        local = self._per_region(tokens)
        per_region = self._agree_tokens(local)
        key = self._bucket(per_region)
        mode = self._mode(per_region, local)
        plan = self._plan(key, per_region) if mode == PLANNED else None
        metered = (
            mode in (PROFILE, SAMPLE)
            and (mode == SAMPLE or self._profile_steps_done == 0)
            or (mode == PLANNED and (self.device.type != "cpu" or key not in self._checked))
        )
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
            meter = stack.enter_context(self._meter()) if metered else None
            # Must-only metered steps also measure the memory timeline (the peak-aware model).
            probe = (
                StepProbe(meter.mark)
                if meter is not None and hasattr(meter, "mark") and mode in (PROFILE, SAMPLE)
                else None
            )
            # The peak-aware model knows an earlier micro-batch's blocks freed their values before
            # the next forward; Eq. 8 ("sum") would count them alive together: refused there.
            blocks = stack.enter_context(
                trace(
                    time_nodes=mode == PROFILE,
                    one_micro_batch=self.config.memory_model == "sum",
                    verify=self._verifies(mode),
                    probe=probe,
                )
            )
            static = meter.reading().current if meter is not None else 0
            if probe is not None:
                probe.start()
            self._synchronize()
            start = time.perf_counter()
            yield report
            self._synchronize()
            report.time = time.perf_counter() - start
            end_peak = probe.close() if probe is not None else 0
            reading = meter.reading() if meter is not None else None
        report.block_traces = blocks
        report.torch_checkpointed = len(torch_checkpointed)
        if probe is not None and reading is not None and blocks:
            self.memory.add_timeline(
                probe.timeline(
                    blocks,
                    end_peak,
                    tokens=self._primary_tokens(report.local_tokens),
                    static=static,
                )
            )
        self._finish(report, reading, static)

    def _finish(self, report: StepReport, reading: MemoryReading | None, static: int) -> None:
        blocks = report.block_traces
        report.blocks = len(blocks)
        report.replayed_nodes = sum(len(b.replayed) for b in blocks)
        report.over_budget = sum(b.over_budget for b in blocks)
        if report.over_budget and "over_budget" not in self._warned:
            self._warned.add("over_budget")
            logger.info(
                "TapeSAC: %d planned values took more bytes than the plan gave their block "
                "(sizes that depend on data, e.g. tokens routed per expert) and were "
                "replayed instead, keeping the step under the limit",
                report.over_budget,
            )
        report.saved_bytes = sum(
            b.tape.bytes_of(b.saved) - b.tape.bytes_of(b.saved & set(b.tape.mandatory))
            for b in blocks
        )
        key, mode = report.bucket, report.mode
        if reading is not None:
            report.peak = reading.peak
        if report.plan is not None and report.plan.predicted_peak:
            # At this rank's own tokens: the plan was solved at its bucket's upper edge.
            report.predicted_peak = report.plan.peak_at_tokens(
                self.memory.base(self._primary_tokens(report.local_tokens))
            )
        if mode == PROFILE:
            self._take_profile(blocks, report.tokens)
        if reading is not None and mode in (PROFILE, SAMPLE):
            # This rank's memory is that of its own batch: samples carry its own token count.
            self.memory.add(
                MemorySample(
                    tokens=self._primary_tokens(report.local_tokens),
                    peak=reading.peak,
                    static=static,
                    outside=reading.outside,
                    fragmentation=step_fragmentation(reading),
                )
            )
        if mode == CONTROL or (mode == WARMUP and report.step > 0):
            self._record_time(self.must_only_times, key, report.time)
            self.must_only_steps = [
                *self.must_only_steps[1 - _WINDOW :],
                (key, dict(report.tokens), report.time),
            ]
            self._record_walls(blocks, report.tokens)
            self._planned_since_control[key] = 0
            if mode == CONTROL and key in self.plans:
                self._compare(key)
        if mode == FULL:
            self._record_time(self.full_times, key, report.time)
            self._planned_since_full[key] = 0
        if mode == PLANNED:
            self._planned_since_control[key] = self._planned_since_control.get(key, 0) + 1
            self._planned_since_full[key] = self._planned_since_full.get(key, 0) + 1
            if reading is not None and self.device.type == "cpu":
                self._checked.add(key)  # metering slows a CPU step: checked, not timed
            else:
                self._record_time(self.planned_times, key, report.time)
            if reading is not None:
                self._check_peak(report, reading)
                self._watch_limit(reading)
        report.predicted_speedup = self.plans[key].predicted_speedup if key in self.plans else None
        report.measured_speedup = self._measured(key)
        report.measured_reason = self._unmeasured_reason(key)
        report.measured_speedup_vs_full = self._measured(key, self.full_times)
        # The controller's copy keeps no block traces: their tapes (random generator states
        # among them) belong to the step, and only the caller's report may keep them longer.
        self.report = dataclasses.replace(report, block_traces=[])
        self.steps += 1

    def _record_walls(self, blocks: list, tokens: dict[str, int]) -> None:
        """Each block's measured replay in a plain must-only step (not timed per op, not metered:
        both slow the step down)."""
        for b in blocks:
            walls = self._replay_walls.setdefault(b.tape.region, [])
            walls.append(
                ReplayWall(
                    sequence=b.tape.fingerprint,
                    replayed=tuple(b.replayed),
                    seconds=b.replay_seconds,
                    tokens=tokens[b.tape.region],
                )
            )
            del walls[:-_WALLS]

    def _compare(self, key: tuple[int, ...]) -> None:
        """At a control step: measured vs predicted speedup of the bucket. Off by more than
        ``speedup_band`` (relative) at ``mismatch_windows`` control steps in a row, every region
        is profiled again and every plan solved again (at most ``_MISMATCH_REPROFILES`` times)."""
        measured, plan = self._measured(key), self.plans[key]
        if measured is None:
            return
        if abs(measured / plan.predicted_speedup - 1) <= self.config.speedup_band:
            self._mismatches.pop(key, None)
            return
        self._mismatches[key] = self._mismatches.get(key, 0) + 1
        if self._mismatches[key] < self.config.mismatch_windows:
            return
        self._mismatches.clear()
        if self._mismatch_reprofiles >= _MISMATCH_REPROFILES:
            logger.info(
                "TapeSAC: bucket %s measured %.3fx vs predicted %.3fx; already profiled "
                "again %d times, keeping the plan",
                key,
                measured,
                plan.predicted_speedup,
                self._mismatch_reprofiles,
            )
            return
        self._mismatch_reprofiles += 1
        self._reprofile = True
        self.planned_times.clear()  # they measured the plans about to be replaced
        logger.info(
            "TapeSAC: bucket %s measured %.3fx vs predicted %.3fx, beyond %.0f%% for %d "
            "control windows: profiling again\n%s",
            key,
            measured,
            plan.predicted_speedup,
            100 * self.config.speedup_band,
            self.config.mismatch_windows,
            plan.explain(measured_speedup=measured),
        )

    @staticmethod
    def _record_time(
        times: dict[tuple[int, ...], list[float]], key: tuple[int, ...], seconds: float
    ) -> None:
        recent = times.setdefault(key, [])
        recent.append(seconds)
        del recent[:-_WINDOW]

    # ------------------------------------------------------------------ modes

    def _mode(self, tokens: dict[str, int], local: dict[str, int]) -> str:
        if self.steps < self.config.warmup_steps:
            return WARMUP
        key = self._bucket(tokens)
        known = key in self.plans  # solved earlier, or restored from a checkpoint
        grown = any(
            tokens[r] > self.config.reprofile_factor * p.tokens for r, p in self.profiles.items()
        )
        needs_profile = grown or (not self.profiles and not known) or self._reprofile
        needs_sample = not known and not self.memory.covers(
            self._primary_tokens(local), self.config.resample_tolerance
        )
        if needs_profile and not self._profile_steps_done:
            self.profiles = {}
        profile, sample, raise_by, model_error = self._reduce_max(
            [
                int(needs_profile or self._profile_steps_done > 0),
                int(needs_sample),
                self._raise_fragmentation,
                self._raise_model_error,
            ]
        )
        self._raise_fragmentation = self._raise_model_error = 0
        self._apply_fragmentation(raise_by)
        if model_error > 0:  # every rank adds the largest error any rank saw
            self.memory.model_error += model_error
            self._forget_plans()
        if profile:
            self._reprofile = False
            return PROFILE
        if sample:
            return SAMPLE
        key = self._bucket(tokens)
        controls = len(self.must_only_times.get(key, ()))
        since = self._planned_since_control.get(key, 0)
        every = self.config.control_every
        if controls < self.config.control_steps or (every and controls and since >= every):
            return CONTROL
        full_every = self.config.full_control_every
        if full_every and (
            not self.full_times.get(key) or self._planned_since_full.get(key, 0) >= full_every
        ):
            return FULL
        return PLANNED

    def _verifies(self, mode: str) -> bool:
        """Whether this step looks for writes the dispatcher cannot see (``verify.py``): the
        first step if it warms up (neither timed nor metered: the check's syncs and temporaries
        distort nothing), else the first profile step."""
        if self.config.warmup_steps > 0:
            return mode == WARMUP and self.steps == 0
        return mode == PROFILE and self._profile_steps_done == 0

    def _take_profile(self, blocks: list, tokens: dict[str, int]) -> None:
        fresh = region_profiles(blocks, tokens)
        self.profiles = {r: merged(self.profiles.get(r), p) for r, p in fresh.items()}
        self._profile_steps_done += 1
        if self._profile_steps_done >= self.config.profile_steps:
            self._profile_steps_done = 0
            self._forget_plans()  # a new reference block

    # ------------------------------------------------------------------ plans

    def _plan(self, key: tuple[int, ...], tokens: dict[str, int]) -> Plan:
        if key not in self.plans:
            edges = self._edges(key)
            capacity = self._capacity()
            base = self.memory.base(self._primary_tokens(edges))
            budget = self._agree_budget(capacity - base)
            self.plans[key] = self._broadcast(lambda: self._solve(edges, budget + base, base, key))
            logger.info(
                "TapeSAC solved bucket %s (tokens %s):\n%s", key, edges, self.plans[key].explain()
            )
        return self.plans[key]

    def _solve(self, edges: dict[str, int], capacity: int, base: int, key: tuple[int, ...]) -> Plan:
        # Replay wall times are host times: on accelerators they would measure launches, not
        # kernels (events there belong to the GPU-readiness work), so only CPU profiles are checked.
        for r in edges if self.device.type == "cpu" else ():
            if r in self.profiles:
                self.profiles[r] = calibrated(
                    self.profiles[r], self._replay_walls.get(r, ()), self.config.replay_tolerance
                )
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        plan = solve_plan(
            profiles,
            edges,
            model=self.model_key,
            capacity=capacity,
            base=base,
            must_only_step_time=self._must_only_time(key, edges),
            config=self.config,
            timeline=self.memory.timeline(self._primary_tokens(edges)),
        )
        # Under the peak-aware model a must-only peak above the capacity is not the end: saving
        # removes replay temporaries, so only a plan predicted above it means nothing fits.
        if plan.predicted_peak > capacity and "base" not in self._warned:
            self._warned.add("base")
            if self.config.memory_limit.must_only:  # asked for: no warning
                logger.info(
                    "TapeSAC: memory_limit is 0: every step runs must-only (nothing saved "
                    "beyond what backward must keep)"
                )
                return plan
            lowest = (
                "must-only (nothing more saved)"
                if plan.empty
                else "the plan of the lowest predicted peak"
            )
            logger.warning(
                "TapeSAC: no plan fits the %s the memory limit %s leaves at %s tokens "
                "(%s memory model): the must-only step alone needs %s; running %s, "
                "predicted at %s",
                format_bytes(capacity),
                self.config.memory_limit,
                edges,
                plan.memory_model,
                format_bytes(plan.base),
                lowest,
                format_bytes(plan.predicted_peak),
            )
        return plan

    def _must_only_time(self, key: tuple[int, ...], edges: dict[str, int]) -> float:
        """Modelled must-only step seconds at this bucket: the time outside replay plus the
        modelled replay at the bucket's tokens. Outside replay is the median over recent
        must-only steps of (step − its modelled replay) per primary token (``outside_per_token``)
        times the bucket's: this bucket's own steps when it has three, else all of them."""
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        replay = modelled_replay(profiles, edges)
        own = [s for s in self.must_only_steps if s[0] == key]
        steps = own if len(own) >= 3 else self.must_only_steps
        rate = outside_per_token(
            (seconds, modelled_replay(profiles, tokens), self._primary_tokens(tokens))
            for _, tokens, seconds in steps
        )
        if rate is None:
            return 1.0 + replay
        return StepTime.model(rate * self._primary_tokens(edges), replay).must_only

    def step_frontier(self, key: tuple[int, ...]) -> dict[str, Any]:
        """Predicted step (peak bytes, seconds) along each region's frontier at this bucket, and the
        chosen, must-only and full-recomputation points (for plots). Full recomputation's peak is
        taken as the must-only peak; the chosen plan sits at its memory model's predicted peak
        (``peak_at``: where in the step it falls), the curves at Eq. 8's bytes."""
        plan = self.plans[key]
        edges = self._edges(key)
        profiles = {r: p for r, p in self.profiles.items() if r in edges}
        step = StepTime.of_step(self._must_only_time(key, edges), modelled_replay(profiles, edges))
        seconds = step.must_only
        curves, full = {}, seconds
        for r, p in profiles.items():
            scale = edges[r] / p.tokens
            points = p.frontier(self.config.beam_width, self.config.max_set_size)
            curves[r] = [
                (
                    plan.base + p.blocks * p.bytes_at(pt, scale),
                    step.planned(p.blocks * (points[0].time - pt.time) * scale),
                )
                for pt in points
            ]
            full += p.blocks * max(0.0, p.full_recompute_time - p.must_only_replay_time) * scale
        return {
            "curves": curves,
            "must_only": (plan.base, seconds),
            "full": (plan.base, full),
            "chosen": (
                plan.predicted_peak or plan.base + plan.saved_bytes,
                seconds / plan.predicted_speedup,
            ),
            "peak_at": plan.peak_at,
            "capacity": plan.capacity,
        }

    def _measured(
        self, key: tuple[int, ...], control: dict[tuple[int, ...], list[float]] | None = None
    ) -> float | None:
        """Median control step time (must-only, or ``control``'s) over median planned step time."""
        control_times = (self.must_only_times if control is None else control).get(key)
        planned = self.planned_times.get(key)
        if not control_times or not planned:
            return None
        return statistics.median(control_times) / statistics.median(planned)

    def _unmeasured_reason(self, key: tuple[int, ...]) -> str | None:
        """Why the bucket has no measured speedup yet (None when it has one)."""
        if self.must_only_times.get(key) and self.planned_times.get(key):
            return None
        if key not in self.plans:
            return "no plan yet for this token bucket (warming up, profiling or sampling memory)"
        if not self.must_only_times.get(key):
            return "no must-only control step timed in this token bucket yet"
        return (
            "no planned step timed in this token bucket yet (on CPU a bucket's first planned "
            "step is metered for memory, not timed)"
        )

    # ------------------------------------------------------------------ memory

    def _device_total(self) -> int:
        if self.device.type == "cpu":
            return physical_memory()[0]
        return torch.accelerator.get_memory_info(self.device)[1]

    def _capacity(self) -> int:
        """Eq. 9: limit − memory outside the allocator − safety margin − fragmentation."""
        total = self._device_total()
        return int(
            self.config.memory_limit.of(total)
            - self.memory.outside
            - self._margin_bytes(total)
            - self.memory.fragmentation
            - self.memory.model_error
        )

    def _margin_bytes(self, total: int) -> float:
        """The safety reserve: a share of the device's ``total`` memory, or of the limit when it
        is absolute."""
        limit = self.config.memory_limit
        return self.config.margin * (total if limit.fraction is not None else limit.of(total))

    def _check_peak(self, report: StepReport, reading: MemoryReading) -> None:
        """A metered planned step: its measured peak against the plan's predicted one (at the
        step's tokens, ``Plan.peak_at_tokens``). Above it by more than the margin, the error is
        added to the model (``MemoryModel.model_error``, taken off the capacity like
        fragmentation; what the correction already covers is not added again) at the next step,
        on every rank together (the largest error any rank saw), and every plan is solved again,
        so the limit holds when the model is wrong."""
        plan = report.plan
        if report.predicted_peak is None:
            return
        error = reading.peak - report.predicted_peak
        # The correction already taken off the capacity explains that much of the error: only
        # the rest raises it, so repeated errors of one size do not add up (and shrink the plans).
        unexplained = error - self.memory.model_error
        margin = self._margin_bytes(self._device_total())
        if unexplained > margin and self.config.peak_correction:
            self._raise_model_error = int(unexplained)
            logger.info(
                "TapeSAC: step peak %s measured above the predicted %s (%s model) by %s, "
                "more than the %s margin: the error is added to the memory model "
                "and the plans are solved again at the next step",
                format_bytes(reading.peak),
                format_bytes(report.predicted_peak),
                plan.memory_model,
                format_bytes(error),
                format_bytes(int(margin)),
            )

    def _watch_limit(self, reading: MemoryReading) -> None:
        """A step that came near the limit: the fragmentation estimate goes up at the next step
        (on every rank together) and plans are solved again, so they can only shrink.

        Judged on what this step used (``step_footprint``), never on reserved memory an earlier
        step left behind: that would raise again at every metered step until nothing is saved.
        Allocation retries mean the device ran out, whatever the footprint.
        """
        if self.config.memory_limit.must_only:  # asked for: there is no plan to shrink
            return
        limit = self.limit_bytes()
        used = step_footprint(reading, self.memory.measured_fragmentation)
        threshold = self.config.near_limit * limit
        if used > threshold or reading.alloc_retries > 0:
            self._raise_fragmentation = max(int(used - threshold), int(0.01 * limit))
            logger.warning(
                "TapeSAC: step peak %s (%d allocation retries) is within %.0f%% of the "
                "limit %s; raising the fragmentation estimate by %s and solving the "
                "plans again",
                format_bytes(used),
                reading.alloc_retries,
                100 * (1 - self.config.near_limit),
                format_bytes(limit),
                format_bytes(self._raise_fragmentation),
            )

    def _apply_fragmentation(self, raise_by: int) -> None:
        if raise_by > 0:
            self.memory.extra_fragmentation += raise_by
            self._forget_plans()

    def _forget_plans(self) -> None:
        """Every bucket is solved again (and its first planned step checked again on CPU)."""
        self.plans.clear()
        self._checked.clear()

    # ------------------------------------------------------------------ tokens and buckets

    def _per_region(self, tokens: int | Mapping[str, int]) -> dict[str, int]:
        if isinstance(tokens, Mapping):
            unknown = set(tokens) - set(self.regions) - {_ALL}
            if unknown:
                raise TapeSACError(
                    f"tokens name unknown region types {sorted(unknown)}; the "
                    f"model's are {self.regions}"
                )
            default = tokens.get(_ALL)
            missing = [r for r in self.regions if r not in tokens and default is None]
            if missing:
                raise TapeSACError(f"tokens miss region types {missing}: give every region's count")
            per = {r: int(tokens.get(r, default)) for r in self.regions}
        else:
            per = {r: int(tokens) for r in self.regions}
        if any(n < 1 for n in per.values()):
            raise TapeSACError(f"token counts must be >= 1, got {per}")
        return per

    def _primary_tokens(self, tokens: Mapping[str, int]) -> int:
        primary = [n for r, n in tokens.items() if r not in self.config.secondary_regions]
        return max(primary or tokens.values())

    def _bucket(self, tokens: dict[str, int]) -> tuple[int, ...]:
        """Buckets per region; secondary regions take the largest count seen so far (§3.4.4)."""
        key = []
        for r in self.regions:
            if r in self.config.secondary_regions:
                self._secondary_max[r] = max(self._secondary_max.get(r, 0), tokens[r])
                key.append(bucket(self._secondary_max[r], self.config.secondary_bucket_factor))
            else:
                key.append(bucket(tokens[r], self.config.primary_bucket_factor))
        return tuple(key)

    def bucket_tokens(self, key: tuple[int, ...]) -> dict[str, int]:
        """Per region, the upper token edge of bucket ``key``: the counts its plan is solved for."""
        return self._edges(key)

    def _edges(self, key: tuple[int, ...]) -> dict[str, int]:
        return {
            r: upper_edge(
                q,
                self.config.secondary_bucket_factor
                if r in self.config.secondary_regions
                else self.config.primary_bucket_factor,
            )
            for r, q in zip(self.regions, key)
        }

    # ------------------------------------------------------------------ ranks

    def _distributed(self) -> bool:
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _reduce_max(self, numbers: list[int]) -> list[int]:
        if not self._distributed():
            return numbers
        dist = torch.distributed
        t = torch.tensor(numbers, dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]

    def _collective_device(self) -> torch.device:
        """Where this group's collectives take their tensors: the CPU for gloo, else the
        controller's device (the current CUDA device may be another one: several devices in
        one process, or a rank that never called ``torch.cuda.set_device``)."""
        if self.device.type == "cpu" or torch.distributed.get_backend(self.group) == "gloo":
            return torch.device("cpu")
        return self.device

    def _agree_tokens(self, tokens: dict[str, int]) -> dict[str, int]:
        """All ranks run the bucket of the largest token counts."""
        return dict(zip(self.regions, self._reduce_max([tokens[r] for r in self.regions])))

    def _agree_budget(self, budget: int) -> int:
        """The smallest remaining capacity of any rank."""
        return -self._reduce_max([-budget])[0]

    def _broadcast(self, solve: Callable[[], Plan]) -> Plan:
        """Rank 0 solves; every rank applies the plan it broadcasts."""
        if not self._distributed():
            return solve()
        dist = torch.distributed
        payload: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                payload = [solve().to_json()]
            except Exception as e:  # the other ranks wait in the broadcast: tell them, then raise
                payload = [{"error": f"{type(e).__name__}: {e}"}]
        dist.broadcast_object_list(
            payload,
            src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
            group=self.group,
            device=self._collective_device(),
        )
        if isinstance(payload[0], dict):
            raise TapeSACError(f"TapeSAC: solving the plan failed on rank 0: {payload[0]['error']}")
        return Plan.from_json(payload[0], model=self.model_key)

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Plan cache, memory samples and step times: resuming needs no new profiling for known buckets."""
        return {
            "version": _STATE_VERSION,
            "model": self.model_key,
            "steps": self.steps,
            "plans": {",".join(map(str, k)): p.to_json() for k, p in self.plans.items()},
            "samples": [vars(s) for s in self.memory.samples],
            "extra_fragmentation": self.memory.extra_fragmentation,
            "model_error": self.memory.model_error,
            "must_only_times": {",".join(map(str, k)): v for k, v in self.must_only_times.items()},
            "planned_times": {",".join(map(str, k)): v for k, v in self.planned_times.items()},
            "full_times": {",".join(map(str, k)): v for k, v in self.full_times.items()},
            "must_only_steps": [[list(k), t, s] for k, t, s in self.must_only_steps],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; plans from another model are refused."""
        if state.get("model") != self.model_key:
            raise TapeSACError(
                f"TapeSAC state is for region types {state.get('model')!r}, this "
                f"model has {self.model_key!r}: it comes from another model"
            )
        keys = lambda d: {tuple(int(x) for x in k.split(",")): v for k, v in d.items()}  # noqa: E731
        self.steps = state["steps"]
        version = state.get("version", 1)
        if version != _STATE_VERSION and state["plans"]:
            # Version 1 plans predicted speedups with a time model that could explode, version 2
            # plans bounded memory by Eq. 8 alone: solve again (after profiling).
            logger.info(
                "TapeSAC: state version %s is not this TapeSAC's (version %s: plans with "
                "a step time model and a predicted peak): its %d plans are solved again",
                version,
                _STATE_VERSION,
                len(state["plans"]),
            )
            self.plans = {}
        else:
            self.plans = {
                k: Plan.from_json(v, model=self.model_key) for k, v in keys(state["plans"]).items()
            }
        self.memory = MemoryModel(
            extra_fragmentation=state["extra_fragmentation"],
            model_error=int(state.get("model_error", 0)),
        )
        for s in state["samples"]:
            self.memory.add(MemorySample(**s))
        self.must_only_times = keys(state["must_only_times"])
        self.planned_times = keys(state["planned_times"])
        self.full_times = keys(state.get("full_times", {}))  # absent in states before it existed
        # Version 1 kept no tokens per must-only step: each bucket's upper edge stands in.
        self.must_only_steps = [
            (tuple(k), t, s) for k, t, s in state.get("must_only_steps", [])
        ] or [(k, self._edges(k), s) for k, v in self.must_only_times.items() for s in v]
