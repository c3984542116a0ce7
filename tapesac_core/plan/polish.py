"""Local improvement of a frontier: drop a storage from a set, or swap it for another."""

from __future__ import annotations

from .beam import Built, Units, front
from .bits import bits, members
from .model import PlanGraph, nodes_time, storages_bytes
from .points import trim
from .walk import kill, revive


def polish(graph: PlanGraph, units: Units, built: list[Built]) -> tuple[list[Built], int]:
    """The front of `built`, improved by moves from its sets until no move helps; returns
    it and the number of sets tried.

    A value saved early can lose its worth once later values are saved, and the beam only
    adds: dropping a storage, or swapping it for one the revived nodes touch, finds what
    the beam passed by.
    """
    best, tried = front(built), 0
    done: set[tuple[int, ...]] = set()
    while fresh := [b for b in best if b[2] not in done]:
        done.update(b[2] for b in fresh)
        for b in fresh:
            moves, attempts = _moves(graph, units, b)
            best += moves
            tried += attempts
        best = front(best)
    return best, tried


def _moves(graph: PlanGraph, units: Units, built: Built) -> tuple[list[Built], int]:
    """`built` without the saved values of one of its storages, alone or with one unit
    added that saves a storage the revived nodes read or produce; and the sets tried."""
    by_storage: dict[int, list[int]] = {}
    for v in built[2]:
        by_storage.setdefault(graph.value_storage[v], []).append(v)
    moves, attempts = [], 0
    for store, values in by_storage.items():
        dropped, revived = _drop(graph, built, values)
        near = {
            graph.value_storage[v]
            for n in members(revived)
            for v in graph.node_deps[n] + graph.node_outs[n]
        } - {store}
        adds = sorted({u for s in near for u in units.touching.get(s, ())})
        moves += [dropped] + [m for u in adds if (m := _add(graph, dropped, units.values[u]))]
        attempts += 1 + len(adds)
    return moves, attempts


def _drop(graph: PlanGraph, built: Built, values: list[int]) -> tuple[Built, int]:
    """`built` without `values`, and the nodes that replay again."""
    _, time, saved, run = built
    revived = revive(graph, graph.available_bits | bits(saved), run, values)
    run |= revived
    rest = tuple(trim(graph, [v for v in saved if v not in values], run))
    return (storages_bytes(graph, rest), time + nodes_time(graph, revived), rest, run), revived


def _add(graph: PlanGraph, built: Built, values: tuple[int, ...]) -> Built | None:
    """`built` with `values` saved too, or None if that shortens nothing."""
    _, time, saved, run = built
    walk = kill(graph, graph.available_bits | bits(saved), run, values)
    if walk.gain <= 0:
        return None
    run &= ~walk.dead
    grown = tuple(trim(graph, sorted({*saved, *values}), run))
    return storages_bytes(graph, grown), time - walk.gain, grown, run
