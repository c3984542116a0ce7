"""The benchmarks' comparison figures: every method's measured step time against its peak, and
the paper's normalised frontier (Figure 9), on the axes ``tapesac_core.report.figures`` draws on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tapesac_core.report.figures import finish_axes, new_axes
from tapesac_core.units import MiB

# Colour and marker per method family in the benchmark comparisons.
_FAMILY_STYLE = {
    "none": ("black", "X"),
    "full": ("0.35", "s"),
    "torch_sac": ("tab:green", "^"),
    "tapesac_policy": ("tab:olive", "v"),
    "compile": ("tab:purple", "P"),
    "tapesac": ("tab:red", "o"),
}


def method_frontier_figure(
    points: Sequence[Mapping[str, Any]], title: str = "Step time against peak memory, every method"
) -> Any:
    """Measured step time (median, IQR bars) against measured step peak, one point per method.

    ``points``: mappings with ``label``, ``family`` (none, full, torch_sac, tapesac_policy,
    compile, tapesac), ``peak`` (bytes), ``seconds``, ``q1``, ``q3``. TapeSAC's points (family
    ``tapesac``) are joined by a line in memory order: its frontier."""
    figure, axes = new_axes()
    seen: set[str] = set()
    for p in points:
        color, marker = _FAMILY_STYLE.get(p["family"], ("tab:gray", "D"))
        spread = np.array([[p["seconds"] - p["q1"]], [p["q3"] - p["seconds"]]]) * 1e3
        axes.errorbar(
            p["peak"] / MiB,
            p["seconds"] * 1e3,
            yerr=spread,
            fmt=marker,
            color=color,
            capsize=3,
            markersize=6,
            label=None if p["family"] in seen else _FAMILY_LABEL.get(p["family"], p["family"]),
        )
        seen.add(p["family"])
        axes.annotate(
            p["label"],
            (p["peak"] / MiB, p["seconds"] * 1e3),
            fontsize=5,
            xytext=(3, 3),
            textcoords="offset points",
            color=color,
        )
    ours, best = [], float("inf")
    for peak, seconds in sorted(
        (p["peak"], p["seconds"]) for p in points if p["family"] == "tapesac"
    ):
        if seconds < best:  # TapeSAC's measured Pareto frontier: faster than every smaller point
            ours.append((peak, seconds))
            best = seconds
    if len(ours) > 1:
        xs, ys = zip(*ours)
        axes.plot(
            np.array(xs) / MiB,
            np.array(ys) * 1e3,
            "-",
            color="tab:red",
            alpha=0.5,
            label="TapeSAC measured frontier",
        )
    return finish_axes(
        figure, axes, "measured step peak memory (MiB)", "median step time (ms)", title
    )


_FAMILY_LABEL = {
    "none": "no checkpointing",
    "full": "torch full checkpointing",
    "torch_sac": "hand policy, torch SAC",
    "tapesac_policy": "hand policy, TapeSAC replay",
    "compile": "torch.compile memory budget",
    "tapesac": "TapeSAC (must-only, planned)",
}


def normalised_frontier_figure(
    points: Sequence[Mapping[str, Any]], title: str = "Normalised frontier (Figure 9)"
) -> Any:
    """The paper's Figure 9: extra memory over full checkpointing (share of what disabling
    checkpointing adds) against recomputation eliminated (share of what disabling it removes),
    from FLOPs (filled) and from time (hollow, IQR bars over per-round values).

    ``points``: mappings with ``label``, ``family``, ``memory_share``, ``flop_share`` (or None)
    and ``time_share``, ``time_q1``, ``time_q3`` (or None)."""
    figure, axes = new_axes()
    seen: set[str] = set()
    for p in points:
        color, marker = _FAMILY_STYLE.get(p["family"], ("tab:gray", "D"))
        label = None if p["family"] in seen else _FAMILY_LABEL.get(p["family"], p["family"])
        seen.add(p["family"])
        x = 100 * p["memory_share"]
        if p.get("flop_share") is not None:
            axes.plot(
                x,
                100 * p["flop_share"],
                marker,
                color=color,
                markersize=6,
                label=label and f"{label} (filled: FLOPs, hollow: time)",
            )
            label = None
            axes.annotate(
                p["label"],
                (x, 100 * p["flop_share"]),
                fontsize=5,
                xytext=(3, 3),
                textcoords="offset points",
                color=color,
            )
        if p.get("time_share") is not None:
            spread = 100 * np.array(
                [[p["time_share"] - p["time_q1"]], [p["time_q3"] - p["time_share"]]]
            )
            axes.errorbar(
                x,
                100 * p["time_share"],
                yerr=spread,
                fmt=marker,
                color=color,
                markerfacecolor="none",
                capsize=2,
                markersize=5,
                alpha=0.6,
                label=label,
            )
    axes.plot([0, 100], [0, 100], ":", color="0.5", linewidth=1, label="proportional (diagonal)")
    return finish_axes(
        figure,
        axes,
        "extra memory over full checkpointing (% of no-checkpointing's extra)",
        "recompute eliminated (% of full's)",
        title,
    )
