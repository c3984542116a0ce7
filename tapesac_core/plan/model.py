"""The planner's model of one block: a DAG of timed nodes, values, storages and demand.

Replay and block recomputation follow the paper's Eqs. 3-6: a save set S (value ids)
is always taken together with the always-available values (leaves and S0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .bits import bits, members


class ValueNameLike(Protocol):
    """What a value name must be: hashable, and ordered among the names of one save set."""

    def __hash__(self) -> int: ...

    def __lt__(self, other: Any, /) -> bool: ...


# How a graph names its values (save sets are reported by name): strings in graphs built by
# hand (``Graph``), ``coords.ValueName`` in a recorded tape's (``tape_graph.graph_of``). Names
# are sorted to break ties between equal save sets.
N = TypeVar("N", bound=ValueNameLike)


@dataclass(frozen=True, kw_only=True)
class PlanGraph(Generic[N]):
    """A block's forward as nodes in tape order; each node reads and produces values.

    Values share storages (views); saving a value keeps its whole storage alive.
    `demand` is what backward reads; `available` values (leaves, S0) are kept anyway.
    """

    node_time: tuple[float, ...]
    node_deps: tuple[tuple[int, ...], ...]
    node_outs: tuple[tuple[int, ...], ...]
    value_storage: tuple[int, ...]
    storage_bytes: tuple[int, ...]
    value_names: tuple[N, ...]
    demand: frozenset[int]
    available: frozenset[int]
    # The values a plan may keep (None: any): a block run in steady state holds only values on
    # storages autograd saves or a submodule returns.
    savable: frozenset[int] | None = None
    # Per storage, the number of nodes run when the recorded forward freed it (the node count:
    # alive at its end; -1: at its last read). Python frees a value when its last reference
    # goes, not at its last read. Empty: every storage at its last read.
    storage_freed: tuple[int, ...] = ()
    # Derived, so that closures are bit operations: the producer node of each value (-1:
    # none); each node's deps and outputs as value bitsets; each value's readers and each
    # node's deps' producers as node bitsets; the values and storages kept anyway.
    producer: tuple[int, ...] = field(init=False, repr=False, compare=False)
    dep_bits: tuple[int, ...] = field(init=False, repr=False, compare=False)
    out_bits: tuple[int, ...] = field(init=False, repr=False, compare=False)
    reader_bits: tuple[int, ...] = field(init=False, repr=False, compare=False)
    pred_bits: tuple[int, ...] = field(init=False, repr=False, compare=False)
    demand_bits: int = field(init=False, repr=False, compare=False)
    available_bits: int = field(init=False, repr=False, compare=False)
    held_storages: frozenset[int] = field(init=False, repr=False, compare=False)
    ids: Mapping[N, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        producer = _check(self)
        readers = [0] * len(self.value_names)
        for n, deps in enumerate(self.node_deps):
            for d in deps:
                readers[d] |= 1 << n
        derived = {
            "producer": producer,
            "dep_bits": tuple(bits(deps) for deps in self.node_deps),
            "out_bits": tuple(bits(outs) for outs in self.node_outs),
            "reader_bits": tuple(readers),
            "pred_bits": tuple(
                bits(producer[d] for d in deps if producer[d] >= 0) for deps in self.node_deps
            ),
            "demand_bits": bits(self.demand),
            "available_bits": bits(self.available),
            "held_storages": frozenset(self.value_storage[v] for v in self.available),
            "ids": {name: v for v, name in enumerate(self.value_names)},
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def value_ids(self, names: Iterable[N]) -> frozenset[int]:
        """The value ids of `names`."""
        unknown = sorted(set(names) - self.ids.keys())
        if unknown:
            raise KeyError(f"unknown value names {unknown}: use names from value_names")
        return frozenset(self.ids[name] for name in names)


def _check(g: PlanGraph) -> tuple[int, ...]:
    """Validate `g` and return the producer node of each value (-1 for none)."""
    n_values, n_nodes = len(g.value_names), len(g.node_time)
    if not len(g.node_deps) == len(g.node_outs) == n_nodes:
        raise ValueError("node_time, node_deps and node_outs must have one entry per node")
    if len(g.value_storage) != n_values:
        raise ValueError("value_storage must have one storage id per value")
    if len(set(g.value_names)) != n_values:
        raise ValueError("value_names must be unique: they name saved values in plans")
    if any(not 0 <= s < len(g.storage_bytes) for s in g.value_storage):
        raise ValueError("value_storage holds a storage id outside storage_bytes")
    if any(not isinstance(b, int) or b < 0 for b in g.storage_bytes):
        raise ValueError("storage_bytes must be non-negative ints")
    if g.storage_freed and len(g.storage_freed) != len(g.storage_bytes):
        raise ValueError("storage_freed must be empty or have one entry per storage")
    if any(not (math.isfinite(t) and t >= 0) for t in g.node_time):
        raise ValueError("node_time must be finite and non-negative")
    for name in ("demand", "available"):
        if any(not 0 <= v < n_values for v in getattr(g, name)):
            raise ValueError(f"{name} holds a value id outside value_names")
    producer = [-1] * n_values
    for n in range(n_nodes):
        for d in g.node_deps[n]:
            if not 0 <= d < n_values:
                raise ValueError(f"node {n} reads value id {d}, outside value_names")
            if d not in g.available and not 0 <= producer[d] < n:
                raise ValueError(
                    f"node {n} reads {g.value_names[d]!r} before a node produces "
                    "it: list nodes in tape order or mark the value available"
                )
        for v in g.node_outs[n]:
            if not 0 <= v < n_values:
                raise ValueError(f"node {n} produces value id {v}, outside value_names")
            if producer[v] >= 0:
                raise ValueError(
                    f"{g.value_names[v]!r} is produced by nodes {producer[v]} and {n}:"
                    " give every node output its own value id"
                )
            producer[v] = n
    orphans = [
        g.value_names[v] for v in range(n_values) if producer[v] < 0 and v not in g.available
    ]
    if orphans:
        raise ValueError(
            f"values {orphans} are neither produced nor available: mark them available"
        )
    return tuple(producer)


def Graph(
    ops: Mapping[str, tuple[float, int, Sequence[str]]],  # noqa: N802 - a constructor-like front
    demand: Iterable[str],
) -> PlanGraph[str]:
    """A PlanGraph from `{name: (time, bytes, [input names])}` in topological order.

    Each op has one output in its own storage; names that are not ops are leaves
    (available, 0 bytes); `demand` names the values backward reads.
    """
    ids = {name: v for v, name in enumerate(ops)}
    leaves: list[str] = []
    for index, (name, (_, _, deps)) in enumerate(ops.items()):
        for d in deps:
            if d in ops and ids[d] >= index:
                raise ValueError(
                    f"op {name!r} reads {d!r}, which is not defined before it: "
                    "list ops in topological order"
                )
            if d not in ids:
                ids[d] = len(ids)
                leaves.append(d)
    demand = frozenset(demand)
    unknown = sorted(demand - ids.keys())
    if unknown:
        raise ValueError(f"demand names {unknown} are neither ops nor inputs of ops")
    specs = list(ops.values())
    return PlanGraph(
        node_time=tuple(float(t) for t, _, _ in specs),
        node_deps=tuple(tuple(ids[d] for d in deps) for _, _, deps in specs),
        node_outs=tuple((v,) for v in range(len(specs))),
        value_storage=tuple(range(len(ids))),
        storage_bytes=tuple(b for _, b, _ in specs) + (0,) * len(leaves),
        value_names=tuple(ids),
        demand=frozenset(ids[name] for name in demand),
        available=frozenset(range(len(specs), len(ids))),
    )


def _checked(graph: PlanGraph, saved: Iterable[int]) -> list[int]:
    saved = list(saved)
    if any(not 0 <= v < len(graph.value_names) for v in saved):
        raise ValueError(
            "saved holds a value id outside value_names: pass value ids, or graph.value_ids(names)"
        )
    return saved


def stop_bits(graph: PlanGraph, saved: Iterable[int]) -> int:
    """The bitset of `saved` together with the always-available values."""
    return bits(_checked(graph, saved)) | graph.available_bits


def replay_bits(graph: PlanGraph, stop: int) -> int:
    """The nodes replay runs when the values in `stop` are kept (Eq. 3), as a bitset."""
    need = graph.demand_bits & ~stop
    run = 0
    for n in range(len(graph.node_time) - 1, -1, -1):
        if graph.out_bits[n] & need:
            run |= 1 << n
            need |= graph.dep_bits[n] & ~stop
    return run


def nodes_time(graph: PlanGraph, nodes: int) -> float:
    """The summed time of the nodes in bitset `nodes`, exactly rounded whatever the order."""
    return math.fsum(graph.node_time[n] for n in members(nodes))


def storages_bytes(graph: PlanGraph, values: Iterable[int]) -> int:
    """Bytes kept alive by saving `values`: once per storage, 0 for storages held anyway."""
    stores = {graph.value_storage[v] for v in values} - graph.held_storages
    return sum(graph.storage_bytes[s] for s in stores)


def needed(graph: PlanGraph, v: int, run: int) -> bool:
    """Whether value `v` must exist in a replay running the nodes in `run`: backward reads
    it, or a running node does."""
    return bool(graph.demand_bits >> v & 1 or graph.reader_bits[v] & run)


def replay_nodes(graph: PlanGraph, saved: Iterable[int]) -> frozenset[int]:
    """The nodes replay runs when `saved` is kept (Eq. 3)."""
    return frozenset(members(replay_bits(graph, stop_bits(graph, saved))))


def replay_time(graph: PlanGraph, saved: Iterable[int]) -> float:
    """Replay time when `saved` is kept (Eq. 6)."""
    return nodes_time(graph, replay_bits(graph, stop_bits(graph, saved)))


def saved_bytes(graph: PlanGraph, saved: Iterable[int]) -> int:
    """Bytes `saved` keeps alive beyond the always-available values."""
    return storages_bytes(graph, _checked(graph, saved))


def block_nodes(graph: PlanGraph, saved: Iterable[int]) -> frozenset[int]:
    """The nodes block recomputation with early_stop runs when `saved` is kept (Eq. 4)."""
    stop = stop_bits(graph, saved)
    missing = graph.demand_bits & ~stop
    last = max((n for n, out in enumerate(graph.out_bits) if out & missing), default=-1)
    return frozenset(n for n in range(last + 1) if graph.out_bits[n] & ~stop)


def block_time(graph: PlanGraph, saved: Iterable[int]) -> float:
    """Block recomputation time when `saved` is kept (Eq. 5)."""
    return nodes_time(graph, bits(block_nodes(graph, saved)))


def candidates(graph: PlanGraph) -> list[frozenset[int]]:
    """What may be saved: each candidate value, the candidate outputs of a multi-output
    node together, and the candidate values sharing one storage together."""
    free, savable = graph.available_bits, graph.savable
    values = [
        v
        for v in range(len(graph.value_names))
        if not free >> v & 1
        and graph.value_storage[v] not in graph.held_storages
        and (savable is None or v in savable)
    ]
    by_storage: dict[int, list[int]] = {}
    for v in values:
        by_storage.setdefault(graph.value_storage[v], []).append(v)
    chosen = set(values)
    groups = [frozenset((v,)) for v in values]
    groups += [frozenset(v for v in outs if v in chosen) for outs in graph.node_outs]
    groups += [frozenset(vs) for vs in by_storage.values()]
    return list(dict.fromkeys(g for g in groups if g))
