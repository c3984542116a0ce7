"""The exact Pareto frontier of a small block, by exhaustive search over save sets."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .bits import bits
from .model import N, PlanGraph, candidates, needed, replay_bits, storages_bytes
from .points import Point, make_point, pareto
from .walk import kill

EXACT_LIMIT = 20


def exact_frontier(graph: PlanGraph[N]) -> list[Point[N]]:
    """The exact Pareto frontier over all subsets of candidate values, sorted by bytes from
    0 bytes (the empty set, unless saving 0-byte values removes time)."""
    values = [v for group in candidates(graph) if len(group) == 1 for v in group]
    if len(values) > EXACT_LIMIT:
        raise ValueError(
            f"the graph has {len(values)} candidate values; exact_frontier "
            f"enumerates at most {EXACT_LIMIT}: use frontier() instead"
        )
    sets, _ = enumerate_sets(graph, latest_first(graph, [(v,) for v in values]))
    return pareto(make_point(graph, saved, run) for saved, run in sets)


def latest_first(graph: PlanGraph, groups: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """`groups` ordered by their last producer, last first: deciding late values first
    lets the search skip earlier values that no longer matter."""
    return sorted((tuple(g) for g in groups), key=lambda g: (-max(graph.producer[v] for v in g), g))


def enumerate_sets(
    graph: PlanGraph, groups: Sequence[Sequence[int]]
) -> tuple[list[tuple[tuple[int, ...], int]], int]:
    """Every union of `groups` that could be Pareto-optimal, as (values, replay bitset),
    and how many sets were evaluated.

    A group none of whose values is still needed is skipped: it stays unneeded in every
    larger set, so it would only add bytes and values.
    """
    best: dict[tuple[int, int], tuple[int, ...]] = {}
    count = 0

    def visit(start: int, stop: int, run: int, saved: tuple[int, ...]) -> None:
        nonlocal count
        count += 1
        key = (storages_bytes(graph, saved), run)
        if key not in best or _rank(graph, saved) < _rank(graph, best[key]):
            best[key] = saved
        for j in range(start, len(groups)):
            group = groups[j]
            if any(not stop >> v & 1 and needed(graph, v, run) for v in group):
                walk = kill(graph, stop, run, group)
                visit(j + 1, stop | bits(group), run & ~walk.dead, saved + tuple(group))

    stop = graph.available_bits
    visit(0, stop, replay_bits(graph, stop), ())
    return [(saved, run) for (_, run), saved in best.items()], count


def _rank(graph: PlanGraph[N], saved: tuple[int, ...]) -> tuple[int, list[N]]:
    """Among equal sets, fewer values first, then sorted names."""
    return len(saved), sorted(graph.value_names[v] for v in saved)
