"""Beam search over save sets (paper §3.4.3), every extension scored exactly on the tape."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

from .bits import bits
from .model import PlanGraph, candidates, nodes_time, replay_bits, storages_bytes
from .points import trim
from .walk import Walk, kill

# A built set: (bytes, time, values, replay bitset).
Built = tuple[int, float, tuple[int, ...], int]
# An offer: a set on the beam plus one unit, scored but not built: (bytes, time, set index, unit).
_Offer = tuple[int, float, int, int]
_Item = TypeVar("_Item", Built, _Offer)


@dataclass(frozen=True, kw_only=True)
class Units:
    """What the search adds to a set: the candidates, widened to whole storages.

    Bytes count once per storage and saving more never lengthens replay, so saving
    every value of a storage is never worse than saving some of them.
    """

    values: tuple[tuple[int, ...], ...]
    stores: tuple[tuple[int, ...], ...]
    value_bits: tuple[int, ...]
    bytes: tuple[int, ...]
    multi: frozenset[int]
    by_bytes: tuple[int, ...]
    touching: Mapping[int, tuple[int, ...]]  # storage -> the units that save it


@dataclass(frozen=True, kw_only=True)
class _Set:
    """A save set on the beam, with the walk of every unit from it."""

    saved: tuple[int, ...]
    stop: int
    run: int
    shared: frozenset[int]  # units whose bytes are not their own: multi-storage or partly kept
    bytes: int
    time: float
    walks: tuple[Walk, ...]


def units_of(graph: PlanGraph) -> Units:
    """The candidates of `graph` widened to whole storages, without repeats."""
    groups = candidates(graph)
    by_storage: dict[int, list[int]] = {}
    for group in groups:
        if len(group) == 1:
            by_storage.setdefault(graph.value_storage[min(group)], []).append(min(group))
    widened: dict[tuple[int, ...], tuple[int, ...]] = {}
    for group in groups:
        stores = tuple(sorted({graph.value_storage[v] for v in group}))
        widened.setdefault(tuple(sorted(v for s in stores for v in by_storage[s])), stores)
    sizes = tuple(sum(graph.storage_bytes[s] for s in st) for st in widened.values())
    return Units(
        values=tuple(widened),
        stores=tuple(widened.values()),
        value_bits=tuple(bits(u) for u in widened),
        bytes=sizes,
        multi=frozenset(u for u, st in enumerate(widened.values()) if len(st) > 1),
        by_bytes=tuple(sorted(range(len(sizes)), key=sizes.__getitem__)),
        touching=_touching(widened.values()),
    )


def _touching(stores: Iterable[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    touching: dict[int, list[int]] = {}
    for u, unit_stores in enumerate(stores):
        for s in unit_stores:
            touching.setdefault(s, []).append(u)
    return {s: tuple(us) for s, us in touching.items()}


def beam_search(
    graph: PlanGraph, units: Units, width: int, rounds: int
) -> tuple[list[Built], int, int]:
    """The empty set and each round's non-dominated sets, built; the number of sets
    scored and of tape walks run."""
    stop = graph.available_bits
    run = replay_bits(graph, stop)
    walks = tuple(kill(graph, stop, run, u) for u in units.values)
    root = _Set(
        saved=(),
        stop=stop,
        run=run,
        shared=units.multi,
        bytes=0,
        time=nodes_time(graph, run),
        walks=walks,
    )
    built: list[Built] = [(0, root.time, (), root.run)]
    beam, scored, walked = [root], 1, len(walks)
    for _ in range(rounds):
        offers = [_offers(graph, units, s, i) for i, s in enumerate(beam)]
        scored += len(beam) * len(units.values)
        best = front(list(chain.from_iterable(front(own) for own in offers)))
        if not best:
            break
        built += [_build(graph, units, beam[i], u) for _, _, i, u in best]
        picks = (
            _spread(best, width)
            if len(best) >= width
            else _layers(units, beam, list(chain.from_iterable(offers)), width)
        )
        grown = [_extend(graph, units, beam, o) for o in picks]
        beam = [child for child, _ in grown]
        walked += sum(redone for _, redone in grown)
    return built, scored, walked


def front(items: list[_Item]) -> list[_Item]:
    """The items that no other item beats in both bytes (item[0]) and time (item[1])."""
    best: list[_Item] = []
    for item in sorted(items):
        if not best or item[1] < best[-1][1]:
            best.append(item)
    return best


def _offers(graph: PlanGraph, units: Units, s: _Set, index: int) -> list[_Offer]:
    """Every unit that shortens the replay of `s` (the beam's set `index`), by bytes."""
    walks, size, time = s.walks, s.bytes, s.time
    offers = [
        (size + units.bytes[u], time - walks[u].gain, index, u)
        for u in units.by_bytes
        if walks[u].gain > 0 and u not in s.shared
    ]
    # A unit that shares a kept storage or spans several: its bytes are not its own.
    return offers + [
        (_build(graph, units, s, u)[0], time - walks[u].gain, index, u)
        for u in sorted(s.shared)
        if walks[u].gain > 0
    ]


def _layers(units: Units, beam: list[_Set], offers: list[_Offer], width: int) -> list[_Offer]:
    """Up to `width` distinct offers: the front, then, while room is left, the next fronts
    (offers beaten only by offers of earlier fronts), each spread over bytes."""
    layers: list[list[_Offer]] = []
    tails: list[float] = []  # the least time in each layer so far, ascending
    for offer in sorted(offers):
        k = bisect_right(tails, offer[1])
        if k == len(layers):
            layers.append([])
            tails.append(offer[1])
        layers[k].append(offer)
        tails[k] = offer[1]
    chosen: dict[int, _Offer] = {}  # by saved values: two sets plus a unit can coincide
    for layer in layers:
        fresh = {_key(units, beam, o): o for o in reversed(layer)}
        unseen = sorted(o for key, o in fresh.items() if key not in chosen)
        chosen.update((_key(units, beam, o), o) for o in _spread(unseen, width - len(chosen)))
        if len(chosen) == width:
            break
    return list(chosen.values())


def _key(units: Units, beam: list[_Set], offer: _Offer) -> int:
    return beam[offer[2]].stop | units.value_bits[offer[3]]


def _spread(offers: list[_Offer], width: int) -> list[_Offer]:
    """At most `width` of `offers` (sorted by bytes), spread evenly over bytes and over rank."""
    n = len(offers)
    if n <= width:
        return offers
    sizes = [o[0] for o in offers]
    lo, hi, steps = sizes[0], sizes[-1], max(width - 1, 1)
    by_bytes = [min(bisect_left(sizes, lo + (hi - lo) * k / steps), n - 1) for k in range(width)]
    by_rank = [round(k * (n - 1) / steps) for k in range(width)]
    picks = dict.fromkeys(i for pair in zip(by_bytes, by_rank) for i in pair)
    return [offers[i] for i in sorted(list(picks)[:width])]


def _build(graph: PlanGraph, units: Units, s: _Set, u: int) -> Built:
    """`s` plus unit `u`: exact bytes, time, values (trimmed) and replay bitset."""
    walk = s.walks[u]
    run = s.run & ~walk.dead
    saved = tuple(trim(graph, sorted({*s.saved, *units.values[u]}), run))
    return storages_bytes(graph, saved), s.time - walk.gain, saved, run


def _extend(graph: PlanGraph, units: Units, beam: list[_Set], offer: _Offer) -> tuple[_Set, int]:
    """The set of `offer` with its walks, and how many walks were redone: a parent's walk
    is kept unless it read a node whose state the new unit changed."""
    _, _, index, u = offer
    s = beam[index]
    size, time, saved, run = _build(graph, units, s, u)
    stop = graph.available_bits | bits(saved)
    moved = set(units.values[u]).union(set(s.saved) - set(saved))
    touched = s.walks[u].read | bits(graph.producer[v] for v in moved)
    walks, redone = [], 0
    for i, w in enumerate(s.walks):
        if w.read & touched:
            w = kill(graph, stop, run, units.values[i])
            redone += 1
        walks.append(w)
    kept = {graph.value_storage[v] for v in saved}
    child = _Set(
        saved=saved,
        stop=stop,
        run=run,
        shared=units.multi.union(*(units.touching[st] for st in kept)),
        bytes=size,
        time=time,
        walks=tuple(walks),
    )
    return child, redone
