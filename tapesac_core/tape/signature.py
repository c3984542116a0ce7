"""A block call's signature: what must be equal for two calls of one module to run the same ops.

Steady state (``steady.py``) replays a later call from the tape an earlier call with the same
signature recorded. The signature holds what decides a decoder layer's op sequence in practice:
the function called, its inputs' shapes, strides, storage offsets, dtypes, devices and
``requires_grad`` (and which inputs are the same tensor), the other arguments (numbers of any
kind, strings, dtypes, devices and enums by value, other objects by class), the ``training`` flags of the module and its submodules, autocast
and the default dtype, and the block's plan entry and hidden-write coordinates. What it cannot
hold (a Python branch on a global, a changed attribute) the steady path checks as it runs.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from enum import Enum
from typing import Any, NamedTuple

import torch

from .._compat import tree_flatten
from ..plan.coords import Coord

Tensor = torch.Tensor
_SCALARS = (int, float, bool, str, type(None))
# Arguments keyed by value: numbers of any kind (numpy's too), strings and what names a dtype,
# a device, a layout or a memory format.
_VALUES = (
    numbers.Number,
    str,
    bytes,
    type(None),
    type(...),
    slice,
    Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_LEAVES = (Tensor, *_VALUES)  # what call_arguments reads as a leaf without pytree


def tensor_key(t: Tensor) -> tuple:
    """What of a tensor argument the tape depends on: its layout, dtype, device and grad flag."""
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
    )


def _leaf_key(x: Any) -> object:
    if isinstance(x, Tensor):
        return tensor_key(x)
    if isinstance(x, _VALUES):
        return (type(x), x)  # 1, 1.0 and True hash alike but may run different ops
    # Another object (a KV cache Hugging Face makes afresh each forward) by its class: what its
    # state changes in the ops, the steady path's checks see as it runs.
    return type(x)


def _same_objects(tensors: Sequence[Tensor]) -> tuple[int, ...]:
    """Per tensor, the position of the first argument that is the same object (aliasing of
    inputs decides which values the tape gives them)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def _module_flags(submodules: Sequence[torch.nn.Module]) -> tuple[bool, ...]:
    return tuple(m.training for m in submodules)


class Signature(NamedTuple):
    """What two calls of one block must share to run the same ops (see the module)."""

    function: object
    structure: Hashable  # what holds the arguments (``CallArguments.structure``): no sizes in it
    arguments: Hashable
    same_objects: tuple[int, ...]
    training: tuple[bool, ...]
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) where autocast is on
    default_dtype: torch.dtype
    plan: Hashable
    forced: frozenset[Coord]


def _autocast(device_types: set[str]) -> tuple[tuple[str, torch.dtype], ...]:
    return tuple(
        (d, torch.get_autocast_dtype(d))
        for d in sorted(device_types)
        if torch.is_autocast_enabled(d)
    )


class CallArguments(NamedTuple):
    """A call's arguments flattened once, for its tensors and its signature: the leaves in
    pytree order and what holds them (None: positional tensors and scalars only)."""

    leaves: list[Any]
    structure: Hashable | None

    @property
    def tensors(self) -> list[Tensor]:
        return [x for x in self.leaves if isinstance(x, Tensor)]


def call_arguments(args: tuple, kwargs: dict) -> CallArguments:
    """``args`` and ``kwargs`` flattened (lists, tuples, dicts and containers registered with
    torch's pytree). Python's own containers holding tensors and values (a Hugging Face layer's
    keyword arguments) are read here: pytree's walk of them costs tens of microseconds a call,
    and its spec hashes in Python."""
    if not kwargs and all(isinstance(a, Tensor) or isinstance(a, _SCALARS) for a in args):
        return CallArguments(list(args), None)
    leaves: list[Any] = []
    try:
        return CallArguments(leaves, _structure((args, kwargs), leaves))
    except _OtherContainer:
        leaves, spec = tree_flatten((args, kwargs))
        return CallArguments(leaves, spec)


class _OtherContainer(Exception):
    """An argument that is neither a tensor, a value, nor a tuple, list or dict (a namedtuple,
    a container registered with pytree, another object): pytree flattens the call."""


def _structure(x: Any, leaves: list[Any]) -> Hashable:
    """What holds ``x``'s leaves (appended to ``leaves`` in pytree's order): the exact types of
    its tuples, lists and dicts, their lengths and keys."""
    kind = type(x)
    if kind is tuple or kind is list:
        return (kind, tuple([_structure(v, leaves) for v in x]))
    if kind is dict:
        return (kind, tuple([(k, _structure(v, leaves)) for k, v in x.items()]))
    if isinstance(x, _LEAVES):
        leaves.append(x)
        return None
    raise _OtherContainer


def block_signature(
    fn: Any,
    call: CallArguments,
    inputs: Sequence[Tensor],
    submodules: Sequence[torch.nn.Module],
    plan_key: Hashable,
    forced: frozenset[Coord],
) -> Signature:
    """The signature of one call of a block (``inputs``: ``call``'s tensors; ``submodules``: the
    module's own and its submodules', whose ``training`` flags count)."""
    return Signature(
        # The function, not a module passed as one: the module holds this signature in its cache.
        getattr(fn, "__func__", None) or (type(fn) if isinstance(fn, torch.nn.Module) else fn),
        call.structure,
        tuple(_leaf_key(x) for x in call.leaves),
        _same_objects(inputs) if len(inputs) > 1 else (),
        _module_flags(submodules),
        _autocast({"cpu", *(t.device.type for t in inputs)}),
        torch.get_default_dtype(),
        plan_key,
        forced,
    )
