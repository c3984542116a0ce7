"""A block's memory simulated on its tape graph: its forward's (``forward_memory``) and its
replay's in one backward window (``replay_memory``), for a save set. The peak model compares
a save set's simulation with must-only's to say how a plan moves the block's own segments.

Python, no torch: plan graphs in, bytes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .model import PlanGraph


@dataclass(frozen=True, kw_only=True)
class ReplayMemory:
    """Bytes replay holds in one block's backward window, per unpack in order: the most while
    its closure runs (``replay``) and while autograd computes with the value (``compute``)."""

    replay: tuple[int, ...]
    compute: tuple[int, ...]


def replay_memory(
    graph: PlanGraph,
    saved: Iterable[int],
    unpacks: Sequence[int],
    taken: Iterable[int] = (),
    groups: Sequence[int] = (),
) -> ReplayMemory:
    """Simulate replay (as ``replay.Replay`` runs it) for the unpacks of one backward window.

    Available without replay: the graph's available values, ``saved`` and ``taken`` (values
    alive elsewhere); storages they use cost nothing. Each unpack of a missing value runs its
    producer closure in tape order; every output exists while its node runs, and is kept while
    a later read remains; autograd's reads are the unpacks themselves. Every value unpacked is
    held by autograd until its node has computed, whether replay still holds it or not: until
    the unpacks of the same ``groups`` entry (one autograd node call) are done, or, without
    groups, until the next unpack. (Replay for a later unpack of the same call may read a value
    for the last time: autograd still holds it.)
    """
    if groups and len(groups) != len(unpacks):
        raise ValueError(f"one group per unpack: {len(unpacks)} unpacks, {len(groups)} groups")
    available = graph.available | frozenset(saved) | frozenset(taken)
    deps_of, outs_of, producer = graph.node_deps, graph.node_outs, graph.producer
    sizes, storage = graph.storage_bytes, graph.value_storage
    held = {storage[v] for v in available}
    cost = [0 if s in held else b for s, b in enumerate(sizes)]  # bytes a live storage costs
    # Flags per value rather than sets: this loop runs once per frontier point and unpack.
    avail = [False] * len(storage)
    for v in available:
        avail[v] = True
    env = [False] * len(storage)  # replay holds the value
    reads = [0] * len(storage)
    for v in unpacks:
        if not avail[v]:
            reads[v] += 1
    # Every read of every node replay runs (its producer closure), counted in one walk.
    stack = [v for v in set(unpacks) if reads[v]]
    seen = bytearray(len(storage))
    ran = bytearray(len(deps_of))
    while stack:
        n = producer[stack.pop()]
        if ran[n]:
            continue
        ran[n] = 1
        for d in deps_of[n]:
            reads[d] += 1
            if not (avail[d] or seen[d]):
                seen[d] = 1
                stack.append(d)
    refs = [0] * len(sizes)  # storage -> values of env on it, and autograd's hold
    live = 0
    node_mark, value_mark = [0] * len(deps_of), [0] * len(storage)
    walks = 0
    # One autograd node call per groups entry: autograd's holds end where a new one starts.
    starts = (
        [True] * len(unpacks)
        if not groups
        else [k == 0 or groups[k] != groups[k - 1] for k in range(len(unpacks))]
    )
    replay, compute = [], []
    # Storages autograd holds for the current node call: one reference each in ``refs``.
    grabbed: set[int] = set()
    # The loop below runs once per frontier point and unpack: names stay local (no closures),
    # so freeing a value is written out where it happens.
    for v, start in zip(unpacks, starts):
        if start:
            for s in grabbed:
                refs[s] -= 1
                if not refs[s]:
                    live -= cost[s]
            grabbed.clear()
        top = live
        if not (avail[v] or env[v]):
            # Replay's own walk (``tape.producer_closure``) from v, stopping at values that
            # exist; marks carry the walk's number so no per-walk arrays are built.
            walks += 1
            needed, stack = [], [v]
            value_mark[v] = walks
            while stack:
                n = producer[stack.pop()]
                if node_mark[n] == walks:
                    continue
                node_mark[n] = walks
                needed.append(n)
                for d in deps_of[n]:
                    if not (avail[d] or env[d]) and value_mark[d] != walks:
                        value_mark[d] = walks
                        stack.append(d)
            needed.sort()
            for n in needed:
                outs = outs_of[n]
                if len(outs) == 1:
                    s = storage[outs[0]]
                    rise = 0 if refs[s] else cost[s]
                else:
                    rise = sum(cost[s] for s in {storage[o] for o in outs if not refs[storage[o]]})
                if live + rise > top:
                    top = live + rise
                for o in outs:
                    if reads[o] > 0:
                        env[o] = True
                        s = storage[o]
                        refs[s] += 1
                        if refs[s] == 1:
                            live += cost[s]
                for d in deps_of[n]:
                    reads[d] -= 1
                    if reads[d] <= 0 and env[d]:  # its last read: replay lets go of it
                        env[d] = False
                        s = storage[d]
                        refs[s] -= 1
                        if not refs[s]:
                            live -= cost[s]
        replay.append(top)
        if not avail[v]:
            s = storage[v]
            if s not in grabbed:  # autograd holds it while its node computes
                grabbed.add(s)
                refs[s] += 1
                if refs[s] == 1:
                    live += cost[s]
            reads[v] -= 1
            if reads[v] <= 0 and env[v]:
                env[v] = False
                refs[s] -= 1
        compute.append(live)
    return ReplayMemory(replay=tuple(replay), compute=tuple(compute))


def forward_memory(graph: PlanGraph, saved: Iterable[int]) -> int:
    """The most bytes a block's forward holds (beyond the graph's available values), simulated
    in tape order: each node's outputs exist while it runs and live until their last read in
    the forward, or until the recorded forward freed their storage if later (Python keeps a
    value while a reference to it remains: ``graph.storage_freed``), or to its end when they
    are in ``saved`` (kept for backward). Comparing two save sets says how much of the later
    one's bytes exist at the forward's peak."""
    keep = frozenset(saved)
    storage, cost = graph.value_storage, list(graph.storage_bytes)
    for v in graph.available:
        cost[storage[v]] = 0
    last_read = [-1] * len(storage)
    for n, deps in enumerate(graph.node_deps):
        for d in deps:
            last_read[d] = n
    if graph.storage_freed:
        # Freed before node k ran: alive through node k - 1 (the last node at most).
        end = len(graph.node_deps) - 1
        for v, s in enumerate(storage):
            last_read[v] = max(last_read[v], min(graph.storage_freed[s], end + 1) - 1)
    refs = [0] * len(cost)  # storage -> values on it alive
    dies: list[list[int]] = [[] for _ in graph.node_deps]
    live = top = 0
    for n, outs in enumerate(graph.node_outs):
        for o in outs:
            s = storage[o]
            refs[s] += 1
            if refs[s] == 1:
                live += cost[s]
            if o not in keep:
                dies[max(n, last_read[o])].append(o)
        top = max(top, live)
        for o in dies[n]:
            s = storage[o]
            refs[s] -= 1
            if not refs[s]:
                live -= cost[s]
    return top
