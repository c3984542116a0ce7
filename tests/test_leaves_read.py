"""Backward takes each parameter and buffer as the forward first read it (``Block.note_leaves``,
``recompute.forward_leaves``), whatever the module holds by then: a forward that replaces a
buffer it read, out of place, at any point relative to where a steady-state call diverges, with
the checks at the torch-function level (a dense block) or op by op (under autocast); the module's
state after each step is that of training without checkpointing."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import assert_bitwise, step

import tapesac_core
from tapesac_core.tape.values import ValueIds

LEVELS = [
    "function",
    "op",
]  # the checking mode: ``call_checks.CallCheck``, ``op_checks.SteadyCheck``


def _level(level: str, reference: bool) -> Any:
    """Autocast turns the function-level check off (``call_checks.py``)."""
    if level == "function":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=not reference)


def _run(make: Callable[[], torch.nn.Module], level: str, knobs: list[dict]) -> list[str]:
    """A reference and a checkpointed copy, one step per ``knobs`` entry (attributes set on
    both), compared bitwise with their states; each call's path."""
    torch.manual_seed(0)
    reference = make()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 16, requires_grad=True)
    paths = []
    for knob in knobs:
        for module in (reference, block):
            for name, value in knob.items():
                setattr(module, name, value)
        with _level(level, True):
            expected = reference(x).float().pow(2).sum()
        ref = step(reference, lambda expected=expected: expected)
        with _level(level, False), tapesac_core.trace() as blocks:
            loss = block(x).float().pow(2).sum()
        assert_bitwise(ref, step(block, lambda loss=loss: loss))
        for (name, a), b in zip(reference.state_dict().items(), block.state_dict().values()):
            assert torch.equal(a, b), name
        paths.append("diverged" if blocks[0].diverged else "steady" if blocks[0].steady else "")
    return paths


class DivergingRead(torch.nn.Module):
    """The op a steady-state call diverges at is the only one that reads ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))
        self.register_buffer("spare", torch.full((16,), 3.0))
        self.add = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        y = h + self.scale if self.add else h * self.scale
        self.scale, self.spare = self.spare, self.scale
        return torch.tanh(y)


class SharedBuffer(torch.nn.Module):
    """One buffer under two names, replaced under both."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        shared = torch.full((16,), 2.0)
        self.a.register_buffer("s", shared)
        self.b.register_buffer("s", shared)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(self.linear(x), (16,), eps=self.eps) * self.a.s
        self.a.s = self.b.s = self.a.s * 0.5
        return torch.tanh(h * self.b.s)


@pytest.mark.parametrize("level", LEVELS)
def test_the_op_a_call_diverges_at_notes_what_it_reads(level: str) -> None:
    paths = _run(DivergingRead, level, [{"add": False}] * 3 + [{"add": True}, {"add": False}])
    assert paths == ["", "steady", "steady", "diverged", ""], paths


@pytest.mark.parametrize("level", LEVELS)
def test_a_buffer_under_two_names_is_read_under_the_first(level: str) -> None:
    paths = _run(SharedBuffer, level, [{"eps": 1e-5}] * 3 + [{"eps": 1e-3}, {"eps": 1e-5}])
    assert paths == ["", "steady", "steady", "diverged", ""], paths


def test_a_leaf_the_recorder_finds_by_its_storage_is_noted_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recorder names a leaf by identity, or, where its map of the module's leaves has a
    stale entry under the tensor's id (a freed leaf's id taken), by its storage
    (``ValueIds._leaf_view``): either way the leaf is noted as read (it was not by storage, and
    CI's test runs took that path now and then)."""
    monkeypatch.setattr(ValueIds, "_leaf_name", lambda self, t: None)
    paths = _run(DivergingRead, "function", [{"add": False}] * 2)
    assert paths == ["", "steady"]
