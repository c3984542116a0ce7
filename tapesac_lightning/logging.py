"""TapeSAC metrics for any tracker (Lightning loggers, Accelerate trackers): scalars every step, the
plan and its frontier when solved. One definition of names and meanings for both integrations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from tapesac_core import Controller, StepReport
from tapesac_core.units import format_bytes

SCALARS = ("tapesac/step_time_ms", "tapesac/memory_limit_bytes", "tapesac/saved_bytes",
           "tapesac/replayed_nodes", "tapesac/peak_memory_bytes", "tapesac/predicted_speedup",
           "tapesac/measured_speedup")


def step_metrics(report: StepReport) -> dict[str, float]:
    """The step's ``tapesac/*`` scalars (speedups once known, peak when measured)."""
    values = (report.time * 1e3, report.limit, report.saved_bytes, report.replayed_nodes,
              report.peak, report.predicted_speedup, report.measured_speedup)
    return {name: float(v) for name, v in zip(SCALARS, values) if v is not None}


class Publisher:
    """Sends finished steps to a tracker: scalars every step; a new plan's ``explain()`` table as
    text and its frontier as an image where the tracker takes them (a TensorBoard writer)."""

    def __init__(self) -> None:
        self._logged_plans: set[str] = set()

    def publish(self, controller: Controller, report: StepReport, step: int,
                log_scalars: Callable[[dict[str, float], int], None], writer: Any) -> None:
        """Log ``report`` at ``step`` through ``log_scalars``; text and image through ``writer``."""
        log_scalars(step_metrics(report), step)
        plan = report.plan
        if plan is None or plan.to_json() in self._logged_plans:
            return
        self._logged_plans.add(plan.to_json())
        if writer is None or not hasattr(writer, "add_text"):
            return
        writer.add_text("tapesac/plan", "```\n" + plan.explain() + "\n```", step)
        figure = frontier_image(controller.step_frontier(report.bucket))
        writer.add_image("tapesac/frontier", figure, step, dataformats="HWC")


def frontier_image(frontier: dict[str, Any], size: tuple[int, int] = (640, 400)) -> np.ndarray:
    """Predicted step time against step peak memory: one curve per region type; the chosen plan
    (red), must-only (blue), full recomputation (black) and the capacity (orange) marked."""
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    points = [p for curve in frontier["curves"].values() for p in curve]
    points += [frontier["chosen"], frontier["must_only"], frontier["full"], (frontier["capacity"], 0.0)]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) or 1
    y0, y1 = min(ys[:-1]), max(ys) or 1
    left, right, top, bottom = 70, width - 20, 20, height - 50

    def at(p: tuple[float, float]) -> tuple[float, float]:
        fx = (p[0] - x0) / ((x1 - x0) or 1)
        fy = (p[1] - y0) / ((y1 - y0) or 1)
        return left + fx * (right - left), bottom - fy * (bottom - top)

    draw.line([(left, top), (left, bottom), (right, bottom)], fill="black")
    draw.text((left, bottom + 15), f"predicted step peak {format_bytes(x0)} .. {format_bytes(x1)}",
              fill="black")
    cap = at((frontier["capacity"], y0))[0]
    draw.line([(cap, top), (cap, bottom)], fill="orange")
    draw.text((cap - 60, bottom + 30), "capacity", fill="orange")
    draw.text((5, top), f"{y1 * 1e3:.0f} ms", fill="black")
    draw.text((5, bottom - 10), f"{y0 * 1e3:.0f} ms", fill="black")
    for curve in frontier["curves"].values():
        if len(curve) > 1:
            draw.line([at(p) for p in curve], fill="gray", width=2)
    for name, color in (("full", "black"), ("must_only", "blue"), ("chosen", "red")):
        x, y = at(frontier[name])
        draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=color)
        label = name.replace("_", "-")
        draw.text((x + 8 if x < right - 80 else x - 70, y - 16), label, fill=color)
    return np.asarray(image)
