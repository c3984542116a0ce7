"""Helpers shared by the tests: reference runs, bitwise comparison, op counting."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tapesac_core
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], seed: int = 0
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward from a fixed RNG state: the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def require_deterministic() -> None:
    """Deterministic algorithms are on: without them, CUDA's ``index_add_``, ``scatter_add_``
    and ``index_put_(accumulate=True)`` add in a varying order and bitwise checks fail."""
    assert torch.are_deterministic_algorithms_enabled(), (
        "bitwise tests need torch.use_deterministic_algorithms(True) (tests/conftest.py sets it)")


def assert_bitwise(ref: tuple, got: tuple) -> None:
    """Loss and every gradient identical, bit for bit."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert torch.equal(ref_loss, loss), (ref_loss.item(), loss.item())
    assert ref_grads.keys() == grads.keys()
    different = [n for n in ref_grads if not torch.equal(ref_grads[n], grads[n])]
    assert not different, f"gradients differ: {different}"


def assert_replayed_as_predicted(blocks: list[tapesac_core.BlockTrace]) -> None:
    """Replay ran each node at most once: exactly the nodes Eq. 3 predicts for what was kept and
    what backward read, never a node outside ``replay_nodes(S)``, never more than block recomputation."""
    for b in blocks:
        tape = b.tape
        assert len(b.replayed) == len(set(b.replayed)), tape.name
        kept = b.saved | b.alive_taken
        assert sorted(b.replayed) == tape.replay_nodes(kept, demand=b.unpacked), tape.name
        assert set(b.replayed) <= set(tape.replay_nodes(b.saved)), tape.name
        assert set(tape.replay_nodes(b.saved)) <= set(tape.block_nodes(b.saved)), tape.name


def tiny_lm(**overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**overrides))


BLOCK_CLASSES = {DecoderLayer, MoEDecoderLayer}
