"""Calls that leave a block's gradients alone, which a check may let come and go.

Why. A user's monitoring hook inside a block (``out.detach().abs().mean()`` every 100 steps)
makes calls on some steps only. Checked as any other call, such a step departs from its tape,
and its backward's run of the forward, in which the hook (its own counter moved on) makes other
calls again, is refused (``rerun_checks.py``): a training run stopped where
``torch.utils.checkpoint`` computes the right gradients.

Contract. A call is grad-free when none of its outputs requires grad or is one of its
arguments, it is not in-place, a setter or a call into ``out=`` (``inert_call``; an op: no
write in its schema), it wrote into no tensor (no argument's version moved), and it took no
``Generator`` and moved no default generator's state (it drew no random numbers). Such a call
saves nothing for backward and changes nothing another call reads but its own outputs, so a check (``call_checks.CallCheck``) may pass over one that
its tape (or the forward it checks a run against) does not have, and a tape's grad-free entry
that the call does not make, as long as no call it compares reads such a call's output: those
outputs get a source no entry has (``EXTRA``), and a skipped entry's source is never given to a
tensor, so a compared call that reads one departs, as before. Numbers such a call returns
(``.item()``) are compared where a compared call takes them, and what they steer shows as other
calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import dispatch_disabled, torch_function_disabled
from ..measure.memory import not_counted
from ..tensors import default_generator, flat_tensors, has_default_generator

Tensor = torch.Tensor


class _Extra:
    """The source of a tensor a grad-free call made that its tape has no entry for."""

    def __repr__(self) -> str:
        return "a grad-free call's output"


EXTRA = _Extra()


class Before:
    """What a call may change without a dispatch mode seeing it, read just before it runs: its
    tensor arguments' versions and the states of the default generators it may draw from."""

    __slots__ = ("generators", "states", "tensors", "versions")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.tensors = flat_tensors((args, kwargs))
        self.versions = [t._version for t in self.tensors]
        self.generators = _generators(self.tensors, args, kwargs)
        self.states = [_state(g) for g in self.generators] if self.generators else []

    def grad_free(self, out: Any) -> bool:
        """Whether the call, which returned ``out``, was grad-free (see the module)."""
        if self.generators is None:  # a Generator argument: it may have drawn
            return False
        for t in flat_tensors(out):
            if t.requires_grad or any(t is a for a in self.tensors):
                return False
        if any(t._version != v for t, v in zip(self.tensors, self.versions)):
            return False
        # Bookkeeping, unseen by every mode (a user's FLOP counter).
        with dispatch_disabled(), torch_function_disabled():
            return all(torch.equal(_state(g), s) for g, s in zip(self.generators, self.states))


def _state(generator: torch.Generator) -> Tensor:
    state = generator.get_state()
    not_counted(state)  # bookkeeping, not the step's memory
    return state


def _generators(
    tensors: Sequence[Tensor], args: tuple, kwargs: dict
) -> list[torch.Generator] | None:
    """The default generators a call may draw from: the CPU's, its tensors' devices', the
    device it names, the default device's and the current accelerator's; None if it takes a
    ``Generator``."""
    if any(type(a) is torch.Generator for a in (*args, *kwargs.values())):
        return None
    devices = {torch.device("cpu"), torch.get_default_device(), *(t.device for t in tensors)}
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        devices.add(accelerator)
    device = kwargs.get("device")
    if device is not None:
        devices.add(torch.device(device))
    return [default_generator(d) for d in devices if d.type != "meta" and has_default_generator(d)]


def inert_call(func: Any, kwargs: dict) -> bool:
    """Whether a torch function may be grad-free by what it is: not an in-place method
    (``add_``, ``__iadd__``), a setter (``t.data = x``, ``t[i] = x``) nor a call into ``out=``,
    which may change a tensor's bytes or layout without moving its version."""
    name = getattr(func, "__name__", "")
    if name in _SETTERS or "out" in kwargs:
        return False
    return not (name.endswith("_") and not name.endswith("__"))


_SETTERS = frozenset(
    f"__{name}__"
    for name in (
        "set",
        "setitem",
        "delitem",
        "delete",
        "setstate",
        *(
            f"i{op}"
            for op in (
                "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift".split()
            )
        ),
    )
)


def pass_over(out: Any, made_by_id: dict[int, Any]) -> None:
    """A grad-free call no entry stands for returned ``out``: its tensors take the source
    ``EXTRA``."""
    for t in flat_tensors(out):
        made_by_id[id(t)] = (weakref.ref(t), EXTRA, t.data_ptr())
