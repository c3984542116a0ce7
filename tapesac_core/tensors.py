"""Tensor helpers shared by recording, steady state, replay and the block: stateless functions.

What it holds:

* layouts and storages: ``layout_of`` (a tensor's ``Meta``), ``view_on`` (a tensor with a recorded
  layout on a given storage), ``on_storage`` (a tensor's view of another storage, e.g. a copy of
  its own), ``detached`` (a tensor without its autograd graph, made unseen by dispatch modes);
* what an op's arguments or results contain: ``flat_tensors``, ``is_subclass_with_dispatch``;
* random generators: ``default_generator`` and ``has_default_generator`` of a device;
* recorded argument templates: ``slot``, ``slot_args`` and ``SLOT_ARGS``, the ``Slot`` objects a
  node's recorded arguments stand in for its tensor inputs with, shared by every node.

Contract: nothing here keeps a reference to what it is given. ``detached`` runs unseen by any
dispatch mode; ``view_on`` and ``on_storage`` run their ops (``empty``, ``set_``) where they are
called: the recorder calls them inside its ``__torch_dispatch__``, where its own mode is off, so
they never become nodes of a tape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._compat import dispatch_disabled, tree_leaves
from .errors import TapeSACError


class Slot:
    """Placeholder for the ``i``-th tensor input of a node inside its recorded arguments."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"Slot({self.i})"


class Meta(NamedTuple):
    """Shape, strides, storage offset, dtype and device of a recorded tensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device


Tensor = torch.Tensor

_new_tuple = tuple.__new__


def layout_of(t: Tensor) -> Meta:
    """``t``'s layout: shape, strides, storage offset, dtype and device."""
    # tuple.__new__ skips NamedTuple's Python-level __new__: this runs for many recorded values.
    return _new_tuple(Meta, (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device))


def view_on(storage: torch.UntypedStorage, meta: Meta) -> Tensor:
    """A tensor with layout ``meta`` (offset, shape, strides, dtype) on ``storage``."""
    view = torch.empty(0, dtype=meta.dtype, device=meta.device)
    with torch.no_grad():
        view.set_(storage, meta.offset, meta.shape, meta.stride)
    return view


def on_storage(t: Tensor, storage: torch.UntypedStorage) -> Tensor:
    """``t``'s view (offset, shape, strides) of another storage, e.g. a copy of its own.

    Copying whole storages rather than views keeps every alias of a storage addressable.
    """
    return view_on(storage, layout_of(t))


def detached(t: Tensor) -> Tensor:
    """``t``'s storage, layout and version counter without its autograd graph, unrecorded.

    Autograd's saved tensors reach the block through its unpack hook, so a block that
    held a tensor with a ``grad_fn`` would close a cycle through C++ graph nodes the garbage
    collector cannot see: a forward whose backward never runs would leak the block forever.
    """
    # No dispatch mode (the recorder) sees this bookkeeping op. The C++ guard, not
    # ``_disable_current_modes``, which pops and pushes every mode in Python (16 µs a call).
    with dispatch_disabled():
        return t.detach()


def flat_tensors(out: Any) -> list[Tensor]:
    """The tensors in an op's arguments or results, in order."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    return []


def tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors anywhere in ``tree`` (lists, tuples, dicts and containers registered with
    torch's pytree, such as a model's output classes), in order."""
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def is_subclass_with_dispatch(t: Tensor) -> bool:
    """A tensor subclass that intercepts ops itself (DTensor, FakeTensor, ...)."""
    return type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__


def has_default_generator(device: torch.device) -> bool:
    """Whether ``default_generator`` can capture ``device``'s generator."""
    module = getattr(torch, device.type, None)
    return device.type == "cpu" or bool(getattr(module, "default_generators", None))


def default_generator(device: torch.device) -> torch.Generator:
    """The default random generator of a device, or a clear error if it cannot be captured."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        raise TapeSACError(
            f"cannot capture the random generator of device {device}: "
            f"torch.{device.type}.default_generators is not available"
        )
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


# ---------------------------------------------------------------------- argument templates

_SLOTS = tuple(Slot(i) for i in range(64))  # immutable: slots are shared by every node
# The arguments of a call whose arguments are exactly its tensor inputs, in order: one shared
# tuple per count, so replay recognises them by identity and passes its tensors as they are.
SLOT_ARGS = tuple(_SLOTS[:n] for n in range(len(_SLOTS) + 1))


def slot(i: int) -> Slot:
    """The placeholder of a node's ``i``-th tensor input in its recorded arguments."""
    return _SLOTS[i] if i < len(_SLOTS) else Slot(i)


def slot_args(n: int) -> tuple[Slot, ...]:
    """The arguments of a call whose arguments are its ``n`` tensor inputs, in order."""
    return SLOT_ARGS[n] if n < len(SLOT_ARGS) else tuple(slot(i) for i in range(n))
