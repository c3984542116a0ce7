"""Steady-state calls checked at the torch-function level (``tape/call_checks.py``): which tapes
take that check, and the changes it must still catch, bitwise with no checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from support import assert_bitwise, block_paths, hf_model, step, token_ids

import tapesac_core
from tapesac_core.tape.steady import SteadyTape
from tapesac_core.tape.steady_cache import steady_cache

D = 8


def _entries(model: torch.nn.Module) -> list[SteadyTape]:
    return [
        e
        for m in model.modules()
        for e in steady_cache(m)._entries.values()
        if isinstance(e, SteadyTape)
    ]


@pytest.mark.parametrize(("family", "dropout"), [("qwen3", 0.0), ("gpt2", 0.1)])
def test_hugging_face_layers_are_checked_by_their_calls(family: str, dropout: float) -> None:
    model, layer = hf_model(family, dropout)
    reference = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(model, {layer})
    ids = token_ids(0, batch=2, seq=16, vocab=128)
    with tapesac_core.trace() as blocks:
        for seed in range(3):
            ref = step(reference, lambda: reference(input_ids=ids, labels=ids).loss, seed)
            got = step(model, lambda: model(input_ids=ids, labels=ids).loss, seed)
            assert_bitwise(ref, got)
    assert block_paths(blocks)[-4:] == ["steady"] * 4
    entries = _entries(model)
    assert entries and all(e.calls is not None for e in entries), [
        e.calls_not_checked for e in entries
    ]


class Toggles(torch.nn.Module):
    """A block whose forward turns autocast on, or changes the default dtype, when the training
    loop says so: state below the torch-function level that changes the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.autocast = False
        self.double = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            h = self.proj(x).tanh()
        saved = torch.get_default_dtype()
        if self.double:
            torch.set_default_dtype(torch.float64)
        try:
            scale = torch.tensor(1.5)  # float32 or float64: the default dtype decides
        finally:
            torch.set_default_dtype(saved)
        return (h.float() * scale).sin()


@pytest.mark.parametrize("knob", ["autocast", "double"])
def test_autocast_or_a_default_dtype_turned_on_inside_the_forward_is_a_divergence(knob) -> None:
    torch.manual_seed(0)
    reference = Toggles()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, D)
    paths, why = [], []
    for call in range(4):
        for m in (reference, block):
            setattr(m, knob, call == 2)
        ref = step(reference, lambda: reference(x).sum())
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).sum())
        assert_bitwise(ref, got)
        paths.extend(block_paths(blocks))
        why.extend(b.diverged for b in blocks)
    assert paths[1] == "steady" and paths[2] == "diverged"
    assert "autocast is on, or the default dtype changed" in str(why[2])


class Reads(torch.nn.Module):
    """A block that runs under autocast, or runs an op with torch functions off. (Blocks whose
    sizes follow their data, ``.item()`` say, are checked op by op too: ``test_steady_checks``.)"""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj, self.how = torch.nn.Linear(D, D), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(h).float()
        with torch._C.DisableTorchFunction():
            h = h.tanh()
        return h.sin()


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("autocast", "autocast is on"),
        ("hidden", "ran outside any torch function"),
    ],
)
def test_tapes_whose_calls_cannot_tell_are_checked_op_by_op(how: str, why: str) -> None:
    torch.manual_seed(0)
    reference = Reads(how)
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, D)
    with tapesac_core.trace() as blocks:
        for _ in range(3):
            assert_bitwise(
                step(reference, lambda: reference(x).sum()), step(block, lambda: block(x).sum())
            )
    assert block_paths(blocks)[-1] == "steady"
    (entry,) = _entries(block)
    assert entry.calls is None and why in str(entry.calls_not_checked)


class Hooked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.hook = False
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.hook:  # a tool's hook on some steps only: no op, no tensor made
            h.register_hook(self.seen.append)
        assert h.shape[0] == x.size(0) and h.dim() == 2
        return h.tanh()


def test_calls_that_dispatch_nothing_are_not_compared() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Hooked())
    x = torch.randn(4, D, requires_grad=True)
    with tapesac_core.trace() as blocks:
        for call in range(4):
            block.hook = call == 2
            block(x).sum().backward()
    assert block_paths(blocks)[1:] == ["steady"] * 3
    assert len(block.seen) == 1 and block.seen[0].shape == (4, D)
