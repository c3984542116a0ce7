"""What every example job records and prints, whatever its library: each step's TapeSAC counters
and the closing summary (no Lightning import, so the Accelerate and Trainer jobs start faster)."""

from __future__ import annotations

from typing import Any

from tapesac_core import Controller, StepReport
from tapesac_core.report.report import run_summary


def step_record(r: StepReport) -> dict[str, Any]:
    """A step's TapeSAC counters as JSON-ready values."""
    return dict(
        mode=r.mode,
        bucket=list(r.bucket),
        time=r.time,
        replayed=r.replayed_nodes,
        saved_bytes=r.saved_bytes,
        peak=r.peak,
        predicted_peak=r.predicted_peak,
        limit=r.limit,
        plan_empty=r.plan.empty if r.plan else None,
        predicted=r.predicted_speedup,
        measured=r.measured_speedup,
        measured_vs_full=r.measured_speedup_vs_full,
        torch_checkpointed=r.torch_checkpointed,
        blocks=r.blocks,
        plain_blocks=r.plain_blocks,
        steady_blocks=r.steady_blocks,
        plan=r.plan.to_json() if r.plan else None,
    )


def summary(controller: Controller, records: list[dict[str, Any]]) -> str:
    """The closing summary, from the run's own steps (``run_summary``), with where the limit
    sits between must-only and saving everything useful in the final plan's bucket."""
    report = controller.report
    headroom = None
    if report is not None and report.bucket in controller.plans:
        frontier = controller.step_frontier(report.bucket)
        low = frontier.must_only[0]
        headroom = (low, low + sum(max(x for x, _ in c) - low for c in frontier.curves.values()))
    plan = controller.plans.get(report.bucket) if report is not None else None
    return run_summary(
        records,
        controller.limit_bytes(),
        plan,
        headroom,
        report.measured_speedup if report is not None else None,
    )
