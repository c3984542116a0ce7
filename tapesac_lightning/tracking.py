"""TapeSAC metrics for any tracker (Lightning loggers, Accelerate trackers): scalars every step, the
plan and its frontier when solved, under the names in ``tapesac_core.metric_names``. One
definition of their meanings for both integrations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapesac_core import Controller, StepReport
from tapesac_core import metric_names as names
from tapesac_core.control.step_report import StepMode
from tapesac_core.report.figures import MeasuredPoint, frontier_figure, image_array
from tapesac_core.report.report import LoggedPlan


def step_metrics(report: StepReport) -> dict[str, float]:
    """The step's ``tapesac/*`` scalars (speedups once known, peak when measured)."""
    values = {
        names.STEP_TIME_MS: report.time * 1e3,
        names.MEMORY_LIMIT_BYTES: report.limit,
        names.SAVED_BYTES: report.saved_bytes,
        names.REPLAYED_NODES: report.replayed_nodes,
        names.PEAK_MEMORY_BYTES: report.peak,
        names.PREDICTED_SPEEDUP: report.predicted_speedup,
        names.MEASURED_SPEEDUP: report.measured_speedup,
        names.MEASURED_SPEEDUP_VS_FULL: report.measured_speedup_vs_full,
        names.PREDICTED_PEAK_BYTES: report.predicted_peak,
        names.PLAIN_BLOCKS: report.plain_blocks,
        names.TORCH_CHECKPOINT_BLOCKS: report.torch_checkpointed,
        names.STEADY_BLOCKS: report.steady_blocks,
        names.OFFLOADED_BYTES: report.offloaded_bytes,
        names.COPY_TIME: report.copy_time * 1e3,
    }
    return {name: float(v) for name, v in values.items() if v is not None}


def _label(mode: StepMode) -> str | None:
    """The figure's label of a step's measured peak: planned or must-only (full-checkpointing
    steps are not metered)."""
    if mode == StepMode.PLANNED:
        return "planned"
    return "must-only" if mode.must_only else None


class Publisher:
    """Sends finished steps to a tracker: scalars every step; a new plan's ``explain()`` table and
    its JSON as text and its frontier figure as an image where the tracker takes them (a
    TensorBoard writer), and the frontier again with the measured steps on top when training ends."""

    def __init__(self) -> None:
        self._logged_plans: set[str] = set()
        self._peaks: dict[tuple[tuple[int, ...], str], int] = {}
        self._last: StepReport | None = None

    def publish(
        self,
        controller: Controller,
        report: StepReport,
        step: int,
        log_scalars: Callable[[dict[str, float], int], None],
        writer: Any,
    ) -> None:
        """Log ``report`` at ``step`` through ``log_scalars``; text and image through ``writer``."""
        log_scalars(step_metrics(report), step)
        # A rank's peak is its own batch's: drawn against the bucket only if that batch had the
        # bucket's (agreed, largest) token count.
        label = _label(report.mode)
        if report.peak is not None and label and report.local_tokens in ({}, report.tokens):
            self._peaks[report.bucket, label] = report.peak
        self._last = report
        plan = report.plan
        if plan is None or plan.to_json() in self._logged_plans:
            return
        self._logged_plans.add(plan.to_json())
        if writer is None or not hasattr(writer, "add_text"):
            return
        logged = LoggedPlan(plan=plan, measured_speedup=report.measured_speedup)
        # The table in a Markdown fence, as TensorBoard shows it; the plan as data beside it, what
        # the run report reads back.
        writer.add_text(names.PLAN_TEXT, f"```\n{logged.text()}\n```", step)
        writer.add_text(names.PLAN_JSON, logged.to_json(), step)
        writer.add_image(
            names.FRONTIER_IMAGE,
            image_array(self.figure(controller, report.bucket)),
            step,
            dataformats="HWC",
        )

    def finish(self, controller: Controller, step: int, writer: Any) -> None:
        """At the end of training: the last plan's frontier with its bucket's measured steps."""
        last = self._last
        if (
            last is None
            or last.bucket not in controller.plans
            or writer is None
            or not hasattr(writer, "add_image")
        ):
            return
        writer.add_image(
            names.FRONTIER_IMAGE,
            image_array(self.figure(controller, last.bucket)),
            step,
            dataformats="HWC",
        )

    def figure(self, controller: Controller, key: tuple[int, ...]) -> Any:
        """The bucket's predicted frontier and its measured must-only, full-checkpointing and
        planned steps."""
        times = controller.times.of(key)
        measured = [
            MeasuredPoint.of(label, seconds, self._peaks.get((key, label)))
            for label, seconds in (
                ("must-only", times.must_only),
                ("full", times.full),
                ("planned", times.planned),
            )
            if seconds
        ]
        tokens = ", ".join(f"{n} ({r})" for r, n in controller.bucket_tokens(key).items())
        return frontier_figure(
            controller.step_frontier(key), measured, title=f"TapeSAC plan for up to {tokens} tokens"
        )
