"""The memory a step's plan may use (Eq. 9) and the corrections metered steps ask of it.

The limit is a promise: plans fill ``capacity`` (the limit less memory outside the allocator, the
safety margin, fragmentation and the memory model's measured error), and each metered planned step
is checked. A step above its predicted peak asks to add the error to the model; a step near the
limit asks to raise the fragmentation estimate. Both are returned as a ``Correction`` and applied
at the next step, on every rank together, by ``apply``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .config import TapeSACConfig
from .memory import MemoryReading
from .plan.plan import Plan
from .profile import MemoryModel
from .units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Correction:
    """Bytes to add to the memory model: its fragmentation estimate and its measured error."""

    fragmentation: int = 0
    model_error: int = 0

    def __bool__(self) -> bool:
        return self.fragmentation > 0 or self.model_error > 0


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

    def limit_bytes(self) -> int:
        """The memory limit in bytes on this device (or host, on CPU)."""
        return self.config.memory_limit.of(self.total())

    def margin_bytes(self) -> float:
        """The safety reserve: a share of the device's memory, or of the limit when it is
        absolute."""
        limit, total = self.config.memory_limit, self.total()
        return self.config.margin * (total if limit.fraction is not None else limit.of(total))

    def capacity(self, memory: MemoryModel) -> int:
        """Eq. 9: limit − memory outside the allocator − safety margin − fragmentation − the
        memory model's measured error."""
        return int(
            self.limit_bytes()
            - memory.outside
            - self.margin_bytes()
            - memory.fragmentation
            - memory.model_error
        )

    def check(
        self, reading: MemoryReading, predicted_peak: int | None, memory: MemoryModel, model: str
    ) -> Correction:
        """What a metered planned step asks of the memory model (``model``: the plan's memory
        model, for the log): its error beyond the margin, and a fragmentation raise near the
        limit."""
        return Correction(
            model_error=self._peak_error(reading, predicted_peak, memory, model),
            fragmentation=self._near_limit_raise(reading, memory),
        )

    @staticmethod
    def apply(correction: Correction, memory: MemoryModel) -> bool:
        """Add ``correction`` (agreed by every rank: the largest any saw) to the memory model;
        whether anything changed, so that every plan must be solved again."""
        memory.extra_fragmentation += correction.fragmentation
        memory.model_error += correction.model_error
        return bool(correction)

    def say_unfit(self, plan: Plan, capacity: int, edges: Mapping[str, int]) -> None:
        """No plan fits ``capacity`` at token counts ``edges``: said once per limit, at info level
        when must-only was asked for."""
        if self._said_unfit:
            return
        self._said_unfit = True
        if self.config.memory_limit.must_only:
            logger.info(
                "TapeSAC: memory_limit is 0: every step runs must-only (nothing saved beyond "
                "what backward must keep)"
            )
            return
        logger.warning(
            "TapeSAC: no plan fits the %s the memory limit %s leaves at %s tokens "
            "(%s memory model): the must-only step alone needs %s; running %s, "
            "predicted at %s",
            format_bytes(capacity),
            self.config.memory_limit,
            dict(edges),
            plan.memory_model,
            format_bytes(plan.base),
            "must-only (nothing more saved)"
            if plan.empty
            else "the plan of the lowest predicted peak",
            format_bytes(plan.predicted_peak),
        )

    def _peak_error(
        self, reading: MemoryReading, predicted_peak: int | None, memory: MemoryModel, model: str
    ) -> int:
        """The measured peak against the plan's predicted one (at the step's tokens). Above it by
        more than the margin, the error not yet in the model's correction is returned, so that
        repeated errors of one size do not add up (and shrink the plans)."""
        if predicted_peak is None or not self.config.peak_correction:
            return 0
        error = reading.peak - predicted_peak
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
        for must-only: there is no plan to shrink.
        """
        if self.config.memory_limit.must_only:
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
