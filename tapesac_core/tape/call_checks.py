"""Checking a steady-state call at the torch-function level: the cheaper of the two checks.

Why. ``op_checks.SteadyCheck`` compares every aten op a steady-state call dispatches with its
tape's, through a Python dispatch mode: about 9 µs an op on CPU, more than the rest of a steady
call's host work. A torch-function mode sees the calls a forward makes (``F.linear``,
``Tensor.mul``, ``Tensor.shape``) before they reach the dispatcher, for about 2 µs each, and a
forward makes about as many of them as ops.

Contract. A recorded call logs each torch function its forward calls (``CallLog``): the function,
its arguments with every tensor replaced by where it came from (``op_checks.Sources``: the call
and output that made it, a block input, a parameter or buffer by name and layout), the global
state its dispatch reads where a function has such state (``_STATE``: the attention backends
``sdpa_kernel`` allows), and the tape's ops it dispatched. A steady-state call of a tape whose
log is ``eligible`` runs under ``CallCheck``, which compares each call as it comes: the same
function, arguments of the same types and values (floats bit for bit), tensors from the same
sources (a parameter or buffer with its recorded shape, strides, dtype, device and grad flag),
the same global state. Calls equal so dispatch equal ops when nothing else steers their
dispatch, which eligibility makes sure of, per recorded call:

* every op the tape logged was dispatched inside a logged call (none from outside one, such as
  code under ``torch._C.DisableTorchFunction``), and no op was passed over (a profiler's);
* no sizes that follow the data (those tapes bind sizes per op: ``data_sizes.py``), and no size
  template (its ops' sizes are not the recorded call's);
* at every call, no other torch-function mode on the stack (a user's, or ``torch.device``'s:
  below this one, they rewrite calls after it compared them), autocast off (it inserts casts
  below this level) and the default dtype unchanged (it decides what factory functions make);
  a steady-state call is checked for all three at each call too;
* at most one random op inside each call: its generator state is read just before the call;
* every argument of a type compared by value (numbers, strings, dtypes, devices, slices, tuples
  and lists of them up to ``_LONGEST`` long, tensors).

Calls that dispatch nothing and make no tensor (a property's getter, ``size()``,
``register_hook``) are neither logged nor compared, and ``detach`` and ``.data`` give their
result their argument's source: a user's tools (module trackers, monitoring hooks) make such
calls on some steps only. A logged call that leaves the gradients alone (a hook's
``out.detach().abs().mean()``) may be skipped by a call that does not make it
(``grad_free.py``). A tape whose log is not eligible is checked op by op
(``op_checks.py``). The first difference makes the call diverged, as there: its backward runs
the forward again, checked against the log's calls before the difference and those the call
made after it (``trail``, ``rerun_checks.py``).

Not seen, on either level: ops run under ``torch._C.DisableTorchFunction`` by code that did not
run so when the call was recorded (the ops a recorded call ran so make its log not eligible),
and other global state a forward changes that decides which ops a call dispatches (a backend
flag); a change of the kernels backward needs still shows in the saved tensors and the autograd
nodes, which are checked at both levels.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from types import GetSetDescriptorType, MethodWrapperType
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from .._compat import any_autocast_enabled, torch_function_modes
from .grad_free import Before, inert_call, untouched
from .op_checks import (
    OUTPUT_BITS,
    Check,
    Checking,
    Sources,
    difference,
    other_source,
    same_number,
    shown,
)

Tensor = torch.Tensor

# Argument types compared by value (``==`` on one type); numbers are compared by ``same_number``.
_BY_VALUE = (
    type(None),
    bool,
    int,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    type(Ellipsis),
)
_NUMBERS = (float, complex)
_SEQUENCES = (tuple, list, torch.Size)


class From(NamedTuple):
    """A tensor in a logged call's arguments: where it came from (``Sources.key``)."""

    key: Any

    def __repr__(self) -> str:  # as a divergence message shows the tape's argument
        return "a tensor"


class Leaf(NamedTuple):
    """The source of a parameter or buffer in a call log: its name and its layout (what a call
    such as ``buffer.to(dtype)`` or ``buffer.contiguous()`` dispatches depends on it)."""

    name: str
    layout: tuple


class Call(NamedTuple):
    """One torch function a recorded forward called."""

    func: Any
    args: tuple  # its arguments, each tensor a ``From``
    kwargs: tuple[tuple[str, Any], ...]
    ops: tuple[int, int]  # the tape's checks it dispatched: [first, end)
    state: Any = None  # the global state its dispatch depends on (``_STATE``), where it does
    grad_free: bool = False  # a call that does not make it may skip it (``grad_free.py``)


class CallLog(TorchFunctionMode):
    """The torch functions a recorded forward calls, for its steady-state calls to check at that
    level (see the module); ``ops`` is the op log the recorder keeps, whose length tells which
    ops each call dispatched."""

    def __init__(self, inputs: Sequence[Tensor], module: torch.nn.Module, ops: Any) -> None:
        super().__init__()
        self.sources = Sources(inputs, module)
        self._source = functools.partial(_source, self.sources)
        self.calls: list[Call] = []
        self.ops = ops
        self.why_not: str | None = None  # why the log cannot check a steady-state call
        self.default_dtype = torch.get_default_dtype()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.why_not is not None:
            return func(*args, **kwargs)
        hidden = _hidden_state(self.default_dtype)
        if hidden is not None:
            self.why_not = f"{hidden} at {_name(func)}"
            return func(*args, **kwargs)
        if func in _SAME_SOURCE:
            out = func(*args, **kwargs)
            self.sources.same(out, args[0])
            return out
        try:
            t_args, t_kwargs = _arguments(args, kwargs, self._source)
        except _NotByValue as e:
            self.why_not = f"{_name(func)} takes {e}"
            return func(*args, **kwargs)
        state = _STATE.get(func)
        checks = self.ops.checks
        first = len(checks)
        out = func(*args, **kwargs)
        end = len(checks)
        if end == first and _metadata_read(func, out):
            return out
        if any(checks[i].node < 0 for i in range(first, end)):
            # A host read (``.item()``): the tape's sizes may follow its data, which its calls
            # cannot bind; said now, so that the rest of a recorded call is not logged for nothing.
            self.why_not = f"{_name(func)} reads its tensor on the host"
            return out
        index = len(self.calls)
        # Grad-free as far as it and its outputs tell; ``eligible`` adds what its ops tell.
        free = inert_call(func, kwargs) and untouched(args, kwargs, out)
        self.calls.append(Call(_key(func), t_args, t_kwargs, (first, end), state and state(), free))
        if not _returned_argument(func, args, kwargs, out):
            self.sources.made(out, index)
        return out


def _arguments(
    args: tuple, kwargs: dict, source: Callable[[Tensor], Any]
) -> tuple[tuple, tuple[tuple[str, Any], ...]]:
    """A call's arguments as a check compares a later call's, each tensor by ``source``;
    raises ``_NotByValue``."""
    return _templates(args, source), tuple((k, _template(v, source)) for k, v in kwargs.items())


def _leaf_alias(made: Any, a: Any, key: Any) -> bool:
    """Whether ``a``, which ``detach`` or ``.data`` made of a parameter or buffer (its source the
    leaf's name, ``Sources.same``), is the logged ``Leaf`` ``key``: that leaf's, at its layout."""
    return type(key) is Leaf and made == key.name and leaf_layout(a) == key.layout


def _source(sources: Sources, t: Tensor) -> Any:
    """Where ``t`` came from, a parameter or buffer with its layout (``Leaf``)."""
    key = sources.key(t)
    return Leaf(key, leaf_layout(t)) if type(key) is str else key


class LoggedCalls(NamedTuple):
    """A recorded call's torch functions, as its steady-state calls check them."""

    calls: tuple[Call, ...]
    drawing: dict[int, int]  # call index -> the node of the one random op it dispatched


def eligible(
    log: CallLog,
    checks: Sequence[Check],
    nodes: Sequence[Any],
    passed: bool,
    sized: bool,
    packed: frozenset[int],
) -> LoggedCalls | str:
    """The log as steady-state calls check it, or why it cannot check them (``passed``: ops
    were passed over; ``sized``: the tape's sizes follow its data; ``packed``: the values
    autograd saved, whose makers are not grad-free)."""
    if log.why_not is not None:
        return log.why_not
    if passed:
        return "ops outside the block's dataflow were passed over"
    if sized:
        return "its sizes follow its data"
    covered, drawing, calls = 0, {}, []
    for c, call in enumerate(log.calls):
        first, end = call.ops
        if first != covered:
            return f"op {covered} ran outside any torch function"
        covered = end
        random = [
            checks[i].node
            for i in range(first, end)
            if checks[i].node >= 0 and nodes[checks[i].node].rng is not None
        ]
        if len(random) > 1:
            return f"{_name(call.func)} draws {len(random)} times"
        if random:
            drawing[c] = random[0]
        made = [nodes[checks[i].node] for i in range(first, end) if checks[i].node >= 0]
        touches = any(n.writes or not packed.isdisjoint(n.outs) for n in made)
        calls.append(call._replace(grad_free=call.grad_free and not random and not touches))
    if covered != len(checks):
        return f"op {covered} ran outside any torch function"
    return LoggedCalls(tuple(calls), drawing)


class CallCheck(TorchFunctionMode, Checking):
    """The torch-function mode of one steady-state call: each call against the log (see the
    module). ``diverged`` says how the call first departed from it, if it did."""

    def __init__(
        self,
        logged: LoggedCalls,
        nodes: Sequence[Any],
        inputs: Sequence[Tensor],
        module: torch.nn.Module,
    ) -> None:
        super().__init__()
        self.calls, self.drawing, self.nodes = logged.calls, logged.drawing, nodes
        self.sources = Sources(inputs, module)
        self._source = functools.partial(_source, self.sources)
        self.made_by_id = self.sources.made_by_id
        self.states: dict[int, Tensor] = {}  # node index -> its generator's state before it
        self.count = 0
        self.diverged: str | None = None
        self.off = False  # diverged, or paused by a hook: calls pass unchecked
        # Dispatch state below the torch-function level, as the log was recorded under (its
        # signature holds the default dtype at the block's start; autocast was off throughout).
        self.default_dtype = torch.get_default_dtype()

    unit = "calls"

    @property
    def complete(self) -> bool:
        """Every logged call ran, but grad-free ones it may skip."""
        return all(call.grad_free for call in self.calls[self.count :])

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.paused:
            return func(*args, **kwargs)
        if func in _SAME_SOURCE:
            out = func(*args, **kwargs)
            self.sources.same(out, args[0])
            return out
        ran = _NOT_RUN
        # A getter runs first (it has no side effects), ``t.data = other`` after its check.
        if (type(func) is MethodWrapperType or func in _NO_OPS) and func.__name__ != "__set__":
            ran = func(*args, **kwargs)
            if _metadata_read(func, ran):
                return ran
        if self.off:  # after a departure: logged, not checked
            return self._logged(func, args, kwargs, ran)
        return self._checked(func, args, kwargs, ran)

    def _checked(self, func: Any, args: tuple, kwargs: dict, ran: Any) -> Any:
        """``func`` checked, then called (``ran``: what a getter returned, already called: it
        has no side effects; else ``_NOT_RUN``)."""
        c = self.count
        why = self._departure(c, func, args, kwargs)
        if why is not None:
            return self._unmatched(c, why, func, args, kwargs, ran)
        return self._matched(c, func, args, kwargs, ran)

    def _unmatched(self, c: int, why: str, func: Any, args: tuple, kwargs: dict, ran: Any) -> Any:
        """Call ``c`` is not the log's (``why``): it is a later one, past grad-free calls of the
        log the forward did not make (``grad_free.py``), else the call departs."""
        count = self.count
        if _hidden_state(self.default_dtype) is None:
            k = c
            while k < len(self.calls) and self.calls[k].grad_free:
                k += 1
                if self._departure(k, func, args, kwargs) is None:
                    self.skip(c, k)
                    return self._matched(k, func, args, kwargs, ran)
        self.count = count
        self.diverge(why, c)
        return self._logged(func, args, kwargs, ran)

    def _matched(self, c: int, func: Any, args: tuple, kwargs: dict, ran: Any) -> Any:
        """Call ``c`` is the log's: run (``ran`` as for ``_checked``), its outputs of source
        ``c``."""
        if c in self.drawing:
            self.read_state(self.drawing[c])
        out = func(*args, **kwargs) if ran is _NOT_RUN else ran
        if args and out is args[0] and _returned_argument(func, args, kwargs, out):
            return out
        if type(out) is Tensor:
            self.made_by_id[id(out)] = (weakref.ref(out), c << OUTPUT_BITS, out.data_ptr())
        else:
            self.sources.made(out, c)
        return out

    def _logged(self, func: Any, args: tuple, kwargs: dict, ran: Any) -> Any:
        """A call after the call departed (its first, the departing call): run, and logged as
        a recorded call logs it, with whether it was grad-free (``grad_free.py``), for the
        check of the backward's run of the forward (``trail``; ``ran`` as for ``_checked``).
        An argument not compared by value, or dispatch state a check would see as hidden,
        leaves the run unchecked (``trail`` None)."""
        self.unchecked(args, kwargs)
        trail = self.trail
        if trail is not None and _hidden_state(self.default_dtype) is None:
            try:
                t_args, t_kwargs = _arguments(args, kwargs, self._source)
            except _NotByValue:
                trail = self.trail = None
        else:
            trail = self.trail = None
        if trail is None:
            return func(*args, **kwargs) if ran is _NOT_RUN else ran
        get_state = _STATE.get(func)
        state = get_state and get_state()
        # A getter that ``ran`` has no side effects: what it changed is what ``Before`` reads.
        before = Before.of(args, kwargs) if inert_call(func, kwargs) else None
        hooked = self.hooked
        out = func(*args, **kwargs) if ran is _NOT_RUN else ran
        # Not grad-free either: a call that saved a tensor or returned from a submodule.
        free = before is not None and before.grad_free(out) and self.hooked == hooked
        trail.append(Call(_key(func), t_args, t_kwargs, (0, 0), state, free))
        assert self.matched is not None, "logged after a departure"
        if not _returned_argument(func, args, kwargs, out):
            self.sources.made(out, self.matched + len(trail) - 1)
        return out

    def _departure(self, c: int, func: Any, args: tuple, kwargs: dict) -> str | None:
        """How call ``c`` departs from the log, if it does (counted either way)."""
        if c >= len(self.calls):
            return f"call {c} is {_name(func)}, {self.theirs} has no more calls"
        call = self.calls[c]
        self.count = c + 1
        hidden = _hidden_state(self.default_dtype)
        if hidden is not None:
            return f"{hidden} at call {c} ({_name(func)})"
        key = _key(func)
        if call.func is not key and call.func != key:
            return f"call {c} is {_name(func)}, {self.theirs} has {_name(call.func)}"
        why = self._differs(call, args, kwargs)
        if why is None and call.state is not None and _STATE[func]() != call.state:
            why = f"the global state it dispatches by is {_STATE[func]()}, {self.theirs}'s {call.state}"
        return None if why is None else f"call {c} ({_name(func)}): {why}"

    def _differs(self, call: Call, args: tuple, kwargs: dict) -> str | None:
        if len(args) != len(call.args) or len(kwargs) != len(call.kwargs):
            return f"other arguments than {self.theirs}'s"
        made, same = self.made_by_id, self._same
        for i, e in enumerate(call.args):  # ``_same``, its commonest cases inlined: runs per call
            a = args[i]
            if type(e) is From:
                entry = made.get(id(a))
                if entry is not None and entry[0]() is a and entry[2] == a.data_ptr():  # type: ignore[union-attr]  # narrowed by `is`
                    if entry[1] == e.key or _leaf_alias(entry[1], a, e.key):
                        continue
                elif self._unmade(a, e.key):
                    continue
                return f"argument {i} is {shown(a)} {self._other(a, e.key)}"
            if a is not e and not same(a, e):
                return difference(str(i), a, e, self.theirs, same)
        for name, e in call.kwargs:
            a = kwargs.get(name, _MISSING)
            if not same(a, e):
                return difference(name, a, e, self.theirs, same)
        return None

    def _from(self, a: Any, key: Any) -> bool:
        """``a`` is a tensor with source ``key``."""
        entry = self.made_by_id.get(id(a))
        if entry is not None and entry[0]() is a and entry[2] == a.data_ptr():  # type: ignore[union-attr]  # narrowed by `is`
            return bool(entry[1] == key) or _leaf_alias(entry[1], a, key)
        return self._unmade(a, key)

    def _unmade(self, a: Any, key: Any) -> bool:
        """``_from`` for ``a`` not made by a call of this forward."""
        if not isinstance(a, Tensor):
            return False
        if type(key) is Leaf:
            return self.sources.named(a, key.name) and leaf_layout(a) == key.layout
        return bool(self.sources.key(a) == key)

    def _other(self, a: Any, key: Any) -> str:
        """How tensor ``a`` is not of source ``key``."""
        if type(key) is Leaf and self.sources.named(a, key.name):
            return f"{key.name!r} with another layout, dtype or grad flag than {self.theirs}'s"
        got = self.sources.key(a) if isinstance(a, Tensor) else None
        return other_source(got, key, "calls", self.theirs)

    def _same(self, a: Any, e: Any) -> bool:
        """``a`` is the logged argument ``e``: a tensor of its source, or a value of the same
        type and equal (numbers by ``same_number``)."""
        kind = type(e)
        if kind is From:
            return self._from(a, e.key)
        if type(a) is not kind:
            return False
        if kind in _SEQUENCES:
            same = self._same
            return len(a) == len(e) and all(same(x, y) for x, y in zip(a, e))
        if kind in _NUMBERS:
            return same_number(a, e)
        if kind is slice:  # of integers or None (``_template``)
            return all(
                type(x) is type(y) and x == y
                for x, y in zip((a.start, a.stop, a.step), (e.start, e.stop, e.step))
            )
        return a is e or bool(a == e)


_MISSING = object()
_NOT_RUN = object()


class _NotByValue(Exception):
    """An argument of a type not compared by value."""


def _templates(args: tuple, key: Callable[[Tensor], Any]) -> tuple:
    """``_template`` of each argument, its commonest cases inlined: runs per call recorded."""
    if len(args) > _LONGEST:
        raise _NotByValue(f"{len(args)} arguments")
    made = []
    for a in args:
        kind = type(a)
        if kind in _BY_VALUE or kind in _NUMBERS:
            made.append(a)
        elif isinstance(a, Tensor):
            made.append(From(key(a)))
        else:
            made.append(_template(a, key))
    return tuple(made)


def _template(x: Any, key: Callable[[Tensor], Any]) -> Any:
    """``x`` with each tensor a ``From`` its source (``key``); raises ``_NotByValue``."""
    kind = type(x)
    if kind in _BY_VALUE or kind in _NUMBERS:
        return x
    if kind is slice:
        if not all(type(y) in (int, type(None)) for y in (x.start, x.stop, x.step)):
            raise _NotByValue("slice of other than integers")
        return x
    if isinstance(x, Tensor):
        return From(key(x))
    if kind in _SEQUENCES:
        if len(x) > _LONGEST:
            raise _NotByValue(f"a sequence of {len(x)}")
        return kind(_template(y, key) for y in x)
    raise _NotByValue(f"a {kind.__name__}")


def _hidden_state(default_dtype: torch.dtype) -> str | None:
    """How dispatch below the torch-function level may differ from the recording's, if it may:
    another torch-function mode on the stack (a user's, or ``torch.device``'s, which rewrite
    calls after this level sees them), autocast on, or another default dtype."""
    if torch_function_modes():
        return "another torch-function mode is on"
    if any_autocast_enabled():
        return "autocast is on"
    if torch.get_default_dtype() is not default_dtype:
        return f"the default dtype is {torch.get_default_dtype()}"
    return None


def leaf_layout(t: Tensor) -> tuple:
    """What of a parameter or buffer the ops a call dispatches depend on."""
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _sdpa_backends() -> tuple[bool, ...]:
    """The attention backends ``scaled_dot_product_attention`` may choose from (``sdpa_kernel``
    sets them): each picks other ops."""
    cuda = torch.backends.cuda
    return (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
    )


# Functions whose ops depend on global state no torch function sets: that state, per call.
_STATE = {torch.nn.functional.scaled_dot_product_attention: _sdpa_backends}

# Calls whose result is their argument again, as an alias (``detach``, ``.data``): not logged
# (a monitoring hook may call them on some steps only), their result has its argument's source.
_SAME_SOURCE = frozenset({torch.Tensor.detach, torch.Tensor.data.__get__})  # type: ignore[attr-defined]

_LONGEST = 256  # a longer sequence argument (indices as a list) makes the log not eligible


# Tensor methods that dispatch nothing and make no tensor: they read metadata or register
# autograd hooks (which see the gradients backward computes, whatever the tape replays).
_NO_OPS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "size",
        "dim",
        "ndimension",
        "stride",
        "numel",
        "nelement",
        "storage_offset",
        "is_contiguous",
        "data_ptr",
        "element_size",
        "get_device",
        "is_floating_point",
        "is_complex",
        "__len__",
    )
)


def _metadata_read(func: Any, out: Any) -> bool:
    """A call that dispatches nothing and made no tensor: a property getter that returned no
    tensor (``Tensor.shape``, ``.requires_grad``) or one of ``_NO_OPS``. Neither logged nor
    checked: what it returns steers the forward only through later calls, which are; and the
    hooks of a user's tools (a module tracker) make such calls in some steps and not others."""
    if isinstance(out, Tensor):
        return False
    if type(func) is MethodWrapperType:
        return func.__name__ == "__get__"  # a setter (``t.data = u``) writes
    return func in _NO_OPS


def _key(func: Any) -> Any:
    """``func`` as a value equal for equal functions: a property's getter or setter comes as a
    new method-wrapper at each access, around the same descriptor."""
    return (func.__self__, func.__name__) if type(func) is MethodWrapperType else func


def _returned_argument(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether a call returned its first argument as it was (``.float()`` of a float tensor,
    ``.contiguous()`` of a contiguous one): it keeps its source, whether a hook made the call
    or not. An in-place method returns its written argument: a new source."""
    return bool(args) and out is args[0] and inert_call(func, kwargs)


def _name(func: Any) -> str:
    if type(func) is tuple:  # a ``_key``
        func = func[0]
    if type(func) is MethodWrapperType:
        func = func.__self__
    if type(func) is GetSetDescriptorType:
        return f"Tensor.{func.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return name.replace("TensorBase.", "Tensor.", 1)
