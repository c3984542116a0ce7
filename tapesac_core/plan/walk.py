"""Incremental replay closures: which running nodes die when more values are saved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from .model import PlanGraph, needed


@dataclass(frozen=True, kw_only=True)
class Walk:
    """The effect of saving some values on a replay: the nodes that die, their time,
    and every node whose state the walk read (to know when the walk must be redone)."""

    gain: float
    dead: int
    read: int


def kill(graph: PlanGraph, stop: int, run: int, values: Sequence[int]) -> Walk:
    """Walk the tape from the producers of `values`, given that the values in `stop` are
    kept and the nodes in `run` replay (so `run` is the replay closure of `stop`)."""
    for v in values:
        stop |= 1 << v
    heap = [-p for v in values if (p := graph.producer[v]) >= 0 and run >> p & 1]
    heapify(heap)
    live, seen, dead, read, gain = run, 0, 0, 0, 0.0
    # Highest index first: every reader of a node is decided before the node itself.
    while heap:
        n = -heappop(heap)
        if seen >> n & 1:
            continue
        seen |= 1 << n
        if _alive(graph, n, stop, live):
            continue
        live ^= 1 << n
        dead |= 1 << n
        gain += graph.node_time[n]
        read |= graph.pred_bits[n]
        for d in graph.node_deps[n]:
            if not stop >> d & 1 and live >> (p := graph.producer[d]) & 1 and not seen >> p & 1:
                heappush(heap, -p)
    return Walk(gain=gain, dead=dead, read=read | seen)


def _alive(graph: PlanGraph, n: int, stop: int, live: int) -> bool:
    """Whether node `n` still runs: an output of it is not kept but still needed."""
    return any(not stop >> v & 1 and needed(graph, v, live) for v in graph.node_outs[n])


def revive(graph: PlanGraph, stop: int, run: int, values: Sequence[int]) -> int:
    """The nodes that start to replay when `values` leave the kept set `stop`, given
    that the nodes in `run` replay now."""
    for v in values:
        stop &= ~(1 << v)
    todo = [v for v in values if needed(graph, v, run)]
    added = 0
    while todo:
        p = graph.producer[todo.pop()]
        if not (run | added) >> p & 1:
            added |= 1 << p
            todo += [d for d in graph.node_deps[p] if not stop >> d & 1]
    return added
