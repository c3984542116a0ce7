"""A bucket's predicted frontier of whole steps, for plots: step time against step peak along each
region's frontier, with the chosen plan, must-only and full recomputation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import TapeSACConfig
from ..measure.step_time import StepTime
from ..plan.plan import Plan
from .profile import RegionProfile
from .solve import full_recompute_extra, modelled_replay

Point = tuple[int, float]  # (step peak bytes, step seconds)


@dataclass(frozen=True, kw_only=True)
class StepFrontier:
    """Predicted (peak bytes, seconds) points of one bucket's steps."""

    curves: dict[str, list[Point]]  # per region type, along its frontier (Eq. 8's bytes)
    must_only: Point
    full: Point  # full recomputation, at the must-only peak
    chosen: Point  # the plan, at its memory model's predicted peak
    peak_at: str  # where in the step the chosen plan's peak falls ("" when not modelled)
    capacity: int


def step_frontier(
    plan: Plan,
    profiles: Mapping[str, RegionProfile],
    edges: Mapping[str, int],
    must_only_seconds: float,
    config: TapeSACConfig,
) -> StepFrontier:
    """The frontier of ``plan``'s bucket (token counts ``edges``) from its regions' profiles and
    the modelled must-only step seconds there."""
    profiles = {r: p for r, p in profiles.items() if r in edges}
    step = StepTime.of_step(must_only_seconds, modelled_replay(profiles, edges))
    seconds = step.must_only
    curves = {}
    for r, p in profiles.items():
        scale = edges[r] / p.tokens
        points = p.frontier(config.beam_width, config.max_set_size)
        curves[r] = [
            (
                plan.base + p.blocks * p.bytes_at(pt, scale),
                step.planned(p.blocks * (points[0].time - pt.time) * scale),
            )
            for pt in points
        ]
    return StepFrontier(
        curves=curves,
        must_only=(plan.base, seconds),
        full=(plan.base, seconds + full_recompute_extra(profiles, edges)),
        chosen=(
            plan.predicted_peak or plan.base + plan.saved_bytes,
            seconds / plan.predicted_speedup,
        ),
        peak_at=plan.peak_at,
        capacity=plan.capacity,
    )
