"""TapeSAC metrics for the Lightning logger: scalars every step, the plan and its frontier when solved."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from tapesac_core import Controller, StepReport
from tapesac_core.units import format_bytes


def log_step(logger: Any, report: StepReport, step: int) -> None:
    """The step's scalars: ``tapesac/*`` (speedups once known, peak when measured)."""
    metrics = {"tapesac/step_time_ms": report.time * 1e3,
               "tapesac/memory_limit_bytes": float(report.limit),
               "tapesac/saved_bytes": float(report.saved_bytes),
               "tapesac/replayed_nodes": float(report.replayed_nodes)}
    optional = {"tapesac/peak_memory_bytes": report.peak,
                "tapesac/predicted_speedup": report.predicted_speedup,
                "tapesac/measured_speedup": report.measured_speedup}
    metrics.update({k: float(v) for k, v in optional.items() if v is not None})
    logger.log_metrics(metrics, step=step)


def log_plan(logger: Any, controller: Controller, report: StepReport, step: int) -> None:
    """A new plan: its ``explain()`` table as text and its frontier as an image (TensorBoard)."""
    writer = getattr(logger, "experiment", None)
    if writer is None or not hasattr(writer, "add_text"):
        return
    writer.add_text("tapesac/plan", "```\n" + report.plan.explain() + "\n```", step)
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
