"""Calls that leave a block's gradients alone, which a check may let come and go.

Why. A user's monitoring hook inside a block (``out.detach().abs().mean().item()`` every 100
steps) makes calls on some steps only. Such a step departs from its tape and its backward runs
the forward again, in which the hook (its counter moved on) does not make them: checked as any
other calls, that run was refused (``rerun_checks.py``), a training run stopped where
``torch.utils.checkpoint`` computes the right gradients.

Contract. A call is grad-free when none of its outputs requires grad (an op, below autograd:
grad mode off or no argument requiring grad, ``reads_gradients``), none of its tensors is an
inference tensor (no version to read), it is not in-place, a setter or a call into ``out=``
(``inert_call``; an op: no write in its schema), no tensor argument's version moved, it took
no ``Generator`` and moved no default generator's state (it drew no random numbers), and
autograd saved nothing and no submodule returned while it ran. What it made is read by later
calls only as their arguments: compared by source and value, so skipping it is seen wherever
it mattered, unless autograd saves what it made (a custom ``autograd.Function`` may), which
takes no argument: such entries are not skipped, and saved tensors are checked by source.

So a check may skip a grad-free entry its tape has and the call does not make (a tape recorded
on a step the hook ran), and the check of a departed call's run in backward may skip the
forward's grad-free calls the run does not make, but never one whose output autograd saved
(``Checking.packed``, and the tape's packed values at recording). A call of its own, in the
forward or in the run, is never passed over: in the forward it departs (its backward runs the
forward again), in the run it is refused (a hook firing only there would change its state a
second time), and so is a tape entry the forward skipped (``rerun_checks``). Where sizes
follow the data, only entries with no size arguments are skipped (``op_checks.SteadyCheck``).
What autograd saves is checked by its source as well (``Sources.pack_key``): a custom
``autograd.Function`` may save what such a call made, which no argument shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._compat import dispatch_disabled, torch_function_disabled
from ..measure.memory import not_counted
from ..tensors import default_generator, flat_tensors, has_default_generator

Tensor = torch.Tensor


class Before:
    """What a call may change without a dispatch mode seeing it, read just before it runs: its
    tensor arguments' versions and the states of the default generators it may draw from."""

    __slots__ = ("generators", "states", "tensors", "versions")

    def __init__(self, tensors: list[Tensor], generators: list[torch.Generator]) -> None:
        self.tensors, self.generators = tensors, generators
        self.versions = [t._version for t in tensors]
        self.states = [_state(g) for g in generators]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Before | None:
        """The state before a call on ``args`` and ``kwargs``; None where it cannot be
        grad-free (an inference tensor, a ``Generator``)."""
        tensors = flat_tensors((args, kwargs))
        if any(t.is_inference() for t in tensors):
            return None
        generators = _generators(tensors, args, kwargs)
        return None if generators is None else cls(tensors, generators)

    def grad_free(self, out: Any) -> bool:
        """Whether the call, which returned ``out``, was grad-free (see the module)."""
        if any(t.requires_grad or t.is_inference() for t in flat_tensors(out)):
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


def untouched(args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether no output of a recorded call requires grad and none of its tensors is an
    inference tensor: the part of being grad-free a recording tells by itself."""
    if any(t.is_inference() for t in flat_tensors((args, kwargs))):
        return False
    return not any(t.requires_grad or t.is_inference() for t in flat_tensors(out))


def reads_gradients(args: tuple, kwargs: dict) -> bool:
    """Whether an op's outputs will require grad, as autograd above a dispatch mode decides
    (where a mode sees them, they do not yet): grad mode on and an argument requiring grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in flat_tensors((args, kwargs)))


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
