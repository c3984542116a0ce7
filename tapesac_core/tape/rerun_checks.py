"""A diverged call's backward: its forward run again, checked against what the forward ran.

Why. A steady-state call that departs from its tape (``steady.py``) keeps nothing for backward,
and its backward runs the forward again (``recompute.py``), as torch's checkpoint does. A
forward that changes Python state it reads (a counter it increments, Python's ``random``), or
code between forward and backward that changes that state, runs other ops or other numbers the
second time, and backward would read what they saved: wrong gradients, silently, as torch's
checkpoint gives them.

Contract. The forward's checking mode (``op_checks.SteadyCheck`` or ``call_checks.CallCheck``)
compared it with its tape up to where it departed, and from there logged what it ran as a
recorded call's log would (``Checking.trail``). The run in backward goes under a mode of the
same kind that checks it against the tape's entries before the departure and the trail after:
the same ops or calls, with the same numbers, from the same sources, and (where sizes follow the
data) the same size arguments as the forward's. A difference is a ``TapeSACError`` naming the
fix, raised before backward reads a tensor of the run.

Tensors read from outside the block (not its inputs, parameters or buffers), which the checks
know by layout only, must be the forward's, unwritten since it read them (``Sources.outside``);
keyed by their storage's order in the forward (``Sources.seed``) and their layout, those only
the grad-free calls the run skipped read are not read again.

Not seen: what neither level compares (``op_checks``, ``call_checks``); a call-level trail that
met an argument it cannot compare by value, or dispatch state it cannot see (autocast turned on
inside the block after the departure): that run is not checked, as torch's checkpoint's is not.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .call_checks import CallCheck, LoggedCalls
from .op_checks import SizeArguments, SteadyCheck, fast_checks

Tensor = torch.Tensor


@dataclass(frozen=True)
class RerunCheck:
    """What a diverged call's forward ran (``expected``), as its backward's run is checked."""

    ops: bool  # op by op (``SteadyCheck``), else call by call (``CallCheck``)
    expected: tuple  # the tape's entries before the departure, then the trail
    fast: tuple  # per op entry, its ``FastCheck`` (ops only)
    kinds: Any  # the tape's ``OpKinds`` (ops only)
    nodes: Sequence[Any]
    size_arguments: SizeArguments | None
    sizes: tuple  # the size arguments the forward's op checks gathered (ops only)
    # The tensors the forward read from outside the block, by order and layout, with their
    # versions then (``Sources.outside``): what the run reads of them must be the same,
    # unwritten.
    outside: tuple[tuple[tuple[int, tuple], weakref.ref[Tensor], int, tuple], ...]

    def mode(self, inputs: Sequence[Tensor], module: torch.nn.Module) -> SteadyCheck | CallCheck:
        """A checking mode for one run of the forward from ``inputs``."""
        mode: SteadyCheck | CallCheck
        if self.ops:
            mode = SteadyCheck(
                self.expected,
                self.kinds,
                self.nodes,
                self.fast,
                {},
                inputs,
                module,
                self.size_arguments,
            )
        else:
            mode = CallCheck(LoggedCalls(self.expected, {}), self.nodes, inputs, module)
        mode.theirs = "the forward"
        mode.sources.seed(self.outside)
        return mode

    def verdict(self, mode: SteadyCheck | CallCheck) -> str | None:
        """How the run ``mode`` checked differed from the forward, if it did."""
        if mode.diverged is not None:
            return mode.diverged
        if not mode.complete:
            return f"{mode.count} {mode.unit} ran, the forward ran {len(self.expected)}"
        if isinstance(mode, SteadyCheck) and tuple(mode.sizes) != self.sizes:
            return "its ops' size arguments are not the forward's"
        read = mode.sources.outside
        other = (
            "it read other tensors from outside the block (not its inputs, parameters or "
            "buffers) than the forward"
        )
        forward = {key: (then, was, at) for key, then, was, at in self.outside}
        # Those it did not read only calls it skipped read (an argument's source tells).
        for key, (now, version, now_at) in read.items():
            t = now()
            if key not in forward or forward[key][0]() is not t:
                return other
            _, was, at = forward[key]
            if now_at != at:
                return (
                    "a tensor it reads from outside the block was moved to other bytes or "
                    "another layout (`.data =`) since the forward read it"
                )
            if version != was:
                shown = "" if t is None else f" {tuple(t.shape)} {t.dtype}"
                return (
                    f"a tensor{shown} it reads from outside the block was written since the "
                    f"forward read it (version {was}, now {version}), by the forward itself or "
                    "by code before backward"
                )
        return None


def rerun_check(check: SteadyCheck | CallCheck) -> RerunCheck | None:
    """How the backward's run of a diverged forward checked by ``check`` is checked; None where
    the forward's trail could not be logged."""
    if check.diverged is None:
        matched, trail = check.count, []
    elif check.trail is None:
        return None
    else:
        assert check.matched is not None, "a departure notes where"
        matched, trail = check.matched, check.trail
    outside = tuple((key, *read) for key, read in check.sources.outside.items())
    if isinstance(check, CallCheck):
        expected = (*_unmade(check.calls[:matched], check.skipped, "func"), *trail)
        return RerunCheck(False, expected, (), None, check.nodes, None, (), outside)
    fast = (*check.fast[:matched], *fast_checks(trail, check.nodes))
    return RerunCheck(
        True,
        (*_unmade(check.checks[:matched], check.skipped, "op"), *trail),
        fast,
        check.kinds,
        check.nodes,
        check.size_arguments,
        tuple(check.sizes),
        outside,
    )


class _Skipped:
    """What a tape entry the forward skipped (``grad_free.py``) stands for in the run's check:
    no call or op is it, so the run may skip it too, never make it (a hook firing only there)."""

    def __repr__(self) -> str:
        return "none there (a grad-free call it skipped)"


_SKIPPED = _Skipped()


def _unmade(entries: Sequence[Any], skipped: tuple[int, ...], field: str) -> list[Any]:
    """``entries`` with those the forward skipped made unmatchable (their ``field``)."""
    out = list(entries)
    for i in skipped:
        if i < len(out):
            out[i] = out[i]._replace(**{field: _SKIPPED})
    return out
