"""Frontier points: a save set with its bytes and remaining replay time."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic

from .model import N, PlanGraph, needed, nodes_time, storages_bytes


@dataclass(frozen=True, kw_only=True)
class Point(Generic[N]):
    """A save set (value names, on top of S0), the bytes it keeps and the replay time left (Eq. 6)."""

    bytes: int
    time: float
    saved: frozenset[N]

    def __post_init__(self) -> None:
        if self.bytes < 0 or not math.isfinite(self.time) or self.time < 0:
            raise ValueError(f"a point needs bytes >= 0 and a finite time >= 0, got {self}")


def trim(graph: PlanGraph, saved: Iterable[int], run: int) -> list[int]:
    """The values of `saved` that shorten replay, given that replay runs the nodes in `run`.

    A saved value is dropped when nothing reads it or when its producer runs anyway;
    dropping such values together leaves `run` unchanged and never adds bytes.
    """
    return [v for v in saved if needed(graph, v, run) and not run >> graph.producer[v] & 1]


def make_point(graph: PlanGraph[N], saved: Iterable[int], run: int) -> Point[N]:
    """The point of save set `saved`, whose replay runs the nodes in `run`, trimmed."""
    kept = trim(graph, saved, run)
    return Point(
        bytes=storages_bytes(graph, kept),
        time=nodes_time(graph, run),
        saved=frozenset(graph.value_names[v] for v in kept),
    )


def pareto(points: Iterable[Point[N]]) -> list[Point[N]]:
    """The points no other point beats, by bytes; equal points keep the fewest values."""
    ranked = sorted(points, key=lambda p: (p.bytes, p.time, len(p.saved), sorted(p.saved)))
    front: list[Point[N]] = []
    for p in ranked:
        if not front or p.time < front[-1].time:
            front.append(p)
    return front


def _best_time(points: Sequence[Point], budget: int) -> float:
    """The least time among `points` within `budget` bytes (inf if none fits)."""
    return min((p.time for p in points if p.bytes <= budget), default=math.inf)


def gap(approx: Sequence[Point], exact: Sequence[Point]) -> float:
    """The largest excess of `approx`'s best time within a byte budget over `exact`'s, at
    any budget, relative to `exact`'s time there (inf where only `exact` reaches 0)."""
    worst = 0.0
    for e in exact:
        excess = _best_time(approx, e.bytes) - e.time
        if excess > 0:
            worst = max(worst, excess / e.time if e.time > 0 else math.inf)
    return worst
