"""The tape: the dataflow graph of one checkpointed block, as recorded from the ops that ran.

A tape holds no tensor data. Values are numbered (value ids, "vids"); every value is either the
output of exactly one node or a leaf (a block input, a parameter or buffer recorded by name, or an
external tensor the block read without a recorded producer). Several values can share one storage
(views), so bytes are counted per storage.

The two recompute sets of the paper (section 3.2.3), ``replay_nodes(S)`` (Eq. 3, what TapeSAC's
replay runs) and ``block_nodes(S)`` (Eq. 4, what torch's block recomputation with ``early_stop``
runs), and their times (Eqs. 6 and 5) are the planner's (``plan.model``), on this tape's graph.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..enums import TextEnum
from ..plan import model
from ..plan.coords import Anchor, Coord
from ..plan.tape_graph import TapeGraph, graph_of
from ..tensors import Meta, Slot


class ValueKind(TextEnum):
    """Where a value comes from. Leaves are kept (inputs) or fetched again by name (parameters,
    buffers); an external tensor the block read has no recorded producer."""

    OP = "op"
    INPUT = "input"
    PARAM = "param"
    BUFFER = "buffer"
    EXTERNAL = "external"


class Mandatory(TextEnum):
    """Why a value is in the mandatory set S0."""

    COLLECTIVE = "collective"
    DYNAMIC_SHAPE = "dynamic_shape"
    INVISIBLE_WRITE = "invisible_write"
    NO_PRODUCER = "no_producer"


OP, INPUT, PARAM, BUFFER, EXTERNAL = ValueKind
COLLECTIVE, DYNAMIC_SHAPE, INVISIBLE_WRITE, NO_PRODUCER = Mandatory

ALIAS_OP = "tapesac.alias"
"""Synthetic node: a view read again after its storage was mutated through another alias."""


def comparable(a: Any) -> Any:
    """Recorded arguments comparable with ``==`` (a ``Slot`` by position)."""
    if type(a) is Slot:
        return ("slot", a.i)
    if type(a) in (list, tuple):
        return tuple(comparable(x) for x in a)
    if type(a) is dict:
        return tuple((k, comparable(v)) for k, v in a.items())
    return a


class Value(NamedTuple):
    """One recorded value: a tensor's content at one version."""

    vid: int
    node: int  # producer node index, -1 for a leaf
    j: int  # output position in the producer
    sid: int  # storage id (views share their base's)
    epoch: int  # in-place writes into the storage before this value was made
    meta: Meta | None  # layout: kept for leaves, externals, views read again after a write,
    # and metadata-only ops and their inputs (what replay rebuilds from)
    version: int  # the tensor's version counter for this content
    kind: ValueKind
    name: str | int | None = None  # leaf: input position or parameter/buffer name

    def __repr__(self) -> str:
        return f"Value({self.vid}, node={self.node}, j={self.j}, kind={self.kind})"


def layout(value: Value) -> Meta:
    """The recorded layout of a value the tape keeps one for (leaves, aliases read after a
    write, the inputs and outputs of metadata-only and random ops)."""
    assert value.meta is not None, f"value {value.vid} was recorded without its layout"
    return value.meta


class Node(NamedTuple):
    """One recorded op call: ``op(*args, **kwargs)`` with tensors replaced by ``Slot``s."""

    index: int  # type: ignore[assignment]  # the node's position; shadows tuple.index on purpose
    op: Any
    name: str  # str(op), e.g. "aten.mm.default"
    k: int  # how many calls of this op came before it in the block
    args: Any
    kwargs: Any
    inputs: list[int]  # value ids of the tensor arguments, in Slot order
    deps: list[int]  # the inputs whose data the op reads
    outs: list[int]  # value ids produced: the returns, then the written-but-not-returned
    writes: tuple[int, ...]  # positions in ``inputs`` the op writes in place
    extra: tuple[int, ...]  # written positions not returned: their new values follow the returns
    rng: Any  # (generator, state) captured before a random op ran
    rebuild: bool  # metadata-only op: output rebuilt from recorded metadata at replay
    module: str | None  # path of the submodule that issued the op, when known

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.name}#{self.k}, in={self.deps}, out={self.outs})"


@dataclass(eq=False)
class Tape:
    """The recorded graph of one block: nodes in order, values, demand set P and mandatory set S0."""

    name: str
    region: str
    nodes: list[Node]
    values: list[Value]
    storage_bytes: list[int]
    demand: frozenset[int]
    mandatory: Mapping[int, Mandatory]  # vid -> reason it is in S0
    planned: frozenset[int]  # values the plan asked to save (on top of S0)
    outputs: frozenset[int] = frozenset()  # values the block returned
    returned: frozenset[int] = frozenset()  # values its submodules returned
    host_sync: bool = False  # an op returned a number to Python (.item()): data may steer ops
    # Per storage an op made, the nodes recorded when Python freed it in the forward (absent:
    # alive at its end); see ``lifetimes.StorageLifetimes``.
    freed: Mapping[int, int] = field(default_factory=dict)
    # A float read from a tensor: it may be a number later ops compute with, which a
    # steady-state call could not check (``steady.tape_blocker``).
    host_floats: bool = False

    @functools.cached_property
    def leaves(self) -> frozenset[int]:
        """Block inputs, parameters and buffers: values the block uses but does not compute
        (cached: a tape's values are final once its block's forward ended)."""
        return frozenset(v.vid for v in self.values if v.kind in (INPUT, PARAM, BUFFER))

    @property
    def always_available(self) -> frozenset[int]:
        """Leaves, external tensors and the mandatory set: available to replay whatever is saved."""
        return self.leaves | frozenset(self.mandatory)

    def coord(self, vid: int) -> Coord | None:
        """The plan coordinate of a value, or None for leaves."""
        v = self.values[vid]
        if v.node < 0:
            return None
        node = self.nodes[v.node]
        return Coord(node.name, node.k, v.j)

    @functools.cached_property
    def _anchor_calls(self) -> list[int]:
        calls: dict[tuple[str, str], int] = {}
        out = []
        for node in self.nodes:
            key = (node.module or "", node.name)
            out.append(calls.get(key, 0))
            calls[key] = out[-1] + 1
        return out

    def anchor(self, vid: int) -> Anchor | None:
        """The anchored coordinate of a value, or None for leaves."""
        v = self.values[vid]
        if v.node < 0:
            return None
        node = self.nodes[v.node]
        return Anchor(node.module or "", node.name, self._anchor_calls[v.node], v.j)

    @functools.cached_property
    def module_fingerprints(self) -> dict[str, str]:
        """Per submodule path ("" for the block's own ops), a digest of the ops it issued itself:
        where two blocks' digests agree, that module's anchored coordinates name the same values."""
        ops: dict[str, list[str]] = {}
        for node in self.nodes:
            ops.setdefault(node.module or "", []).append(node.name)
        return {
            m: f"{zlib.crc32(chr(10).join(names).encode()):08x}-{len(names)}"
            for m, names in ops.items()
        }

    def find(self, coord: Coord) -> int | None:
        """The value at a plan coordinate, or None if the block has no such output."""
        name, k, j = coord
        for node in self.nodes:
            if node.name == name and node.k == k:
                for vid in node.outs:
                    if self.values[vid].j == j:
                        return vid
        return None

    def bytes_of(self, vids: Iterable[int]) -> int:
        """Bytes that keeping ``vids`` alive costs: each storage once, leaves' storages free.

        A value kept from before a later in-place write into its storage is kept on a copy of
        the storage (one copy per write), so storages are counted per (storage, epoch).
        """
        leaf_sids = {self.values[v].sid for v in self.leaves}
        kept = {(self.values[v].sid, self.values[v].epoch) for v in vids}
        return sum(self.storage_bytes[sid] for sid, _ in kept if sid not in leaf_sids)

    def needed_sources(self, saved: Iterable[int] = ()) -> frozenset[int]:
        """Among ``saved``, S0 and the leaves, the values replay or autograd reads: what a block keeps."""
        available = self.always_available | frozenset(saved)
        reads = read_counts(self.nodes, self.demand, {}, available.__contains__)
        return frozenset((self.demand | reads.keys()) & available)

    def saved_bytes(self, saved: Iterable[int]) -> int:
        """Bytes keeping ``saved`` costs beyond S0 and the leaves (the planner's measure)."""
        always = self.always_available
        return self.bytes_of(always | frozenset(saved)) - self.bytes_of(always)

    @property
    def rng_bytes(self) -> int:
        """Bytes of the generator states kept to replay random ops (none in a steady-state
        call's cached tape: ``draws.py``)."""
        return sum(
            n.rng[1].nbytes for n in self.nodes if n.rng is not None and n.rng[1] is not None
        )

    @property
    def mandatory_bytes(self) -> int:
        """Bytes the mandatory set S0 keeps alive (storages counted once, leaves excluded)."""
        return self.bytes_of(self.mandatory)

    @functools.cached_property
    def _graph(self) -> TapeGraph:
        """The planner's model of this tape, untimed: what Eqs. 3 and 4 are computed on."""
        return graph_of(self, {})

    def replay_nodes(self, saved: Iterable[int] = ()) -> list[int]:
        """Eq. 3: the nodes replay runs to regenerate the demand set P from ``saved`` ∪ S0 ∪ leaves
        (an upper bound: backward may never unpack a branch whose gradient is not needed)."""
        return sorted(model.replay_nodes(self._graph, saved))

    def block_nodes(self, saved: Iterable[int] = ()) -> list[int]:
        """Eq. 4: the nodes torch's block recomputation (early_stop=True) runs for the same save set."""
        return sorted(model.block_nodes(self._graph, saved))

    def replay_time(self, saved: Iterable[int], node_time: Mapping[int, float]) -> float:
        """Eq. 6: total time of ``replay_nodes(saved)`` (nodes without a time cost 0)."""
        return model.replay_time(graph_of(self, node_time), saved)

    def block_time(self, saved: Iterable[int], node_time: Mapping[int, float]) -> float:
        """Eq. 5: total time of ``block_nodes(saved)`` (nodes without a time cost 0)."""
        return model.block_time(graph_of(self, node_time), saved)

    def op_sequence(self) -> tuple[str, ...]:
        """The names of the recorded ops in order: blocks with equal sequences share a plan."""
        return tuple(n.name for n in self.nodes)

    @functools.cached_property
    def token_independent(self) -> frozenset[int]:
        """Op values computed from parameters and buffers alone (a weight cast under mixed
        precision, a gathered or transposed weight): their size does not grow with tokens.

        Values of ops that read no data (factory ops, whose sizes often come from the sequence
        length) and anything that reads a block input or an external tensor scale with tokens.
        """
        fixed = {v.vid for v in self.values if v.kind in (PARAM, BUFFER)}
        for node in self.nodes:
            if node.deps and all(d in fixed for d in node.deps):
                fixed.update(node.outs)
        return frozenset(v for v in fixed if self.values[v].kind == OP)

    @functools.cached_property
    def data_sized(self) -> frozenset[int]:
        """Op values whose storage's size may depend on the data, not only on the block's input
        shapes: outputs of ops whose shape depends on values (``DYNAMIC_SHAPE``: the tokens
        routed to an expert), and every storage an op makes from such a value. A view of, or a
        write into, an older storage keeps that storage's size (an expert's output added into
        the token-shaped output). After the first data-sized value, an op reading no tensor
        (a factory, sized by Python integers that may be such a value's length) makes one too.
        After a number read from a tensor (``host_sync``) any size may follow it: every op
        value. Sizes that hang on integers taken from a data-sized tensor's shape by an op that
        reads other tensors (``x.new_zeros(len(idx))``) are not seen here; the profile adds the
        values whose sizes differed between blocks (``RegionProfile.data_sized``)."""
        if self.host_sync:
            return frozenset(v.vid for v in self.values if v.kind == OP)
        dynamic = {v for v, why in self.mandatory.items() if why == DYNAMIC_SHAPE}
        made_by: dict[int, int] = {}  # storage id -> the node that made it (-1: not an op)
        for v in self.values:
            made_by.setdefault(v.sid, v.node)
        sized: set[int] = set()  # storage ids
        for node in self.nodes:
            from_data = any(self.values[i].sid in sized for i in node.inputs) or (
                not node.inputs and bool(sized)
            )
            for o in node.outs:
                sid = self.values[o].sid
                if made_by[sid] == node.index and (from_data or o in dynamic):
                    sized.add(sid)
        return frozenset(v.vid for v in self.values if v.kind == OP and v.sid in sized)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable digest of the op sequence (the same in every process, unlike ``hash``)."""
        return f"{zlib.crc32(chr(10).join(self.op_sequence()).encode()):08x}-{len(self.nodes)}"


def producer_closure(
    nodes: list[Node], values: list[Value], targets: Iterable[int], available: Callable[[int], bool]
) -> set[int]:
    """Indices of the nodes that must run so that ``targets`` exist, stopping at available values."""
    needed: set[int] = set()
    stack = [v for v in targets if not available(v)]
    seen = set(stack)
    while stack:
        node = nodes[values[stack.pop()].node]
        if node.index in needed:
            continue
        needed.add(node.index)
        for d in node.deps:
            if d not in seen and not available(d):
                seen.add(d)
                stack.append(d)
    return needed


def read_counts(
    nodes: list[Node], demand: Iterable[int], pack_count: Mapping[int, int], available: Any
) -> dict[int, int]:
    """How often one backward reads each value: autograd reads each demanded value replay
    produces once per pack, and the nodes replay runs for them (their producer closure, as
    ``producer_closure``) read their deps.

    One sweep from the last node back, instead of a closure walk and a second pass: a node
    runs if it produces a value still needed, and every value a node reads was made before it.
    """
    reads: dict[int, int] = {}
    needed: set[int] = set()
    for vid in demand:
        if not available(vid):
            reads[vid] = reads.get(vid, 0) + pack_count.get(vid, 0)
            needed.add(vid)
    for node in reversed(nodes):
        if not needed:
            break
        if needed.isdisjoint(node.outs):
            continue
        needed.difference_update(node.outs)
        for d in node.deps:
            reads[d] = reads.get(d, 0) + 1
            if not available(d):
                needed.add(d)
    return reads


class ReplayMemo:
    """The read counts and producer closures replay computed for one cached tape, by what was
    available then: steady-state calls of a tape replay the same closures every step, and
    walking the tape again costs a tenth of a millisecond a block. Keys are the values replay
    had at hand beyond the tape's kept ones (which a cached tape fixes); at most ``size`` of
    each are kept, the oldest dropped first."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._reads: dict[frozenset[int], dict[int, int]] = {}
        self._closures: dict[tuple[int, frozenset[int]], list[int]] = {}
        # Calls of one module in two threads (DataParallel's replicas share its cache) share the
        # memo: the oldest entry must leave once.
        self._lock = threading.Lock()

    def reads(self, at_hand: frozenset[int], count: Callable[[], dict[int, int]]) -> dict[int, int]:
        """``count()``'s read counts with ``at_hand`` available, as a copy replay may spend."""
        counts = self._reads.get(at_hand)
        if counts is None:
            counts = self._remember(self._reads, at_hand, count())
        return dict(counts)

    def closure(
        self, vid: int, at_hand: frozenset[int], walk: Callable[[], list[int]]
    ) -> list[int]:
        """``walk()``'s node indices to run for ``vid`` with ``at_hand`` available, in order."""
        key = (vid, at_hand)
        indices = self._closures.get(key)
        if indices is None:
            indices = self._remember(self._closures, key, walk())
        return indices

    def _remember(self, memo: dict[Any, Any], key: Any, value: Any) -> Any:
        with self._lock:
            if len(memo) >= self.size:
                del memo[next(iter(memo))]
            memo[key] = value
        return value
