"""The frontier's result rows: one per method, its measurements and the paper's Figure 9 shares
against full checkpointing (``full``) and no checkpointing (``none``)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import quartiles
from benchmarks.method import Method


def rows(
    methods: list[Method], rounds: list[dict[str, float]], static: int = 0
) -> list[dict[str, Any]]:
    """One row per method; a planned row's predicted peak is above ``static``, the bytes live at
    the step's start when it planned: the Controller's for this batch, or, for a plan it did not
    predict, Eq. 8's must-only peak + saved bytes."""
    by = {m.name: m for m in methods}
    none, full = by.get("none"), by.get("full")
    out = []
    for m in methods:
        row: dict[str, Any] = {
            "method": m.name,
            "family": m.family,
            "note": m.note,
            "error": m.error,
            "peak_bytes": m.peak,
            "limit_bytes": m.limit,
            "forward_flops": m.forward_flops,
            "backward_flops": m.backward_flops,
        }
        if m.plan is not None and hasattr(m.plan, "saved_bytes"):
            row |= plan_columns(m.plan, static, m.predicted_peak)
        if m.times:
            row |= time_columns(m.times)
            # Each measured round's seconds (None where the step failed): comparisons pair rounds.
            row["round_s"] = [r.get(m.name) for r in rounds]
        if none is not None and m.backward_flops is not None and none.backward_flops is not None:
            row["recomputed_flops"] = m.backward_flops - none.backward_flops
        if (
            none is not None
            and full is not None
            and None not in (m.peak, none.peak, full.peak)
            and m.error is None
        ):
            row |= figure9_columns(m, none, full, row.get("recomputed_flops"), rounds)
        out.append(row)
    return out


def plan_columns(plan: Any, static: int, predicted_peak: int | None) -> dict[str, Any]:
    return {
        "plan_saved_bytes": plan.saved_bytes,
        "plan_predicted_speedup": plan.predicted_speedup,
        "plan_predicted_peak_bytes": predicted_peak
        if predicted_peak is not None
        else plan.base + plan.saved_bytes - static,
    }


def time_columns(times: list[float]) -> dict[str, Any]:
    q1, med, q3 = quartiles(times)
    return {
        "median_s": med,
        "q1_s": q1,
        "q3_s": q3,
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
    }


def figure9_columns(
    m: Method,
    none: Method,
    full: Method,
    recomputed: int | None,
    rounds: list[dict[str, float]],
) -> dict[str, Any]:
    """Extra memory = (peak − full's) / (none's − full's); recompute eliminated = (full's
    recomputation − this one's) / full's, from FLOPs and from time (per round:
    (t_full − t) / (t_full − t_none); median and IQR over rounds)."""
    extra = none.peak - full.peak
    out: dict[str, Any] = {"memory_share": (m.peak - full.peak) / extra if extra else None}
    full_re = (full.backward_flops or 0) - (none.backward_flops or 0)
    if recomputed is not None and full_re > 0:
        out["flop_share"] = (full_re - recomputed) / full_re
    per_round = [
        (r["full"] - r[m.name]) / (r["full"] - r["none"])
        for r in rounds
        if m.name in r and "full" in r and "none" in r and r["full"] != r["none"]
    ]
    if per_round:
        q1, med, q3 = quartiles(per_round)
        out |= {"time_share": med, "time_share_q1": q1, "time_share_q3": q3}
    return out
