"""The memory a step's plan may use (Eq. 9) and the corrections metered steps ask of it.

The limit is a promise: plans fill ``capacity`` (the limit less memory outside the allocator,
memory outside the blocks that grew since memory was sampled, the safety margin, fragmentation and
the memory model's measured error), and metered steps are checked. Memory in use at a step's start
that moved by more than the margin is measured again; a planned step above its predicted peak asks
to add the error to the model; a planned step near the limit asks to raise the fragmentation
estimate, unless the plan already is the lowest-peak one (nothing fits: raising it would only
solve the same plan again). All are returned as a ``Correction`` and applied at the next step, on
every rank together, by ``apply``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..config import TapeSACConfig
from ..measure.memory import MemoryReading
from ..plan.offload_choice import Link
from ..plan.plan import Plan
from ..units import format_bytes
from .memory_model import MemoryModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Correction:
    """Bytes to add to the memory model (its fragmentation estimate and its measured error) and,
    when it moved, the memory outside the blocks measured anew (this rank's)."""

    fragmentation: int = 0
    model_error: int = 0
    outside_growth: int | None = None

    def __bool__(self) -> bool:
        return self.fragmentation > 0 or self.model_error > 0 or self.outside_growth is not None


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


class MemoryBudget:
    """The limit in bytes and the capacity it leaves, on a device of ``total()`` bytes (physical
    memory on CPU); the checks of metered planned steps against them."""

    def __init__(self, config: TapeSACConfig, total: Callable[[], int]) -> None:
        self.config = config
        self.total = total
        self._said_unfit = False
        self._said_over_budget = False
        self._said_inputs_kept = False
        self._said_full_over = False

    def limit_bytes(self) -> int:
        """The memory limit in bytes on this device (or host, on CPU)."""
        return self.config.parsed_memory_limit.of(self.total())

    def margin_bytes(self) -> float:
        """The safety reserve: a share of the device's memory, or of the limit when it is
        absolute."""
        limit, total = self.config.parsed_memory_limit, self.total()
        return self.config.margin * (total if limit.fraction is not None else limit.of(total))

    def capacity(self, memory: MemoryModel) -> int:
        """Eq. 9: limit − memory outside the allocator − growth of the memory outside the blocks
        − safety margin − fragmentation − the memory model's measured error."""
        return int(
            self.limit_bytes()
            - memory.outside
            - memory.static_growth
            - self.margin_bytes()
            - memory.fragmentation
            - memory.model_error
        )

    def outside_moved(self, static: int, memory: MemoryModel) -> int | None:
        """The growth of the memory outside the blocks (``static``: in use at a metered step's
        start) when it moved by more than the margin from what the model takes, else None."""
        growth = memory.growth_at(static)
        return growth if abs(growth - memory.static_growth) > self.margin_bytes() else None

    def check(
        self,
        reading: MemoryReading,
        static: int,
        plan: Plan | None,
        predicted_peak: int | None,
        memory: MemoryModel,
    ) -> Correction:
        """What a metered step asks of the memory model: memory outside the blocks measured
        anew if it moved; for a planned step (``plan`` not None) also the error of its peak
        beyond the margin (the move taken out) and a fragmentation raise near the limit (none if
        the move explains it, or when nothing fits: the lowest-peak plan already runs)."""
        growth = self.outside_moved(static, memory)
        if plan is None:  # a must-only step: nothing saved that a smaller plan could give back
            return Correction(outside_growth=growth)
        moved = 0 if growth is None else growth - memory.static_growth
        unfit = plan.predicted_peak > plan.capacity
        return Correction(
            model_error=self._peak_error(reading, moved, predicted_peak, memory, plan.memory_model),
            fragmentation=0
            if growth is not None or unfit
            else self._near_limit_raise(reading, memory),
            outside_growth=growth,
        )

    def check_full(
        self, reading: MemoryReading, static: int, predicted_peak: int | None, memory: MemoryModel
    ) -> Correction:
        """What a metered full-checkpointing step asks of the memory model: memory outside the
        blocks measured anew if it moved, and its peak's error beyond the margin against the
        timeline model's prediction (``_peak_error``). The error lowers the capacity, against
        which such steps and plans' blocks under torch's checkpoint are then predicted. A step
        above the limit is also said, once."""
        growth = self.outside_moved(static, memory)
        moved = 0 if growth is None else growth - memory.static_growth
        used = step_footprint(reading, memory.measured_fragmentation)
        if used > self.limit_bytes() and not self._said_full_over:
            self._said_full_over = True
            logger.warning(
                "TapeSAC: a full-checkpointing step (every block under torch.utils.checkpoint, "
                "measured to price such blocks) needed %s, above the memory limit %s; its "
                "predicted peak was %s. The error is added to the memory model, and such steps "
                "run only where predicted within the capacity it leaves "
                "(torch_checkpoint_blocks=False turns them off)",
                format_bytes(used),
                format_bytes(self.limit_bytes()),
                "unknown" if predicted_peak is None else format_bytes(predicted_peak),
            )
        return Correction(
            model_error=self._peak_error(reading, moved, predicted_peak, memory, "peak"),
            outside_growth=growth,
        )

    def near_limit_note(self, memory: MemoryModel) -> str | None:
        """What ``explain()`` says when the near-limit rule lowered the capacity, if it did."""
        if memory.extra_fragmentation <= 0:
            return None
        return (
            f"the near-limit rule lowered the capacity by "
            f"{format_bytes(memory.extra_fragmentation)}: a metered step came within "
            f"{100 * (1 - self.config.near_limit):.2g}% of the limit or its allocator retried "
            "(near_limit=1.0 turns the rule off)"
        )

    def apply(self, correction: Correction, memory: MemoryModel) -> bool:
        """Apply ``correction`` (agreed by every rank: the largest any saw; the outside growth
        this rank's own) to the memory model; whether anything changed."""
        memory.extra_fragmentation += correction.fragmentation
        memory.model_error += correction.model_error
        if correction.outside_growth is not None:
            memory.static_growth = correction.outside_growth
            self._said_unfit = False  # another situation: said again if nothing fits
        return bool(correction)

    def say_unfit(
        self,
        plan: Plan,
        capacity: int,
        edges: Mapping[str, int],
        memory: MemoryModel,
        link: Link | None = None,
    ) -> None:
        """No plan fits ``capacity`` at token counts ``edges``: said once while the memory outside
        the blocks stays as it is, with by how much and what would fix it (where offloading was
        refused, the ``link`` it was too slow on); at info level when must-only was asked for."""
        if self._said_unfit:
            return
        self._said_unfit = True
        if self.config.parsed_memory_limit.must_only:
            logger.info(
                "TapeSAC: memory_limit is 0: every step runs must-only (nothing saved beyond "
                "what backward must keep)"
            )
            return
        missing = plan.predicted_peak - capacity
        static = (memory.reference_static or 0) + memory.static_growth
        logger.warning(
            "TapeSAC: no plan fits: the memory limit %s cannot be met at %s tokens (%s memory "
            "model). The lowest-peak plan (%s) is predicted at %s, %s above the %s the limit "
            "leaves after the margin and fragmentation; the must-only step alone needs %s. "
            "Memory in use when a step starts (outside the blocks: no plan gives it back) is %s, "
            "%s since memory was sampled. Training goes on with the lowest-peak plan and solves "
            "again when that memory or the batch changes.%s Fix: a memory_limit of at least %s, "
            "less memory outside the blocks, or a smaller batch",
            format_bytes(self.limit_bytes()),
            dict(edges),
            plan.memory_model,
            "must-only, nothing more saved" if plan.empty else "saving values",
            format_bytes(plan.predicted_peak),
            format_bytes(missing),
            format_bytes(capacity),
            format_bytes(plan.base),
            format_bytes(static),
            ("+" if memory.static_growth >= 0 else "-") + format_bytes(abs(memory.static_growth)),
            _offload_refusal(plan, link),
            format_bytes(self.limit_bytes() + missing),
        )

    def say_inputs_kept(self) -> None:
        """An offloading step found a block's inputs held outside it when the next block
        started, where profiling had found them the block's alone: said once."""
        if not self._said_inputs_kept:
            self._said_inputs_kept = True
            logger.info(
                "TapeSAC: a block's inputs were still held outside it when the next block "
                "started (e.g. the caller keeps every layer's hidden states), so offloading took "
                "less off the device than profiled; plans are solved again with what was measured"
            )

    def say_over_budget(self, values: int) -> None:
        """``values`` planned values of a step were replayed, not kept: their bytes exceeded what
        the plan gave their block. Said once: sizes that depend on data recur every step."""
        if values and not self._said_over_budget:
            self._said_over_budget = True
            logger.info(
                "TapeSAC: %d planned values took more bytes than the plan gave their block "
                "(sizes that depend on data, e.g. tokens routed per expert) and were replayed "
                "instead, keeping the step under the limit",
                values,
            )

    def _peak_error(
        self,
        reading: MemoryReading,
        moved: int,
        predicted_peak: int | None,
        memory: MemoryModel,
        model: str,
    ) -> int:
        """The measured peak, less what memory outside the blocks ``moved`` since the plan,
        against the plan's predicted one (at the step's tokens). Above it by more than the margin,
        the error not yet in the model's correction is returned, so that repeated errors of one
        size do not add up (and shrink the plans)."""
        if predicted_peak is None or not self.config.peak_correction:
            return 0
        error = reading.peak - moved - predicted_peak
        unexplained = error - memory.model_error
        margin = self.margin_bytes()
        if unexplained <= margin:
            return 0
        logger.info(
            "TapeSAC: step peak %s measured above the predicted %s (%s model) by %s, "
            "more than the %s margin: the error is added to the memory model "
            "and the plans are solved again at the next step",
            format_bytes(reading.peak),
            format_bytes(predicted_peak),
            model,
            format_bytes(error),
            format_bytes(int(margin)),
        )
        return int(unexplained)

    def _near_limit_raise(self, reading: MemoryReading, memory: MemoryModel) -> int:
        """A step that came near the limit: the fragmentation estimate goes up, so that plans can
        only shrink.

        Judged on what this step used (``step_footprint``), never on reserved memory an earlier
        step left behind: that would raise again at every metered step until nothing is saved.
        Allocation retries mean the device ran out, whatever the footprint. A limit of 0 asked
        for must-only: there is no plan to shrink. A meter of live tensor bytes (CPU) has no
        allocator, so nothing fragments: a peak above the prediction is the model's error
        (``_peak_error``), and a plan that fills the limit exactly is what was asked for.
        """
        if self.config.parsed_memory_limit.must_only or not reading.allocator:
            return 0
        limit = self.limit_bytes()
        used = step_footprint(reading, memory.measured_fragmentation)
        threshold = self.config.near_limit * limit
        if used <= threshold and reading.alloc_retries == 0:
            return 0
        raise_by = max(int(used - threshold), int(0.01 * limit))
        logger.warning(
            "TapeSAC: step peak %s (%d allocation retries) is within %.0f%% of the "
            "limit %s; raising the fragmentation estimate by %s and solving the "
            "plans again",
            format_bytes(used),
            reading.alloc_retries,
            100 * (1 - self.config.near_limit),
            format_bytes(limit),
            format_bytes(raise_by),
        )
        return raise_by


def _offload_refusal(plan: Plan, link: Link | None) -> str:
    """What the no-fit warning says of offloading that the link was too slow for (or nothing)."""
    if link is None or not plan.offload_refused:
        return ""
    return (
        f" Offloading to host memory was refused for {plan.offload_refused} blocks: the link, "
        f"measured at {format_bytes(round(link.to_host))}/s to the host and "
        f"{format_bytes(round(link.to_device))}/s back, is too slow (their copies would wait "
        "longer than the compute that hides them)."
    )
