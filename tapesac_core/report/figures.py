"""Figures drawn with matplotlib: the memory-time frontier of a plan, and image arrays for trackers.

One figure code for TensorBoard and ``tapesac report``; the benchmarks draw their comparisons
(``benchmarks/figures.py``) on the same axes. Figures are drawn on matplotlib's Agg canvas
without pyplot (no display, no global figure state); matplotlib is imported inside the
functions, so importing ``tapesac_core`` stays cheap.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import metric_names as names
from ..units import MiB

if TYPE_CHECKING:
    from ..control.step_frontier import StepFrontier


@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """Steps measured in one mode: their peak (None when not metered) and median seconds with
    the interquartile range, over ``count`` steps."""

    label: str
    peak: int | None
    seconds: float
    q1: float
    q3: float
    count: int

    @classmethod
    def of(cls, label: str, seconds: Sequence[float], peak: int | None = None) -> MeasuredPoint:
        """Median and quartiles of ``seconds`` (at least one)."""
        q1, median, q3 = (
            statistics.quantiles(seconds, n=4, method="inclusive")
            if len(seconds) > 1
            else [seconds[0]] * 3
        )
        return cls(label=label, peak=peak, seconds=median, q1=q1, q3=q3, count=len(seconds))


def frontier_figure(
    frontier: StepFrontier, measured: Sequence[MeasuredPoint] = (), title: str = "TapeSAC plan"
) -> Any:
    """Predicted step time against predicted step peak: one curve per region type, the chosen
    plan, must-only, full recomputation and the capacity; where plans may offload, the best
    plans' frontier with values kept on the device beside the one with offload; measured steps
    drawn on top (a measured point without a metered peak sits at its mode's predicted peak)."""
    figure, axes = new_axes()
    for region, curve in frontier.curves.items():
        xs, ys = zip(*curve)
        axes.plot(
            np.array(xs) / MiB,
            np.array(ys) * 1e3,
            "-o",
            color="0.6",
            markersize=3,
            label=f"frontier ({region})",
        )
    offload_curves = (
        (frontier.kept_only, "best plan, values kept on the device (predicted)", "tab:green", "-"),
        (frontier.with_offload, "best plan, with offload to host memory (predicted)", "tab:purple", "--"),
    )  # fmt: skip
    for curve, label, color, style in offload_curves:
        if curve:
            xs, ys = zip(*curve)
            axes.plot(
                np.array(xs) / MiB, np.array(ys) * 1e3, style, marker="^", color=color,
                markersize=5, label=label,
            )  # fmt: skip
    marks = (
        ("full", "full recomputation (predicted)", "s", "black"),
        ("must_only", "must-only (predicted)", "o", "tab:blue"),
        ("chosen", "chosen plan (predicted)", "*", "tab:red"),
    )
    for key, label, marker, color in marks:
        x, y = getattr(frontier, key)
        if key == "chosen" and frontier.peak_at:
            label = f"chosen plan (predicted; peak at {frontier.peak_at})"
        axes.plot(
            x / MiB,
            y * 1e3,
            marker,
            color=color,
            markersize=10 if marker == "*" else 7,
            linestyle="none",
            label=label,
        )
    axes.axvline(
        frontier.capacity / MiB,
        color="tab:orange",
        linestyle="--",
        label="capacity (limit after margins)",
    )
    predicted_peak = {
        "planned": frontier.chosen[0],
        "must-only": frontier.must_only[0],
        "full": frontier.full[0],
    }
    colors = {"planned": "tab:red", "must-only": "tab:blue", "full": "black"}
    for point in measured:
        x = (
            point.peak if point.peak is not None else predicted_peak.get(point.label, np.nan)
        ) / MiB
        spread = np.array([[point.seconds - point.q1], [point.q3 - point.seconds]]) * 1e3
        axes.errorbar(
            x,
            point.seconds * 1e3,
            yerr=spread,
            fmt="D",
            markerfacecolor="none",
            color=colors.get(point.label),
            capsize=4,
            label=f"{point.label} measured (median, IQR, n={point.count})",
        )
    # The legend goes below the axes: inside, "best" still covered a measured point when every
    # corner held one.
    return finish_axes(figure, axes, "step peak memory (MiB)", "step time (ms)", title, below=True)


def speedup_by_bucket_figure(rows: Sequence[tuple[int, float, float | None]]) -> Any:
    """Predicted and measured speedup vs must-only per token bucket: ``(tokens, predicted,
    measured or None)`` rows."""
    figure, axes = new_axes()
    tokens = [r[0] for r in rows]
    axes.plot(tokens, [r[1] for r in rows], "o", color="tab:red", label="predicted")
    measured = [(t, m) for t, _, m in rows if m is not None]
    if measured:
        axes.plot(
            *zip(*measured),
            "D",
            markerfacecolor="none",
            color="black",
            label="measured (median must-only / median planned step)",
        )
    axes.axhline(1.0, color="0.5", linewidth=1)
    return finish_axes(
        figure,
        axes,
        "tokens per step (most seen in the bucket)",
        "speedup vs must-only (x)",
        "TapeSAC speedup per token bucket",
        fontsize=8,
    )


def timeline_figure(scalars: Mapping[str, Sequence[tuple[int, float]]]) -> Any:
    """A run's ``tapesac/*`` scalars over steps: predicted and measured speedup; peak memory
    against the limit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 6), dpi=100)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for tag, label, style in (
        (names.PREDICTED_SPEEDUP, "predicted", "-"),
        (names.MEASURED_SPEEDUP, "measured (medians over recent steps)", "."),
    ):
        if scalars.get(tag):
            steps, values = zip(*scalars[tag])
            top.plot(steps, values, style, label=label)
    top.axhline(1.0, color="0.5", linewidth=1)
    top.set_ylabel("speedup vs must-only (x)")
    top.set_title("TapeSAC over the run")
    top.legend(fontsize=8)
    for tag, label, style in (
        (names.PEAK_MEMORY_BYTES, "measured step peak", "o"),
        (names.MEMORY_LIMIT_BYTES, "memory limit", "--"),
    ):
        if scalars.get(tag):
            steps, values = zip(*scalars[tag])
            bottom.plot(steps, np.array(values) / MiB, style, label=label)
    bottom.set_xlabel("training step")
    bottom.set_ylabel("memory (MiB)")
    bottom.legend(fontsize=8)
    for axes in (top, bottom):
        axes.grid(True, alpha=0.3)
    figure.tight_layout()
    return figure


def image_array(figure: Any) -> np.ndarray:
    """The figure as an RGB ``uint8`` array (height, width, 3), for ``add_image(..., "HWC")``."""
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def finish_axes(
    figure: Any,
    axes: Any,
    xlabel: str,
    ylabel: str,
    title: str,
    fontsize: int = 7,
    below: bool = False,
) -> Any:
    """Titled axes, the legend (inside, or ``below`` the axes in two columns), the layout: how
    every figure begun with ``new_axes`` ends."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    if below:
        figure.set_figheight(figure.get_figheight() + 1.2)
        axes.legend(fontsize=fontsize, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    else:
        axes.legend(fontsize=fontsize, loc="best")
    figure.tight_layout()
    return figure


def new_axes() -> tuple[Any, Any]:
    """A figure with one gridded axes on its own Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.grid(True, alpha=0.3)
    return figure, axes
