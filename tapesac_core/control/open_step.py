"""What one controller step runs under, from ``begin_step`` to ``end_step``: its plan, torch's
checkpoint (a full-checkpointing step), the memory meter and the timeline probe (metered steps)
and the trace of its blocks; closed, what the trace counted, the meter read and the probe's memory
timeline."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

from ..blocks.plan_scope import use_plan
from ..blocks.trace_scope import torch_checkpointing, trace
from ..measure.memory import MemoryMeter, MemoryReading, marker
from ..measure.timeline import StepProbe
from ..plan.peak_timeline import Timeline
from ..tape.block import BlockTrace
from ..tape.offload import Offload
from .step_report import FULL, PROFILE, SAMPLE, StepReport


@dataclasses.dataclass(frozen=True)
class OpenStep:
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
    device: torch.device
    offload: Offload | None  # the step's offloaded values, where its plan offloads

    @classmethod
    def open(
        cls,
        report: StepReport,
        *,
        meter: Callable[[], MemoryMeter] | None,
        records: bool,
        verify: bool,
        one_micro_batch: bool,
        device: torch.device,
        offload: Offload | None = None,
    ) -> OpenStep:
        """Enter the scopes of the step ``report`` starts: under its plan, metered by a meter of
        ``meter`` (None: not metered), its blocks recording (``records``) and looking for hidden
        writes (``verify``) as the schedule says, its plan's offloading blocks copying to
        ``offload``'s host buffers."""
        mode = report.mode
        with ExitStack() as stack:
            if report.plan is not None:
                stack.enter_context(use_plan(report.plan))
            torch_checkpointed = stack.enter_context(torch_checkpointing()) if mode == FULL else []
            opened = stack.enter_context(meter()) if meter is not None else None
            # Must-only metered steps also measure the memory timeline (the peak-aware model).
            mark = marker(opened) if mode in (PROFILE, SAMPLE) else None
            probe = StepProbe(mark) if mark is not None else None
            # The peak-aware model knows an earlier micro-batch's blocks freed their values before
            # the next forward; Eq. 8 ("sum") would count them alive together: refused there.
            plain: list[str] = []
            planned_checkpoint: list[str] = []
            blocks = stack.enter_context(
                trace(
                    time_nodes=mode == PROFILE,
                    one_micro_batch=one_micro_batch,
                    verify=verify,
                    probe=probe,
                    plain=plain,
                    torch_checkpointed=planned_checkpoint,
                    record=records,
                    offload=offload,
                )
            )
            static = opened.reading().current if opened is not None else 0
            if probe is not None:
                probe.start()
            _synchronize(device)
            return cls(
                report,
                stack.pop_all(),  # left open until end_step; closed here if anything above fails
                opened,
                probe,
                static,
                records,
                blocks,
                torch_checkpointed,
                plain,
                planned_checkpoint,
                time.perf_counter(),
                device,
                offload,
            )

    def close(self, tokens: int) -> tuple[MemoryReading | None, Timeline | None]:
        """Close the step's scopes, its report timed and its blocks counted; the meter's reading
        and the memory timeline of its blocks at ``tokens`` (the count memory scales with; None
        without both a meter and a probe, or without blocks)."""
        report, probe = self.report, self.probe
        with self.stack:
            _synchronize(self.device)
            report.time = time.perf_counter() - self.start
            end_peak = probe.close() if probe is not None else 0
            reading = self.meter.reading() if self.meter is not None else None
        report.count_blocks(self.blocks)
        report.torch_checkpointed = len(self.torch_checkpointed) + len(self.planned_checkpoint)
        report.plain_blocks = len(self.plain)
        if self.offload is not None and report.plan is not None:
            report.offloaded_bytes, report.copy_time = self.offload.bytes, report.plan.copy_time
        if probe is None or reading is None or not self.blocks:
            return reading, None
        return reading, probe.timeline(self.blocks, end_peak, tokens=tokens, static=self.static)

    def discard(self, error: BaseException) -> None:
        """Close the step's scopes on ``error``: nothing it measured is kept."""
        self.stack.__exit__(type(error), error, error.__traceback__)


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
