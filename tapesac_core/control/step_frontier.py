"""A bucket's predicted frontier of whole steps, for plots: step time against step peak along each
region's frontier, with the chosen plan, must-only and full recomputation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..config import TapeSACConfig
from ..measure.step_time import StepTime
from ..plan.offload_choice import Link
from ..plan.plan import Plan
from ..plan.points import Point as SetPoint
from ..plan.points import pareto
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
    # Where plans may offload: the best plan's predicted (peak, seconds) at capacities across
    # the chosen plan's, with values kept on the device only and with offload (empty: none).
    kept_only: list[Point] = dataclasses.field(default_factory=list)
    with_offload: list[Point] = dataclasses.field(default_factory=list)


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


# Capacities the offload frontiers are solved at: shares of the way from the memory a step
# starts with to the chosen plan's capacity, and beyond it.
FRONTIER_SHARES = (0.6, 0.8, 0.9, 1.0, 1.2, 1.5)


def offload_frontiers(
    plan: Plan, solve: Callable[[int, Link | None], Plan], link: Link
) -> tuple[list[Point], list[Point]]:
    """The best plan's predicted (peak, seconds) at capacities around ``plan``'s, solved by
    ``solve(capacity, link)`` without the link and with it: the frontier with values kept on
    the device only, and with offload. A capacity no plan fits adds no point."""
    seconds = plan.step_time
    start = plan.static

    def points(over: Link | None) -> list[Point]:
        out: list[Point] = []
        for share in FRONTIER_SHARES:
            capacity = round(start + share * (plan.capacity - start))
            solved = solve(capacity, over)
            if solved.predicted_peak <= capacity:
                out.append((solved.predicted_peak, seconds / solved.predicted_speedup))
        # By peak, each faster than every one of lower peak (``pareto`` of save sets).
        front: list[SetPoint[str]] = pareto(
            SetPoint(bytes=b, time=t, saved=frozenset()) for b, t in out
        )
        return [(p.bytes, p.time) for p in front]

    return points(None), points(link)
