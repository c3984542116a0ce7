"""Steady state: a module block recorded once per signature, then run from its cached tape.

Contract. A module block's first call with a signature (``signature.py``) is recorded as ever.
If its tape allows it (``steady_tape``: no random op drawn by value, no float read from a tensor
or collective, every kept value one that autograd saves or a submodule returns), the tape is
cached on the module (``SteadyCache``). A later call with the same signature runs its forward
under the saved-tensor hooks and a lean checking dispatch mode (``SteadyForward``; the mode is
``op_checks.SteadyCheck``): the k-th tensor autograd packs is the value the tape's k-th pack
was, so it is held where the recorded call held it (S0, the plan, a block input) and otherwise
handed to autograd as a handle; backward replays from the cached tape as for a recorded block.
The block keeps the same values, so it frees what a recorded block frees.

Checked as it runs, before backward may trust the tape: every op the forward dispatches, its
non-tensor arguments (numbers read from attributes, globals, closures or the data) and which
op made each tensor it reads (``op_checks.py``); each pack's shape and dtype, or, where sizes
follow the data, its sizes against the bindings (``data_sizes.py``); where the call holds values
a submodule returns, each such submodule call (only then are the submodules hooked); and at the
end of forward the kinds of the autograd nodes the block created (from its outputs back to its
inputs), against the recorded call's. On the first difference the call diverged: the cached
tape is dropped (the next call records), one warning names the block and what differed, and
this call's backward runs the block's forward again as ``torch.utils.checkpoint`` does (from
its inputs, with the generator states of its start), taking the k-th packed tensor for handle
k: nothing comes from the stale tape.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._compat import dispatch_disabled, torch_function_disabled
from ..enums import TextEnum
from ..tensors import (
    Meta,
    default_generator,
    detached,
    flat_tensors,
    layout_of,
    on_storage,
    view_on,
)
from ..units import format_bytes
from .call_checks import CallCheck, CallLog, LoggedCalls, eligible
from .draws import Draws, draws_by_layout
from .op_checks import Check, FastCheck, OpKinds, OpLog, SteadyCheck, fast_checks
from .tape import (
    BUFFER,
    COLLECTIVE,
    DYNAMIC_SHAPE,
    EXTERNAL,
    INPUT,
    OP,
    PARAM,
    Node,
    ReplayMemo,
    Tape,
    Value,
)

if TYPE_CHECKING:
    from .block import Block
    from .data_sizes import DataBinding, DataTemplate
    from .size_templates import SizeTemplate
    from .structure_switch import Switch

Tensor = torch.Tensor


class Recorded(TextEnum):
    """Why a block's call was recorded rather than run in steady state."""

    FIRST_CALL = "first call with this signature"
    MEASURED = "a profiling, sampling or verification step"
    NOT_A_MODULE = "a function block (steady state needs a module)"
    RANDOM = (
        "random ops whose draws depend on values or on a generator passed in: replayed from "
        "the generator states recorded at each call"
    )
    DATA_DEPENDENT = "data-dependent shapes, collectives or an op sequence that differs by call"
    HOST_SYNC = "a host sync (.item(), a tensor's truth value) may steer its ops"
    UNSAVED_KEPT = "the plan or S0 keeps values autograd does not save"
    OUTSIDE_GRAPH = "its autograd graph reaches tensors that are not its inputs"
    GRAPH_DIFFERS = (
        "its tapes' first steady-state calls ran other ops, twice or more in a row: recorded "
        "for 4, 8, ... 64 calls before a tape is tried again"
    )
    SIZES = "the integers in its ops follow no curve of its input sizes (each new size records)"
    MOVED = (
        "a tensor autograd saved moved to other bytes after (.data =): a steady-state call "
        "would hold the bytes it had then"
    )
    DATA_SIZES = (
        "sizes that follow its data: recorded until calls of one op structure make a template "
        "whose sizes each call binds from what autograd saves"
    )


Layout = tuple[torch.Size, torch.dtype]
View = tuple[tuple[int, ...], int]  # a packed tensor's strides and storage offset


@dataclass
class PackLog:
    """What a recording saw at its packs, for steady-state calls: each packed tensor's layout and
    view (strides, offset); per submodule exit, the packs before it."""

    layouts: list[Layout] = field(default_factory=list)
    views: list[View] = field(default_factory=list)
    exit_packs: list[int] = field(default_factory=list)
    # Each packed tensor's source as the calls' and as the ops' check know it
    # (``Sources.pack_key``): a custom ``autograd.Function`` picks what it saves in Python.
    sources: list[tuple[Any, Any]] = field(default_factory=list)


class Holds(NamedTuple):
    """What a steady-state call holds from one packed tensor: values on its storage (``meta``
    None: the packed tensor itself; else the recorded layout of another view of that storage),
    on a copy of the storage if the forward writes into it later (as the recorder moves a held
    value off a storage about to be written)."""

    copy: bool
    values: tuple[tuple[int, Meta | None], ...]


@dataclass(eq=False)
class SteadyTape:
    """A recorded call, as later calls with its signature run from it. Fixed once made, but for
    ``confirmed``, which its first matching steady-state call sets."""

    tape: Tape
    handles: tuple[int, ...]  # the value of each pack, in pack order
    # Per pack, its tensor's source as the calls' check, and as the ops' check, knows it.
    pack_sources: tuple[tuple[Any, ...], tuple[Any, ...]]
    packs: tuple[Layout, ...]  # shape and dtype of each pack, checked as the packs come
    hold: Mapping[int, Holds]  # pack index -> the values held from the packed tensor's storage
    # Submodule exit -> (position of a returned tensor, its layout, what is held from it).
    exit_hold: Mapping[int, tuple[tuple[int, Layout, Holds], ...]]
    exits: int  # submodule exits in the forward
    empty: tuple[tuple[int, Meta], ...]  # external tensors of no bytes, made again by layout
    inputs: tuple[int | None, ...]  # per block input, the value it is kept as (None: not kept)
    outputs: tuple[int | None, ...]  # per output tensor, its value if backward may take it alive
    # Per output tensor, where it came from (``op_checks.Sources.key``), as the calls' check
    # and as the ops' check know it: a call returning another tensor there (its input, say)
    # gives backward none alive.
    output_sources: tuple[tuple[Any, ...], tuple[Any, ...]]
    kept: frozenset[int]
    saved: frozenset[int]
    pack_count: Mapping[int, int]
    writes_in_place: bool
    device_types: frozenset[str]
    autograd: tuple[str, ...]  # the autograd nodes the forward created (``autograd_nodes``)
    checks: tuple[Check, ...]  # every op the forward dispatched (``op_checks.py``)
    drawing: Mapping[int, int]  # check index -> node index of the random ops among them
    op_kinds: OpKinds  # ops the checks pass over
    # The random ops, in order: each steady-state call reads their states (``draws.py``).
    random: tuple[Node, ...]
    # Sizes that follow the data (``data_dependent``), else empty: each pack's view, the
    # parameter or buffer whose storage a pack is a view of, and the packs before each exit.
    views: tuple[View, ...] = ()
    leaf_packs: Mapping[int, int] = field(default_factory=dict)
    exit_packs: tuple[int, ...] = ()
    confirmed: bool = False  # a steady-state call of it made the same autograd nodes
    # What made it at sizes not recorded (a size or a data template), if anything.
    template: SizeTemplate | DataTemplate | None = None
    # Its calls' replay closures (a copy at another size, ``dataclasses.replace``, starts afresh).
    memo: ReplayMemo = field(default_factory=ReplayMemo, init=False)
    # Its checks as its steady-state calls compare them, made at the first (``op_checks``).
    fast: list[FastCheck | None] | None = field(default=None, init=False)
    # Its torch-function calls, where they can check a steady-state call (``call_checks.py``;
    # None: its ops are checked, and ``calls_not_checked`` says why).
    calls: LoggedCalls | None = None
    calls_not_checked: str | None = None


def steady_tape(
    block: Block,
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
    output_vids: Sequence[int],
    autograd: tuple[str, ...] | None,
    log: PackLog,
    ops: OpLog,
    calls: CallLog,
) -> SteadyTape | Recorded:
    """The finished recorded ``block`` as a steady-state entry, or why later calls must record.
    ``autograd``: the kinds of the autograd nodes its forward made (``autograd_nodes``); ``log``:
    what the recording saw at its packs; ``ops``: what it dispatched; ``calls``: the torch
    functions it called."""
    tape: Tape = block.trace.tape
    blocked = tape_blocker(tape)
    if blocked is not None:
        return blocked
    if block.trace.over_budget:
        return Recorded.DATA_DEPENDENT
    handles, values = tuple(block.handles), tape.values
    first_pack: dict[int, int] = {}
    on_storage_at: dict[tuple[int, int], int] = {}  # (storage, epoch) -> its first pack
    for k, vid in enumerate(handles):
        first_pack.setdefault(vid, k)
        on_storage_at.setdefault(_storage(values[vid]), k)
    last_epoch: dict[int, int] = {}
    for v in values:
        last_epoch[v.sid] = max(last_epoch.get(v.sid, 0), v.epoch)
    # Submodule outputs: where a kept value's storage is never packed (the output of a linear
    # layer that only an add reads), the submodule's forward hook still sees it.
    returned_at: dict[tuple[int, int], tuple[int, int]] = {}
    for j, returned in enumerate(block.exits):
        for i, (returned_vid, _) in enumerate(returned):
            if returned_vid is not None:
                returned_at.setdefault(_storage(values[returned_vid]), (j, i))
    held_at: dict[int, list[tuple[int, Meta | None]]] = {}
    held_at_exit: dict[tuple[int, int], list[tuple[int, Meta | None]]] = {}
    input_vid: dict[int, int] = {}
    empty: list[tuple[int, Meta]] = []
    for vid, t in block.held.items():
        value = values[vid]
        where = _storage(value)
        if value.kind == INPUT:
            assert isinstance(value.name, int), "a block input's name is its position"
            input_vid[value.name] = vid
        elif vid in first_pack:
            held_at.setdefault(first_pack[vid], []).append((vid, None))
        elif where in on_storage_at:
            held_at.setdefault(on_storage_at[where], []).append((vid, layout_of(t)))
        elif where in returned_at:
            held_at_exit.setdefault(returned_at[where], []).append((vid, layout_of(t)))
        elif value.kind == EXTERNAL and not tape.storage_bytes[value.sid]:
            empty.append((vid, layout_of(t)))  # torch.tensor([]) in the forward: no content
        else:
            return Recorded.UNSAVED_KEPT

    def written_later(vid: int) -> bool:
        return last_epoch[values[vid].sid] > values[vid].epoch

    hold = {k: Holds(written_later(handles[k]), tuple(held)) for k, held in held_at.items()}
    exit_hold: dict[int, tuple[tuple[int, Layout, Holds], ...]] = {}
    for (j, i), held in held_at_exit.items():
        exit_vid, layout = block.exits[j][i]
        assert exit_vid is not None, "only returned values were held at an exit"
        copy = written_later(exit_vid)
        exit_hold[j] = (*exit_hold.get(j, ()), (i, layout, Holds(copy, tuple(held))))
    if autograd is None:
        return Recorded.OUTSIDE_GRAPH
    alive = block.refs
    stateless = _stateless(tape)  # the cache keeps no state of this recorded call
    random = tuple(n for n in stateless.nodes if n.rng is not None)
    data = data_dependent(tape)
    leaf_storages = {v.sid: v.vid for v in values if v.kind in (PARAM, BUFFER)}
    packed = frozenset(handles)
    by_call = eligible(calls, ops.checks, tape.nodes, bool(ops.passed), data, packed)
    return SteadyTape(
        tape=stateless,
        handles=handles,
        pack_sources=(tuple(c for c, _ in log.sources), tuple(o for _, o in log.sources)),
        packs=tuple(log.layouts),
        hold=hold,
        exit_hold=exit_hold,
        exits=len(block.exits),
        empty=tuple(empty),
        inputs=tuple(input_vid.get(i) for i in range(len(inputs))),
        outputs=tuple(v if v in alive else None for v in output_vids),
        output_sources=(
            tuple(calls.sources.key(t) for t in outputs),
            tuple(ops.sources.key(t) for t in outputs),
        ),
        kept=block.kept,
        saved=block.trace.saved,
        pack_count=block.pack_count,
        writes_in_place=block.writes_in_place,
        device_types=frozenset(block.device_types),
        autograd=autograd,
        checks=tuple(
            c._replace(grad_free=False)
            if c.grad_free and c.node >= 0 and not packed.isdisjoint(tape.nodes[c.node].outs)
            else c
            for c in ops.checks
        ),
        drawing={
            c: check.node
            for c, check in enumerate(ops.checks)
            if check.node >= 0 and tape.nodes[check.node].rng is not None
        },
        op_kinds=ops.kinds(),
        random=random,
        views=tuple(log.views) if data else (),
        leaf_packs={
            k: leaf_storages[values[vid].sid]
            for k, vid in enumerate(handles)
            if data and values[vid].sid in leaf_storages
        },
        exit_packs=tuple(log.exit_packs) if data else (),
        calls=None if isinstance(by_call, str) else by_call,
        calls_not_checked=by_call if isinstance(by_call, str) else None,
    )


def tape_blocker(tape: Tape) -> Recorded | None:
    """Why no call of ``tape``'s kind can run in steady state (None: it may, per call)."""
    if any(n.rng is not None and not draws_by_layout(n) for n in tape.nodes):
        return Recorded.RANDOM
    if tape.host_floats:
        return Recorded.HOST_SYNC
    if COLLECTIVE in tape.mandatory.values():
        return Recorded.DATA_DEPENDENT
    return None


def data_dependent(tape: Tape) -> bool:
    """Whether ``tape``'s sizes may follow its data (a shape computed from values, a number
    read from a tensor): its steady-state calls bind them per call (``data_sizes.py``)."""
    return tape.host_sync or DYNAMIC_SHAPE in tape.mandatory.values()


def _stateless(tape: Tape) -> Tape:
    """``tape`` without its random ops' generator states (5 KB each on CPU): a steady-state call
    derives its own (``draws.py``), and the cache must not keep the recorded call's alive."""
    if all(n.rng is None for n in tape.nodes):
        return tape
    nodes = [n if n.rng is None else n._replace(rng=(n.rng[0], None)) for n in tape.nodes]
    return replace(tape, nodes=nodes)


def savable_values(tape: Tape) -> frozenset[int] | None:
    """The values a steady-state call of ``tape`` can hold, on storages autograd saves or a
    submodule returns (``steady_tape`` holds them there); None when it cannot run in steady
    state, so that any value may be kept."""
    if tape_blocker(tape) is not None:
        return None
    values = tape.values
    seen = {_storage(values[v]) for v in tape.demand | tape.returned}
    return frozenset(v.vid for v in values if v.kind == OP and _storage(v) in seen)


def _storage(value: Value) -> tuple[int, int]:
    """A value's storage at its epoch: the content a tensor on it has."""
    return (value.sid, value.epoch)


def autograd_nodes(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], limit: int
) -> tuple[str, ...] | None:
    """The kinds of the autograd nodes between ``outputs`` and ``inputs``, in a fixed walk
    order (``node_kind``); None when the walk passes ``limit`` nodes (the graph reaches tensors
    made before the block that are not its inputs: a walk would cross the whole model)."""
    # Nodes, not their ids: the seen set keeps each Python wrapper alive, so that a freed one's
    # id cannot come back as another node's. The stack holds ``next_functions``' (node, input)
    # pairs as they come: no per-node unpacking on the way in.
    stop = {_gradient_node(t) for t in inputs}
    stack = [(t.grad_fn, 0) for t in reversed(outputs)]
    seen: set[Any] = set()
    kinds: list[type] = []
    pop, push, see, add = stack.pop, stack.extend, seen.add, kinds.append
    while stack:
        fn = pop()[0]
        if fn is None or fn in seen or fn in stop:
            continue
        see(fn)
        add(type(fn))
        if len(kinds) > limit:
            return None
        push(reversed(fn.next_functions))
    return tuple(map(node_kind, kinds))


def _gradient_node(t: Tensor) -> Any:
    """The autograd node a gradient for ``t`` flows into: its ``grad_fn``, or a leaf's
    ``AccumulateGrad`` (a block input that is a leaf: its walk stops there as at any input's,
    whether the input is a leaf, as in a diverged call's recomputation, or not)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    with dispatch_disabled(), torch_function_disabled():  # it takes a view: not the forward's
        return torch.autograd.graph.get_gradient_edge(t).node


# Autograd nodes a composite op makes without a dispatch mode, and the one it makes under any
# (``reshape`` takes ``_reshape_alias`` unless ``isTensorSubclassLike``, true under a mode):
# the recorder's mode, or a user's (FlopCounterMode) around a steady-state call.
_UNDER_A_MODE = {"ReshapeAliasBackward0": "ViewBackward0"}


@functools.cache
def node_kind(node_type: type) -> str:
    """An autograd node's type name, the same with and without a dispatch mode."""
    return _UNDER_A_MODE.get(node_type.__name__, node_type.__name__)


class SteadyForward:
    """The pack hook of one steady-state call, and its end-of-forward check."""

    def __init__(
        self,
        block: Block,
        entry: SteadyTape,
        inputs: Sequence[Tensor],
        binding: DataBinding | None = None,
        switch: Switch | None = None,
    ) -> None:
        self.block, self.entry = block, entry
        self.binding = binding  # sizes that follow the data: bound and checked per pack
        self.count = 0
        self.diverged: str | None = None
        self.departed: int | None = None  # op checks passed before a pack departed
        self.later: list[Layout] = []  # packs after a divergence, for the recomputation's check
        self.sources: list[Any] = []  # each pack's ``Sources.pack_key``, for it too
        self.exits = 0
        self.outside: dict[int, Tensor] = {}  # held externals, as ``Holding.outside``
        block.on_exit = self.exited
        self.rng = generator_states(inputs)
        assert block.module is not None, "only module blocks run in steady state"
        self.check = _checking(entry, inputs, block.module, binding)
        self.level = 0 if isinstance(self.check, CallCheck) else 1  # of ``pack_sources``
        self._switch = switch  # to another template of the binding's family
        if switch is not None and isinstance(self.check, SteadyCheck):
            self.check.switch = self.switched
        block.adopt(entry)
        held = block.held
        for vid, t in zip(entry.inputs, inputs):
            if vid is not None:
                held[vid] = detached(t)
        for vid, layout in entry.empty:
            held[vid] = torch.empty_strided(
                layout.shape, layout.stride, dtype=layout.dtype, device=layout.device
            )

    def switched(self, c: int, pack: Tensor | None = None) -> bool:
        """Whether the call, departing from its template at op ``c`` (or, inside op ``c - 1``,
        at ``pack``), goes on against another template of its family
        (``structure_switch.py``)."""
        binding, switch, check = self.binding, self._switch, self.check
        if self.diverged is not None or binding is None or switch is None:
            return False
        assert isinstance(check, SteadyCheck), "a bound call's ops are checked"
        if check.diverged is not None:
            return False
        found = switch.target(binding, c, self.exits, pack)
        if found is None:
            return False
        rebound, vids = found
        held = self.block.held
        if any(v not in vids for v in held):
            return False
        renamed = {vids[v]: t for v, t in held.items()}
        held.clear()
        held.update(renamed)
        self.binding = rebound
        entry = self.entry = rebound.template.entry
        if entry.fast is None:
            entry.fast = fast_checks(entry.checks, entry.tape.nodes, rebound.size_arguments)
        check.follow(c, entry.checks, entry.op_kinds, entry.tape.nodes, entry.fast, entry.drawing)
        self.block.adopt(entry)
        return True

    def pack(self, t: Tensor) -> int:
        """Autograd saves ``t``: the tape's ``k``-th pack, held if the recorded call held it."""
        check = self.check
        check.pause()
        try:
            return self._pack(t)
        finally:
            check.resume()

    def _pack(self, t: Tensor) -> int:
        k = self.count
        self.count = k + 1
        check = self.check
        if check.diverged is not None:
            check.packed(t)
        if self.diverged is None and self.binding is not None:
            return self._pack_bound(k, t, self.binding)
        if self.diverged is None:
            entry = self.entry
            packs = entry.packs
            if k < len(packs) and packs[k][1] is t.dtype and packs[k][0] == t.shape:
                # Where it came from: a custom ``autograd.Function`` picks what it saves.
                source = entry.pack_sources[self.level][k]
                if check.sources.saved_is(t, source):
                    self.sources.append(source)
                    holds = entry.hold.get(k)
                    if holds is not None:
                        self._hold(t, holds)
                    return k
                self.diverged = f"saved tensor {k} was made by other {check.unit} than the tape's"
            else:
                expected = f"{tuple(packs[k][0])} {packs[k][1]}" if k < len(packs) else "no pack"
                self.diverged = (
                    f"saved tensor {k} is {tuple(t.shape)} {t.dtype}, the tape has {expected}"
                )
        self.sources.append(check.sources.pack_key(t))
        self.later.append((t.shape, t.dtype))
        return k

    def _pack_bound(self, k: int, t: Tensor, binding: DataBinding) -> int:
        """``pack`` where sizes follow the data: ``t`` binds and is checked (``data_sizes.py``)."""
        why = binding.check(k, t)
        if why is not None and self.switched(self.check.count, t):
            binding, why = self.binding, None  # type: ignore[assignment]
        sources = self.check.sources
        if why is not None:
            self.diverged, self.departed = why, self.check.count
            self.sources.append(sources.pack_key(t))
            self.later.append((t.shape, t.dtype))
            return k
        source = self.entry.pack_sources[1][k]
        if not sources.saved_is(t, source):  # bound: among the binding's layouts
            self.diverged = f"saved tensor {k} was made by other ops than the tape's"
            self.departed = self.check.count
            self.sources.append(sources.pack_key(t))
            return k
        self.sources.append(source)
        holds = self.entry.hold.get(k)
        if holds is not None:
            self._hold(t, binding.holds(k, holds))
        return k

    def exited(self, output: Any) -> None:
        """A submodule returned ``output``: hold what the recorded call held from it."""
        check = self.check
        check.pause()
        try:
            self._exited(output)
        finally:
            check.resume()

    def _exited(self, output: Any) -> None:
        j = self.exits
        self.exits = j + 1
        held_here = self.entry.exit_hold.get(j)
        if held_here is None or self.diverged is not None:
            return
        if self.binding is not None:
            held_here = self.binding.exit_held(j, held_here)
        returned = flat_tensors(output)
        for i, (shape, dtype), holds in held_here:
            if i < len(returned) and returned[i].dtype is dtype and returned[i].shape == shape:
                self._hold(returned[i], holds)
            else:
                self.diverged = (
                    f"submodule call {j} did not return a {tuple(shape)} {dtype} tensor {i}"
                )
                return

    def _hold(self, t: Tensor, holds: Holds) -> None:
        held, values = self.block.held, self.entry.tape.values
        # Bookkeeping, not the forward's: unseen by every mode (the call's checking mode, a
        # user's), whose Python dispatch costs several times the views' own making.
        with dispatch_disabled(), torch_function_disabled():
            storage = t.untyped_storage().clone() if holds.copy else t.untyped_storage()
            for vid, layout in holds.values:
                if layout is not None:
                    held[vid] = view_on(storage, layout)
                else:
                    held[vid] = on_storage(t, storage) if holds.copy else t.detach()
                if not holds.copy and values[vid].kind == EXTERNAL:
                    self.outside[vid] = t

    def _over_budget(self, binding: DataBinding) -> str | None:
        """Where the values the plan keeps take more bytes at this call's sizes than the plan
        allows the block, why the call must not keep them (a recorded call keeps fewer,
        ``Block._within_budget``; held until here, the excess lives only during the forward)."""
        budget = self.block.plan_budget
        if budget is None:
            return None
        tape = binding.tape().tape
        kept = tape.saved_bytes(tape.planned)
        if kept <= budget:
            return None
        return (
            f"the values its plan keeps take {format_bytes(kept)} at its sizes, over the "
            f"{format_bytes(budget)} the plan allows the block"
        )

    def matched(self) -> int:
        """How many op checks the call passed before it departed from its tape (a check's
        mode stops counting at its departure)."""
        return self.check.count if self.departed is None else self.departed

    def layouts(self) -> list[Layout]:
        """Every pack's layout this forward: the tape's up to a divergence, then its own."""
        if self.binding is not None:
            return self.binding.layouts + self.later
        return list(self.entry.packs[: self.count - len(self.later)]) + self.later

    def finish(self, outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> str | None:
        """End of forward: what differed from the tape, if anything; else the block keeps what
        the recorded call kept, and takes alive the outputs backward reads."""
        entry, block, check = self.entry, self.block, self.check
        # An op departs before the packs it makes: its reason comes first.
        self.diverged = check.diverged or self.diverged
        if self.diverged is None and not check.complete:
            self.diverged = f"{check.count} {check.unit} ran, the tape has more"
        if self.diverged is None and self.count != len(entry.packs):
            self.diverged = f"{self.count} tensors saved, the tape has {len(entry.packs)}"
        # Exits are counted only where the call holds values a submodule returns (only then
        # are its submodules hooked, ``submodule_hooks.py``).
        if self.diverged is None and entry.exit_hold and self.exits != entry.exits:
            self.diverged = f"{self.exits} submodule calls, the tape has {entry.exits}"
        if self.diverged is None and self.binding is not None:
            assert isinstance(check, SteadyCheck), "a bound call's ops are checked"
            self.diverged = self.binding.finish(check.sizes) or self._over_budget(self.binding)
        if self.diverged is None:
            made = autograd_nodes(outputs, inputs, limit=len(entry.autograd))
            same = made == entry.autograd
            entry.confirmed = entry.confirmed or same
            if not same:
                self.diverged = "autograd recorded other operations than the tape's"
        if self.diverged is not None:
            return self.diverged
        if self.binding is not None:
            entry = self.entry = self.binding.tape()
            block.adopt(entry)
        if entry.random:
            block.draws = Draws(check.states)
            block.trace.draws_bytes = block.draws.nbytes
        self.rng = []  # only a recomputation needs it: the pack hook lives as long as the graph
        block.note_leaves(check.sources.read)
        sources = entry.output_sources[0 if isinstance(check, CallCheck) else 1]
        key = check.sources.key
        block.refs = {
            vid: (weakref.ref(t), t._version)
            for vid, t, source in zip(entry.outputs, outputs, sources)
            if vid is not None and key(t) == source
        }
        return None


def _checking(
    entry: SteadyTape,
    inputs: Sequence[Tensor],
    module: torch.nn.Module,
    binding: DataBinding | None,
) -> SteadyCheck | CallCheck:
    """The mode that checks a steady-state call of ``entry`` as it runs: its torch-function
    calls where they can (``call_checks.py``), else its ops (``op_checks.py``)."""
    if entry.calls is not None and entry.template is None and binding is None:
        return CallCheck(entry.calls, entry.tape.nodes, inputs, module)
    size_arguments = binding.size_arguments if binding is not None else None
    if entry.fast is None:
        entry.fast = fast_checks(entry.checks, entry.tape.nodes, size_arguments)
    return SteadyCheck(
        entry.checks,
        entry.op_kinds,
        entry.tape.nodes,
        entry.fast,
        entry.drawing,
        inputs,
        module,
        size_arguments,
    )


def generator_states(inputs: Sequence[Tensor]) -> list[tuple[torch.Generator, Tensor]]:
    """The state of each default generator the block's ops may draw from (the CPU's and its
    inputs' devices'): a recomputation after a divergence draws the same numbers."""
    devices = {torch.device("cpu")} | {t.device for t in inputs}
    generators = [default_generator(d) for d in devices if d.type != "meta"]
    return [(g, g.get_state()) for g in generators]
