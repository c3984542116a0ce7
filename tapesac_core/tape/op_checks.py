"""Checking a steady-state call as it runs: every op its forward dispatches against its tape's.

Why. A steady-state call (``steady.py``) runs its forward without recording, and its backward
replays from a tape an earlier call recorded. The signature fixes the inputs' shapes, not what
the forward does with Python values read elsewhere: a scheduled scale, dropout's ``p``, an
integer read from the data, a branch on a module attribute. Replaying the old tape for a call
that computed with other numbers or other tensors would give wrong gradients silently, where
torch's checkpoint, which runs the forward again, is right.

Contract. A recorded call logs, per op its forward dispatches (``OpLog``), the op, the tape node
it made (or, for an op that made no node, such as a host read ``.item()``, its own arguments),
and where each of its tensor arguments came from (``Sources``: the logged op and output that
made it, a block input by position, a parameter or buffer by name). A steady-state call runs
under ``SteadyCheck``, a dispatch mode that compares each op with the log as it comes: the same
op, the same non-tensor arguments (by type and value: ``1`` is not ``1.0``), tensors where the
tape had tensors, made by the same ops from the same sources. Where a tape's sizes follow its
data (``data_sizes.py``) the integers in its ops' size arguments are gathered as they come and
compared at the end of forward with those of the tape at the sizes the call bound. The first
difference makes the call diverged (``steady.py``): its backward runs the forward again, as
torch's checkpoint does, and nothing of the tape reaches it; from the difference on, the mode
logs each op as ``OpLog`` does (``trail``), and that run is checked against the tape's ops
before it and the trail after (``rerun_checks.py``).

Not compared, on either side: ops outside the block's dataflow (FSDP's and the profiler's,
collectives on FSDP's buffers), ``detach``-like ops (autograd and the hooks dispatch them on
their own; their output is their input), and the numbers host reads return (what they steer,
ops or their arguments, is compared). A tensor made outside the dispatcher (``.data``,
``torch.from_numpy``) is known by the logged tensor whose storage it shares, else by identity.

Cost: one Python dispatch per op, a walk of its arguments and a weak reference per output
(``benchmarks/host_overhead.py`` measures it against torch's checkpoint).
"""

from __future__ import annotations

import math
import struct
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .._compat import DispatchModeWithoutDynamoGuard, raw_call
from ..measure.memory import not_counted
from ..tensors import Slot, flat_tensors, slot
from .grad_free import Before, reads_gradients, untouched
from .ops import op_info
from .values import refuse_layout, where

Tensor = torch.Tensor

OUTPUT_BITS = 20  # a made tensor's source: (check index << OUTPUT_BITS) | output position


class Check(NamedTuple):
    """One op a recorded forward dispatched, as a steady-state call must dispatch it again."""

    op: Any
    node: int  # the tape node it made, whose arguments are its own; -1: none (``args`` are)
    args: Any  # for ``node == -1``: its arguments, each tensor a ``Slot``
    kwargs: Any
    sources: tuple  # per tensor argument, in slot order: where it came from (``Sources.key``)
    grad_free: bool = False  # a call that does not make it may skip it (``grad_free.py``)


class OpKinds(NamedTuple):
    """Ops a forward dispatched that a check passes over, by ``id`` (ops live as long as the
    process): outside the dataflow, and ``detach``-like (their output has their input's source)."""

    passed: frozenset[int]
    same: frozenset[int]


def leaf_names(module: torch.nn.Module) -> dict[int, str]:
    """The module's parameters and buffers as they are now, by ``id``, named by path: a tensor
    under several names by its first, as the recorder names it (``ValueIds._leaf_name``)."""
    names: dict[int, str] = {}
    for named in (
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    ):
        for name, t in named:
            names.setdefault(id(t), name)
    return names


def submodule_at(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The registered submodule at dotted ``path`` (``""``: ``module``), as ``leaf_names`` walks
    them, or None: a dict lookup per part, where ``Module.get_submodule`` takes two Python
    attribute lookups through ``Module.__getattr__`` (per pack of a parameter in steady state)."""
    for part in path.split(".") if path else ():
        found = module._modules.get(part)
        if found is None:
            return None
        module = found
    return module


def _without_layout(key: Any) -> Any:
    """A source key as a pack compares it: an alias's or an external's, ``(kind, which,
    layout)``, without the layout."""
    return key[:2] if type(key) is tuple else key


class SavedLeaf(NamedTuple):
    """The source of a saved tensor that is the block module's parameter or buffer ``name``."""

    name: str


class Sources:
    """Where each tensor a block's forward touches came from, as keys equal across two calls
    that dispatched the same ops: an int for a logged op's output and for a block input (by
    position, negative), a name for a parameter or buffer, a tuple for anything else."""

    def __init__(self, inputs: Sequence[Tensor], module: torch.nn.Module) -> None:
        # id -> (weak reference, key, data address): the reference tells a live tensor from a
        # freed one whose id Python gave to another, without keeping an intermediate alive;
        # the address, a tensor whose storage ``t.data = other`` swapped (no op dispatched).
        self.made_by_id: dict[int, tuple[weakref.ref[Tensor], Any, int]] = {}
        self._module = module
        self._leaves: dict[int, str] | None = None  # read at the first tensor not seen
        self._ptrs: dict[int, int] | None = None  # the leaves' storages, read at an alias
        self._externals: dict[int, int] = {}  # an external storage -> its order of first use
        self._next_order = 0
        # By external storage's order and layout, the first tensor read there, with its version
        # and ``where`` then: the one a run of the forward again must read (``rerun_checks.py``;
        # a key tells only its layout).
        self.outside: dict[tuple[int, tuple], tuple[weakref.ref[Tensor], int, tuple]] = {}
        # Each parameter and buffer as the forward first read it, by name: one the forward
        # replaces on its module later (``self.scale = self.scale * 0.5``) is this one for
        # backward (``Block.note_leaves``).
        self.read: dict[str, Tensor] = {}
        for i, t in enumerate(inputs):
            self.made_by_id[id(t)] = (weakref.ref(t), -1 - i, t.data_ptr())

    def key(self, t: Tensor) -> Any:
        key = self.made_key(t)
        return self._unseen(t) if key is None else key

    def made_key(self, t: Tensor) -> Any:
        """``t``'s source where a logged call or op of this forward made it, or it is an input
        or the ``detach`` of one; else None (a parameter, or made by the call running now): at
        a pack, the same in every call that ran the same calls."""
        entry = self.made_by_id.get(id(t))
        if entry is not None and entry[0]() is t and entry[2] == t.data_ptr():
            return entry[1]
        return None

    def pack_key(self, t: Tensor) -> Any:
        """``made_key`` (an alias's or an external's without its layout: where sizes follow the
        data, a saved tensor's sizes are bound, not compared), or for a parameter or buffer its
        ``SavedLeaf`` (read as the forward read it: a forward may replace it on its module
        after saving it)."""
        key = _without_layout(self.made_key(t))
        if key is not None:
            return key
        name = self._leaf_read(t)
        return None if name is None else SavedLeaf(name)

    def saved_is(self, t: Tensor, key: Any) -> bool:
        """Whether autograd saves in ``t`` what it saved with ``pack_key`` ``key``: for a
        parameter or buffer by its name on the module (cheaper than ``pack_key``)."""
        if type(key) is SavedLeaf:
            return self.made_key(t) is None and self.named(t, key.name)
        return _without_layout(self.made_key(t)) == key

    def note_leaf(self, t: Tensor) -> None:
        """If ``t``, not made by the forward, is one of the module's parameters or buffers, it
        is that one as the forward read it (``read``)."""
        if self.made_key(t) is None:
            self._leaf_read(t)

    def _leaf_read(self, t: Tensor) -> str | None:
        """The name of the module's parameter or buffer ``t`` is, if it is one, noted as the
        forward read it (``read``)."""
        name = self._names().get(id(t))
        if name is not None:
            self.read.setdefault(name, t)
        return name

    def named(self, t: Tensor, name: str) -> bool:
        """Whether ``t`` is the module's parameter or buffer ``name`` now: the key of a leaf,
        without listing every leaf of the module (``_unseen``)."""
        path, _, leaf = name.rpartition(".")
        module = submodule_at(self._module, path)
        if module is None or getattr(module, leaf, None) is not t:
            return False
        self.read.setdefault(name, t)
        return True

    def made(self, out: Any, check: int) -> None:
        """``out``, the result of logged op ``check``: each tensor's source is its position."""
        made = self.made_by_id
        if type(out) is Tensor:
            made[id(out)] = (weakref.ref(out), check << OUTPUT_BITS, out.data_ptr())
            return
        base = check << OUTPUT_BITS
        for j, t in enumerate(flat_tensors(out)):
            made[id(t)] = (weakref.ref(t), base | j, t.data_ptr())

    def same(self, out: Any, source: Any) -> None:
        """``out`` (a ``detach``'s result) has ``source``'s source."""
        if type(out) is Tensor and isinstance(source, Tensor):
            self.made_by_id[id(out)] = (weakref.ref(out), self.key(source), out.data_ptr())

    def _unseen(self, t: Tensor) -> Any:
        name = self._leaf_read(t)
        if name is not None:
            return name
        refuse_layout(t, f"of type {type(self._module).__name__}")
        # Made outside the dispatcher (``.data``): known by the tensor whose storage it shares.
        layout = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            on_storage = [
                key
                for ref, key, _ in self.made_by_id.values()
                if (other := ref()) is not None and other.untyped_storage().data_ptr() == ptr
            ]
            if on_storage:
                return ("alias", min(on_storage, key=str), layout)
            for leaf_id, leaf in self._names().items():
                if self._leaf_ptrs().get(leaf_id) == ptr:
                    return ("alias", leaf, layout)
        # An external tensor (a cache's empty tensor made each call): its content reaches
        # backward only through what the call holds (``steady.py``), so its layout and which
        # storage it shares with other externals decide (holds may take one from another's).
        storages = self._externals
        if not ptr:
            return ("external", -1, layout)
        order = storages.get(ptr)
        if order is None:
            order = storages[ptr] = self._next_order
            self._next_order += 1
        if (order, layout) not in self.outside:
            self.outside[order, layout] = (weakref.ref(t), t._version, where(t))
        return ("external", order, layout)

    def seed(
        self, outside: Sequence[tuple[tuple[int, tuple], weakref.ref[Tensor], int, tuple]]
    ) -> None:
        """Key each tensor a forward read from outside the block (``outside``: order and layout,
        tensor, version, ``where``) by its storage's order there, for a run of that forward
        again, which may skip the grad-free calls that read some (``grad_free.py``) and so meet
        the others earlier."""
        for (order, _), ref, _, _ in outside:
            t = ref()
            if t is not None and (ptr := t.untyped_storage().data_ptr()):
                self._externals[ptr] = order
            self._next_order = max(self._next_order, order + 1)

    def _names(self) -> dict[int, str]:
        if self._leaves is None:
            self._leaves = leaf_names(self._module)
        return self._leaves

    def _leaf_ptrs(self) -> dict[int, int]:
        if self._ptrs is None:
            self._ptrs = {
                id(t): t.untyped_storage().data_ptr()
                for t in (*self._module.parameters(), *self._module.buffers())
            }
        return self._ptrs


class OpLog:
    """What a recorded forward dispatched, for its steady-state calls to check (see the module).
    The recorder tells it each op after it ran."""

    def __init__(self, inputs: Sequence[Tensor], module: torch.nn.Module) -> None:
        self.sources = Sources(inputs, module)
        self.checks: list[Check] = []
        self.passed: set[int] = set()
        self.same_ops: set[int] = set()

    def op(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        out: Any,
        node: int,
        recorded: tuple,
        inert: bool,
    ) -> None:
        """``func`` ran and made tape node ``node`` (-1: none); ``recorded``: its arguments and
        keyword arguments as the recorder templated them (``ValueIds.arguments``); ``inert``:
        it neither draws random numbers nor writes in place."""
        e_args, e_kwargs = recorded
        sources = _sources(args, kwargs, e_args, e_kwargs, self.sources)
        free = inert and not reads_gradients(args, kwargs) and untouched(args, kwargs, out)
        if node >= 0:
            check = Check(func, node, None, None, sources, free)
        else:
            check = Check(func, -1, e_args, e_kwargs, sources, free)
        self.sources.made(out, len(self.checks))
        self.checks.append(check)

    def pass_over(self, func: Any) -> None:
        """``func`` ran outside the block's dataflow (it made no node)."""
        self.passed.add(id(func))

    def same(self, func: Any, out: Any, source: Any) -> None:
        """``func`` returned ``source`` again (``detach``)."""
        self.same_ops.add(id(func))
        self.sources.same(out, source)

    def kinds(self) -> OpKinds:
        return OpKinds(frozenset(self.passed), frozenset(self.same_ops))


def logged_check(func: Any, args: tuple, kwargs: dict, sources: Sources) -> Check:
    """``func`` on ``args`` and ``kwargs`` as a check compares a later call of it: its
    arguments with each tensor a ``Slot``, and where each tensor came from."""
    e_args, e_kwargs = _slotted(args), {k: _slotted(v) for k, v in kwargs.items()}
    return Check(func, -1, e_args, e_kwargs, _sources(args, kwargs, e_args, e_kwargs, sources))


def _sources(args: tuple, kwargs: dict, e_args: Any, e_kwargs: Any, sources: Sources) -> tuple:
    """Where each tensor argument came from, in slot order, as a steady-state call's
    comparison walks them (``_Compare``)."""
    compare = _Compare(None)
    compare.all_same(args, kwargs, e_args, e_kwargs)
    key = sources.key
    return tuple(key(t) for t in compare.tensors)


def _slotted(x: Any) -> Any:
    if isinstance(x, Tensor):
        return slot(0)  # a check compares where a tensor came from, not its position
    if type(x) is list or type(x) is tuple:
        return type(x)(_slotted(y) for y in x)
    return x


_NONE: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())


_MISSING = object()


def _same_const(a: Any, e: Any) -> bool:
    """``same_number`` for the fast path's arguments (no floats inside its lists)."""
    kind = type(a)
    if kind is not type(e):
        return False
    if kind is float:
        return _bits(a) == _bits(e)
    return kind is not complex and bool(a == e)  # complex: the walk tells


class FastCheck(NamedTuple):
    """One check where every tensor argument is a top-level one (most ops), as a steady-state
    call compares it without walking the arguments: the positions of the tensors, with their
    sources; the tape's value of every other argument but the size arguments where sizes follow
    the data, which are gathered (``sized``, ``sized_kwargs``)."""

    tensors: tuple[tuple[int, Any], ...]  # (position, source)
    consts: tuple[tuple[int, Any], ...]  # (position, value)
    arity: int  # positional arguments
    kwargs: tuple[tuple[str, Any], ...]
    sized: tuple[int, ...] = ()
    sized_kwargs: tuple[str, ...] = ()


SizeArguments = Callable[[Any], tuple[frozenset[int], frozenset[str]]]


def fast_checks(
    checks: Sequence[Check], nodes: Sequence[Any], size_arguments: SizeArguments | None = None
) -> list[FastCheck | None]:
    """Per check, its ``FastCheck`` (None where a tensor sits in a list or a keyword, or a list
    of floats is compared); ``size_arguments``: where sizes follow the data, an op's size
    arguments (``size_templates.size_arguments``)."""
    made: list[FastCheck | None] = []
    for check in checks:
        if check.node >= 0:
            args, kwargs = nodes[check.node].args, nodes[check.node].kwargs
        else:
            args, kwargs = check.args, check.kwargs
        positions, names = _NONE
        if size_arguments is not None and check.node >= 0:
            positions, names = size_arguments(check.op)
        consts = [(i, a) for i, a in enumerate(args) if type(a) is not Slot and i not in positions]
        own_kwargs = [(k, v) for k, v in kwargs.items() if k not in names]
        # Lists compare by ``==``, which holds -0.0 for 0.0: lists of floats take the walk.
        walked = any(_has_slot(a) or _has_float(a) for _, a in consts)
        if walked or any(_has_slot(v) or _has_float(v) for _, v in own_kwargs):
            made.append(None)
            continue
        slots = [i for i, a in enumerate(args) if type(a) is Slot]
        made.append(
            FastCheck(
                tensors=tuple(zip(slots, check.sources)),
                consts=tuple(consts),
                arity=len(args),
                kwargs=tuple(own_kwargs),
                sized=tuple(i for i in range(len(args)) if i in positions),
                sized_kwargs=tuple(k for k in kwargs if k in names),
            )
        )
    return made


def _has_float(x: Any) -> bool:
    """A list or tuple with a float or complex number anywhere in it."""
    return (type(x) is list or type(x) is tuple) and any(
        type(y) is float or type(y) is complex or _has_float(y) for y in x
    )


def _has_slot(x: Any) -> bool:
    if type(x) is Slot:
        return True
    return (type(x) is list or type(x) is tuple) and any(_has_slot(y) for y in x)


def same_number(a: Any, e: Any) -> bool:
    """Equal, and of one type: ``1`` is not ``1.0``; floats (and complex numbers' parts) bit for
    bit, so ``-0.0`` is not ``0.0`` nor ``-nan`` ``nan`` (``copysign`` tells them apart)."""
    if type(a) is not type(e):
        return False
    if type(a) is float:
        return _bits(a) == _bits(e)
    if type(a) is complex:
        return _bits(a.real) == _bits(e.real) and _bits(a.imag) == _bits(e.imag)
    return bool(a == e)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class _Compare:
    """One op's arguments against its tape's: tensors in slot order into ``tensors``, size
    arguments (where gathered) into ``sizes``; False at the first difference."""

    __slots__ = ("sized", "sizes", "tensors", "theirs")

    def __init__(
        self,
        sizes: list[Any] | None,
        sized: tuple[frozenset[int], frozenset[str]] = _NONE,
        theirs: str = "the tape",
    ) -> None:
        self.tensors: list[Tensor] = []
        self.sizes, self.sized, self.theirs = sizes, sized, theirs

    def all_same(self, args: tuple, kwargs: dict, e_args: Any, e_kwargs: Any) -> str | None:
        """How the call's arguments differ from the tape's, if they do."""
        positions, names = self.sized
        for i, (a, e) in enumerate(zip(args, e_args)):
            if not (self.sized_same(a, e) if i in positions else self.same(a, e)):
                return difference(str(i), a, e, self.theirs, _Compare(None).same)
        for name, e in e_kwargs.items():
            a = kwargs[name]
            if not (self.sized_same(a, e) if name in names else self.same(a, e)):
                return difference(name, a, e, self.theirs, _Compare(None).same)
        return None

    def same(self, a: Any, e: Any) -> bool:
        te = type(e)
        if te is Slot:
            if isinstance(a, Tensor):
                self.tensors.append(a)
                return True
            return False
        if te is list or te is tuple:
            if type(a) is not te or len(a) != len(e):
                return False
            same = self.same
            return all(same(x, y) for x, y in zip(a, e))
        return same_number(a, e)

    def sized_same(self, a: Any, e: Any) -> bool:
        """A size argument where sizes follow the data: gathered as it is, compared at the end
        of forward with the tape's at the call's sizes (``size_templates.argument_sizes``)."""
        self.sizes.append(a)  # type: ignore[union-attr]
        return True


class Checking:
    """What both checking modes (this module's, ``call_checks.CallCheck``) share: on a
    departure, around a hook, and before a random op. ``diverged`` says how the call first
    departed from its tape, if it did; while ``off``, nothing is compared; ``states`` holds the
    generator state each random op of ``nodes`` drew from."""

    diverged: str | None
    off: bool
    paused = False  # by a hook (``pause``)
    theirs = "the tape"  # what the call is checked against, as its messages name it
    nodes: Sequence[Any]
    states: dict[int, Tensor]
    sources: Sources

    def read_state(self, node: int) -> None:
        """Random op ``node`` is about to run: its generator's state, for its replay."""
        state = self.nodes[node].rng[0].get_state()
        not_counted(state)  # bookkeeping, not the step's memory (``draws_bytes`` counts it)
        self.states[node] = state

    # After a departure: how many of the tape's entries the call ran before it (``matched``),
    # and what it ran from there, logged as the tape's are (``trail``; None where an argument
    # cannot be logged). Its backward's run of the forward is checked against both
    # (``rerun_checks.py``).
    matched: int | None = None
    trail: list[Any] | None = None

    def diverge(self, why: str, at: int) -> None:
        """The call departed from its tape at entry ``at``: said once, and nothing more is
        compared; what it runs from there is logged (``trail``)."""
        self.diverged, self.off = why, True
        self.matched, self.trail = at, []

    # The tape's grad-free entries the call skipped (``grad_free.py``): the run in backward may
    # not make them (``rerun_checks.rerun_check``).
    skipped: tuple[int, ...] = ()

    def skip(self, first: int, end: int) -> None:
        """The call skipped the tape's grad-free entries ``first`` to ``end`` (not included)."""
        self.skipped = (*self.skipped, *range(first, end))

    def packed(self, t: Tensor) -> None:
        """After a departure, autograd saves ``t``: the run in backward may not skip the entry
        of the trail that made it (``grad_free.py``)."""
        trail, matched = self.trail, self.matched
        if trail is None or matched is None:
            return
        key = self.sources.made_key(t)
        if type(key) is int and key >= 0:
            i = (key >> OUTPUT_BITS) - matched
            if 0 <= i < len(trail) and trail[i].grad_free:
                trail[i] = trail[i]._replace(grad_free=False)

    hooked = 0  # how many times a hook paused the check (``pause``): packs, submodule exits

    def pause(self) -> None:
        """What a hook dispatches to hold what it saw is not the forward's."""
        self.off = self.paused = True
        self.hooked += 1

    def resume(self) -> None:
        self.off, self.paused = self.diverged is not None, False

    def unchecked(self, args: tuple, kwargs: dict) -> None:
        """An op or call that passes unchecked: after a divergence (not in a hook), the
        parameters and buffers it reads, which the backward's run of the forward takes as the
        forward read them (``recompute.forward_leaves``)."""
        if self.diverged is not None and not self.paused:
            for t in flat_tensors((args, kwargs)):
                self.sources.note_leaf(t)


class SteadyCheck(DispatchModeWithoutDynamoGuard, Checking):
    """The dispatch mode of one steady-state call: each op against the tape's log (see the
    module). ``diverged`` says how the call first departed from it, if it did."""

    def __init__(
        self,
        checks: Sequence[Check],
        kinds: OpKinds,
        nodes: Sequence[Any],
        fast: Sequence[FastCheck | None],
        drawing: Mapping[int, int],
        inputs: Sequence[Tensor],
        module: torch.nn.Module,
        size_arguments: SizeArguments | None = None,
    ) -> None:
        super().__init__()
        self.checks, self.kinds, self.nodes = checks, kinds, nodes
        self.fast = fast
        self.sources = Sources(inputs, module)
        self.made_by_id = self.sources.made_by_id
        # Random ops (check index -> node): the state each draws from, read just before it.
        self.drawing = drawing
        self.states: dict[int, Tensor] = {}  # node index -> its generator's state before it
        self.count = 0
        self.diverged: str | None = None
        self.off = False  # diverged, or paused by the pack hook: ops pass unchecked
        # Where sizes follow the data: the ops' size arguments, gathered (``sizes``).
        self.size_arguments = size_arguments
        self.sizes: list[Any] = []
        # Where the call may go on against another template at an op that departs from this
        # one's (``structure_switch.py``): whether it does, having called ``follow``.
        self.switch: Callable[[int], bool] | None = None

    def follow(
        self,
        c: int,
        checks: Sequence[Check],
        kinds: OpKinds,
        nodes: Sequence[Any],
        fast: Sequence[FastCheck | None],
        drawing: Mapping[int, int],
    ) -> None:
        """Check op ``c`` on against another tape's log, which agrees with this one before it."""
        self.count = c
        self.checks, self.kinds, self.nodes, self.fast = checks, kinds, nodes, fast
        self.drawing = drawing

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        # Runs per op: the expected op first, with as few lookups as it takes.
        if kwargs is None:
            kwargs = {}
        if self.off:
            return func(*args, **kwargs) if self.paused else self._logged(func, args, kwargs)
        c = self.count
        checks = self.checks
        if c < len(checks) and checks[c].op is func:
            self.count = c + 1
            fast = self.fast[c]
            if fast is None or not self._same_fast(fast, args, kwargs):
                gathered = len(self.sizes)
                why = self._differs(checks[c], args, kwargs)
                if why is not None:
                    del self.sizes[gathered:]
                    if self.switch is not None and self.switch(c):
                        return self.__torch_dispatch__(func, types, args, kwargs)
                    return self._unmatched(c, f"op {c} ({func}): {why}", func, args, kwargs)
            # ``_matched``, inlined: runs per op.
            if c in self.drawing:
                self.read_state(self.drawing[c])
            out = raw_call(func)(*args, **kwargs)  # a Python frame per op spared
            if type(out) is Tensor:
                self.made_by_id[id(out)] = (weakref.ref(out), c << OUTPUT_BITS, out.data_ptr())
            else:
                self.sources.made(out, c)
            return out
        key = id(func)
        if key in self.kinds.passed:
            return func(*args, **kwargs)
        if key in self.kinds.same:
            out = func(*args, **kwargs)
            self.sources.same(out, args[0] if args else None)
            return out
        return self._unexpected(func, types, args, kwargs)

    unit = "ops"

    @property
    def complete(self) -> bool:
        """Every logged op ran, but grad-free ones it may skip."""
        return all(self._skippable(check) for check in self.checks[self.count :])

    def _same_fast(self, fast: FastCheck, args: tuple, kwargs: dict) -> bool:
        """Whether the op's arguments are the tape's (False: ``_differs`` says how, if at all)."""
        if len(args) != fast.arity:
            return False
        made = self.made_by_id
        for i, source in fast.tensors:
            t = args[i]
            entry = made.get(id(t))
            if entry is not None and entry[0]() is t and entry[2] == t.data_ptr():  # type: ignore[union-attr]  # narrowed by `is`
                if entry[1] != source:
                    return False
            elif not isinstance(t, Tensor) or self.sources.key(t) != source:
                return False
        for i, e in fast.consts:
            a = args[i]
            if a is not e and not _same_const(a, e):
                return False
        if len(kwargs) != len(fast.kwargs) + len(fast.sized_kwargs):
            return False
        for name, e in fast.kwargs:
            a = kwargs.get(name, _MISSING)
            if a is not e and not _same_const(a, e):
                return False
        if fast.sized:
            self.sizes.extend(args[i] for i in fast.sized)
        if fast.sized_kwargs:
            self.sizes.extend(kwargs.get(name, _MISSING) for name in fast.sized_kwargs)
        return True

    def _unexpected(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """An op the log does not have here: one of the kinds passed over that the recorded
        call did not dispatch (a profiler's), or a departure."""
        info = op_info(func)
        departs = not (info.identity or info.unrecorded or info.collective)
        c = self.count
        if departs and self.switch is not None and self.switch(c):
            return self.__torch_dispatch__(func, types, args, kwargs)
        if departs:
            expected = str(self.checks[c].op) if c < len(self.checks) else "no more ops"
            return self._unmatched(
                c, f"op {c} is {func}, {self.theirs} has {expected}", func, args, kwargs
            )
        out = func(*args, **kwargs)
        if info.identity:
            self.sources.same(out, args[0] if args else None)
        return out

    def _unmatched(self, c: int, why: str, func: Any, args: tuple, kwargs: dict) -> Any:
        """Op ``c`` is not the log's (``why``): it is a later one, past grad-free ops of the log
        the forward did not dispatch (``grad_free.py``), else the call departs."""
        checks, k = self.checks, c
        while k < len(checks) and self._skippable(checks[k]):
            k += 1
            if k < len(checks) and checks[k].op is func:
                gathered = len(self.sizes)
                if self._differs(checks[k], args, kwargs) is None:
                    self.count = k + 1
                    self.skip(c, k)
                    return self._matched(k, func, args, kwargs)
                del self.sizes[gathered:]
        self.diverge(why, c)
        return self._logged(func, args, kwargs)

    def _skippable(self, check: Check) -> bool:
        """A grad-free entry the call may not make: where sizes follow the data, only one with
        no size arguments (the call's gathered sizes are compared with the tape's in order)."""
        if not check.grad_free:
            return False
        sized = self.size_arguments
        return sized is None or check.node < 0 or sized(check.op) == _NONE

    def _matched(self, c: int, func: Any, args: tuple, kwargs: dict) -> Any:
        """Op ``c`` is the log's: run, its outputs of source ``c``."""
        if c in self.drawing:
            self.read_state(self.drawing[c])
        out = raw_call(func)(*args, **kwargs)
        self.sources.made(out, c)
        return out

    def _logged(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op after the call departed (its first, the departing op): run, and logged as a
        recorded call logs it, with whether it was grad-free (``grad_free.py``), for the check
        of the backward's run of the forward (``trail``); ops any check lets pass wherever they
        come (``_unexpected``: identity, unrecorded and collective ops) are not."""
        info = op_info(func)
        if info.unrecorded or info.collective:
            return func(*args, **kwargs)
        if info.identity or id(func) in self.kinds.same:
            out = func(*args, **kwargs)
            self.sources.same(out, args[0] if args else None)
            return out
        self.unchecked(args, kwargs)
        trail = self.trail
        assert trail is not None and self.matched is not None, "logged after a departure"
        check = logged_check(func, args, kwargs, self.sources)
        inert = not (info.mutated or info.random or reads_gradients(args, kwargs))
        before = Before.of(args, kwargs) if inert else None
        hooked = self.hooked
        out = raw_call(func)(*args, **kwargs)
        if before is not None and before.grad_free(out) and self.hooked == hooked:
            check = check._replace(grad_free=True)
        trail.append(check)
        self.sources.made(out, self.matched + len(trail) - 1)
        return out

    def _differs(self, check: Check, args: tuple, kwargs: dict) -> str | None:
        if check.node >= 0:
            node = self.nodes[check.node]
            e_args, e_kwargs = node.args, node.kwargs
        else:
            e_args, e_kwargs = check.args, check.kwargs
        if len(args) != len(e_args) or kwargs.keys() != e_kwargs.keys():
            return f"other arguments than {self.theirs}'s"
        sized = _NONE
        if self.size_arguments is not None and check.node >= 0:
            sized = self.size_arguments(check.op)
        compare = _Compare(self.sizes, sized, self.theirs)
        why = compare.all_same(args, kwargs, e_args, e_kwargs)
        if why is not None:
            return why
        key = self.sources.key
        got = tuple(key(t) for t in compare.tensors)
        if got != check.sources:
            a, e = next(((a, e) for a, e in zip(got, check.sources) if a != e), (None, None))
            return f"a tensor argument {other_source(a, e, 'ops', self.theirs)}"
        return None


def other_source(got: Any, expected: Any, unit: str, theirs: str) -> str:
    """How a tensor argument of source ``got`` is not one of source ``expected``."""
    if _external(got) and _external(expected):
        return (
            f"read from outside the block, another than {theirs}'s (one replaced between "
            "forward and backward, or made anew each call, as torch.from_numpy makes)"
        )
    return f"made by other {unit} than {theirs}'s"


def _external(key: Any) -> bool:
    return type(key) is tuple and len(key) == 3 and key[0] == "external"


def difference(where: str, a: Any, e: Any, theirs: str, same: Callable[[Any, Any], bool]) -> str:
    """Argument ``where`` is ``a``, ``theirs`` ``e``: in words, at the first element that differs
    by ``same`` where both are lists or tuples of one length (a long list's difference may lie
    past what a message shows of it)."""
    while type(e) in (list, tuple) and type(a) is type(e) and len(a) == len(e):
        i = next((i for i, (x, y) in enumerate(zip(a, e)) if not same(x, y)), None)
        if i is None:
            break
        where, a, e = f"{where}[{i}]", a[i], e[i]
    return f"argument {where} is {shown(a)}, {theirs}'s {shown(e)}"


def shown(x: Any) -> str:
    if type(x) is float and x != x and math.copysign(1.0, x) < 0:
        return "-nan"  # repr says "nan"
    if isinstance(x, Tensor):
        return f"a {tuple(x.shape)} tensor"
    if type(x) is Slot:
        return "a tensor"
    if isinstance(x, torch.UntypedStorage | torch.TypedStorage):
        return f"a storage of {x.nbytes()} bytes"
    text = repr(x)  # an argument of any type: a message line, not its whole repr
    return text if len(text) <= 80 else text[:77] + "..."
