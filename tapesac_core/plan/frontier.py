"""The approximate Pareto frontier of a block's save sets (paper §3.4.3)."""

from __future__ import annotations

from dataclasses import dataclass

from .beam import beam_search, units_of
from .exact import enumerate_sets, latest_first
from .model import PlanGraph
from .points import Point, make_point, pareto
from .polish import polish


@dataclass(frozen=True, kw_only=True)
class FrontierResult:
    """A frontier with the work it took: save sets scored, and tape walks run."""

    points: tuple[Point, ...]
    sets_evaluated: int
    walks: int


def frontier(graph: PlanGraph, beam_width: int = 24, max_set_size: int = 12) -> list[Point]:
    """The approximate Pareto frontier of `graph`, sorted by bytes, starting at 0 bytes."""
    return list(solve_frontier(graph, beam_width=beam_width, max_set_size=max_set_size).points)


def solve_frontier(
    graph: PlanGraph, *, beam_width: int = 24, max_set_size: int = 12, exact_units: int = 10
) -> FrontierResult:
    """`frontier` with its search statistics.

    Beam search from the empty set, each round adding one candidate group to every set
    on the beam; then sets are improved by dropping or swapping storages. A graph with at most
    `exact_units` storages to save is searched exhaustively instead.
    """
    if beam_width < 1 or max_set_size < 1 or exact_units < 0:
        raise ValueError("beam_width and max_set_size must be >= 1, exact_units >= 0")
    units = units_of(graph)
    storages = [u for u, stores in zip(units.values, units.stores) if len(stores) == 1]
    if len(storages) <= exact_units:
        sets, scored = enumerate_sets(graph, latest_first(graph, storages))
        points = pareto(make_point(graph, saved, run) for saved, run in sets)
        return FrontierResult(points=tuple(points), sets_evaluated=scored, walks=scored - 1)
    built, scored, walked = beam_search(graph, units, beam_width, max_set_size)
    polished, tried = polish(graph, units, built)
    points = pareto(make_point(graph, saved, run) for _, _, saved, run in polished)
    return FrontierResult(points=tuple(points), sets_evaluated=scored + tried, walks=walked + tried)
