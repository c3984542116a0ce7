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
torch's checkpoint does, and nothing of the tape reaches it.

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
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._compat import DispatchModeWithoutDynamoGuard
from ..tensors import Slot, flat_tensors
from .ops import op_info

Tensor = torch.Tensor

_OUTPUT_BITS = 20  # a made tensor's source: (check index << _OUTPUT_BITS) | output position


class Check(NamedTuple):
    """One op a recorded forward dispatched, as a steady-state call must dispatch it again."""

    op: Any
    node: int  # the tape node it made, whose arguments are its own; -1: none (``args`` are)
    args: Any  # for ``node == -1``: its arguments, each tensor a ``Slot``
    kwargs: Any
    sources: tuple  # per tensor argument, in slot order: where it came from (``Sources.key``)


class OpKinds(NamedTuple):
    """Ops a forward dispatched that a check passes over, by ``id`` (ops live as long as the
    process): outside the dataflow, and ``detach``-like (their output has their input's source)."""

    passed: frozenset[int]
    same: frozenset[int]


def leaf_names(module: torch.nn.Module) -> dict[int, str]:
    """The module's parameters and buffers as they are now, by ``id``, named by path."""
    names = {id(t): name for name, t in module.named_buffers(remove_duplicate=False)}
    names.update((id(t), name) for name, t in module.named_parameters(remove_duplicate=False))
    return names


class Sources:
    """Where each tensor a block's forward touches came from, as keys equal across two calls
    that dispatched the same ops: an int for a logged op's output and for a block input (by
    position, negative), a name for a parameter or buffer, a tuple for anything else."""

    def __init__(self, inputs: Sequence[Tensor], module: torch.nn.Module) -> None:
        # id -> (weak reference, key): the reference tells a live tensor from a freed one whose
        # id Python gave to another, without keeping an intermediate alive.
        self._made: dict[int, tuple[weakref.ref[Tensor], Any]] = {}
        self._module = module
        self._leaves: dict[int, str] | None = None  # read at the first tensor not seen
        self._ptrs: dict[int, int] | None = None  # the leaves' storages, read at an alias
        for i, t in enumerate(inputs):
            self._made[id(t)] = (weakref.ref(t), -1 - i)

    def key(self, t: Tensor) -> Any:
        entry = self._made.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return self._unseen(t)

    def made(self, out: Any, check: int) -> None:
        """``out``, the result of logged op ``check``: each tensor's source is its position."""
        made = self._made
        if type(out) is Tensor:
            made[id(out)] = (weakref.ref(out), check << _OUTPUT_BITS)
            return
        base = check << _OUTPUT_BITS
        for j, t in enumerate(flat_tensors(out)):
            made[id(t)] = (weakref.ref(t), base | j)

    def same(self, out: Any, source: Any) -> None:
        """``out`` (a ``detach``'s result) has ``source``'s source."""
        if type(out) is Tensor and isinstance(source, Tensor):
            self._made[id(out)] = (weakref.ref(out), self.key(source))

    def _unseen(self, t: Tensor) -> Any:
        if self._leaves is None:
            self._leaves = leaf_names(self._module)
        name = self._leaves.get(id(t))
        if name is not None:
            return name
        # Made outside the dispatcher (``.data``): known by the tensor whose storage it shares.
        layout = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            on_storage = [
                key
                for ref, key in self._made.values()
                if (other := ref()) is not None and other.untyped_storage().data_ptr() == ptr
            ]
            if on_storage:
                return ("alias", min(on_storage, key=str), layout)
            for leaf_id, leaf in self._leaves.items():
                if self._leaf_ptrs().get(leaf_id) == ptr:
                    return ("alias", leaf, layout)
        # An external tensor (a cache's empty tensor made each call): its content reaches
        # backward only through what the call holds (``steady.py``), so its layout decides.
        return ("external", layout)

    def _leaf_ptrs(self) -> dict[int, int]:
        if self._ptrs is None:
            self._ptrs = {
                id(t): t.untyped_storage().data_ptr()
                for t in (*self._module.parameters(), *self._module.buffers())
            }
        return self._ptrs


def _templated(x: Any, counter: list[int]) -> Any:
    """``x`` with each tensor replaced by the slot of its position (host reads' arguments)."""
    if isinstance(x, Tensor):
        counter[0] += 1
        return Slot(counter[0] - 1)
    if type(x) is list or type(x) is tuple:
        if any(isinstance(y, Tensor) for y in x):
            return type(x)(_templated(y, counter) for y in x)
    return x


class OpLog:
    """What a recorded forward dispatched, for its steady-state calls to check (see the module).
    The recorder tells it each op after it ran."""

    def __init__(self, inputs: Sequence[Tensor], module: torch.nn.Module) -> None:
        self.sources = Sources(inputs, module)
        self.checks: list[Check] = []
        self.passed: set[int] = set()
        self.same_ops: set[int] = set()

    def op(
        self, func: Any, args: tuple, kwargs: dict, out: Any, node: int, nodes: Sequence[Any]
    ) -> None:
        """``func`` ran and made tape node ``node`` of ``nodes`` (-1: none)."""
        if node >= 0:
            e_args, e_kwargs = nodes[node].args, nodes[node].kwargs
        else:
            counter = [0]
            e_args = tuple(_templated(a, counter) for a in args)
            e_kwargs = {k: _templated(v, counter) for k, v in kwargs.items()}
        # The tensors in slot order, as a steady-state call's comparison walks them.
        compare = _Compare(None)
        compare.all_same(args, kwargs, e_args, e_kwargs)
        key = self.sources.key
        sources = tuple(key(t) for t in compare.tensors)
        if node >= 0:
            check = Check(func, node, None, None, sources)
        else:
            check = Check(func, -1, e_args, e_kwargs, sources)
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


_NONE: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())


def _same_number(a: Any, e: Any) -> bool:
    return type(a) is type(e) and (a == e or (type(a) is float and math.isnan(a) and e != e))


class _Compare:
    """One op's arguments against its tape's: tensors in slot order into ``tensors``, size
    integers (where gathered) into ``sizes``; False at the first difference."""

    __slots__ = ("sized", "sizes", "tensors")

    def __init__(
        self, sizes: list[int] | None, sized: tuple[frozenset[int], frozenset[str]] = _NONE
    ) -> None:
        self.tensors: list[Tensor] = []
        self.sizes, self.sized = sizes, sized

    def all_same(self, args: tuple, kwargs: dict, e_args: Any, e_kwargs: Any) -> str | None:
        """How the call's arguments differ from the tape's, if they do."""
        positions, names = self.sized
        for i, (a, e) in enumerate(zip(args, e_args)):
            if not (self.sized_same(a, e) if i in positions else self.same(a, e)):
                return f"argument {i} is {_shown(a)}, the tape's {_shown(e)}"
        for name, e in e_kwargs.items():
            a = kwargs[name]
            if not (self.sized_same(a, e) if name in names else self.same(a, e)):
                return f"argument {name} is {_shown(a)}, the tape's {_shown(e)}"
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
        return _same_number(a, e)

    def sized_same(self, a: Any, e: Any) -> bool:
        """An integer argument that may follow the data: its integers are gathered, the rest
        compared (``None`` for an optional size, a list's length)."""
        if type(e) is int:
            if type(a) is not int:
                return False
            self.sizes.append(a)  # type: ignore[union-attr]
            return True
        if type(e) is list or type(e) is tuple:
            if type(a) is not type(e) or len(a) != len(e):
                return False
            return all(self.sized_same(x, y) for x, y in zip(a, e))
        return _same_number(a, e)


class SteadyCheck(DispatchModeWithoutDynamoGuard):
    """The dispatch mode of one steady-state call: each op against the tape's log (see the
    module). ``diverged`` says how the call first departed from it, if it did."""

    def __init__(
        self,
        checks: Sequence[Check],
        kinds: OpKinds,
        nodes: Sequence[Any],
        inputs: Sequence[Tensor],
        module: torch.nn.Module,
        size_arguments: Callable[[Any], tuple[frozenset[int], frozenset[str]]] | None = None,
    ) -> None:
        super().__init__()
        self.checks, self.kinds, self.nodes = checks, kinds, nodes
        self.sources = Sources(inputs, module)
        self.count = 0
        self.diverged: str | None = None
        self.paused = False  # the pack hook holding what it saw: its ops are not the forward's
        # Where sizes follow the data: the op's integer arguments, gathered (``sizes``).
        self.size_arguments = size_arguments
        self.sizes: list[int] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.paused or self.diverged is not None:
            return func(*args, **kwargs)
        key = id(func)
        if key in self.kinds.passed:
            return func(*args, **kwargs)
        if key in self.kinds.same:
            out = func(*args, **kwargs)
            self.sources.same(out, args[0] if args else None)
            return out
        c = self.count
        check = self.checks[c] if c < len(self.checks) else None
        if check is None or check.op is not func:
            return self._unexpected(func, args, kwargs, check)
        self.count = c + 1
        why = self._differs(check, args, kwargs)
        if why is not None:
            self.diverged = f"op {c} ({func}): {why}"
        out = func(*args, **kwargs)
        self.sources.made(out, c)
        return out

    def _unexpected(self, func: Any, args: tuple, kwargs: dict, check: Check | None) -> Any:
        """An op the log does not have here: one of the kinds passed over that the recorded
        call did not dispatch (a profiler's), or a departure."""
        out = func(*args, **kwargs)
        info = op_info(func)
        if info.identity:
            self.sources.same(out, args[0] if args else None)
        elif not (info.unrecorded or info.collective):
            expected = "no more ops" if check is None else str(check.op)
            self.diverged = f"op {self.count} is {func}, the tape has {expected}"
        return out

    def _differs(self, check: Check, args: tuple, kwargs: dict) -> str | None:
        if check.node >= 0:
            node = self.nodes[check.node]
            e_args, e_kwargs = node.args, node.kwargs
        else:
            e_args, e_kwargs = check.args, check.kwargs
        if len(args) != len(e_args) or kwargs.keys() != e_kwargs.keys():
            return "other arguments than the tape's"
        sized = _NONE
        if self.size_arguments is not None and check.node >= 0:
            sized = self.size_arguments(check.op)
        compare = _Compare(self.sizes, sized)
        why = compare.all_same(args, kwargs, e_args, e_kwargs)
        if why is not None:
            return why
        key = self.sources.key
        got = tuple(key(t) for t in compare.tensors)
        if got != check.sources:
            return "a tensor argument made by other ops than the tape's"
        return None


def _shown(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {tuple(x.shape)} tensor"
    if type(x) is Slot:
        return "a tensor"
    return repr(x)
