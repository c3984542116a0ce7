"""Calls that leave the gradients alone (``tape/grad_free.py``): a monitoring hook that runs on
some steps only neither makes a step depart from its tape nor fails the check of a departed
step's backward, at the call level and, under autocast, at the op level. Before, each step the
hook ran on departed, and its backward's run of the forward (the hook's counter moved on) was
refused with a ``TapeSACError``: training stopped where ``torch.utils.checkpoint`` is right."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from support import assert_bitwise, block_paths, step

import tapesac_core
from tapesac_core.errors import TapeSACError

D = 8
LEVELS = ["calls", "ops"]  # ops: under autocast, which calls cannot be checked under


class Block(torch.nn.Module):
    def __init__(self, threshold: float | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.drop = torch.nn.Dropout(dropout)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if self.threshold is not None:  # a mask made without gradients, then read by one
            h = h * (h.detach() > self.threshold)
        return self.b(self.drop(h)).float()


def every(n: int, first: int, what: Callable[[torch.Tensor], Any], log: list) -> Callable:
    """A forward hook that runs ``what`` on its module's output on calls first, first + n, ..."""
    calls = [0]

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] % n == first % n:
            log.append(what(out))

    return hook


def _run(
    make: Callable[[], Block],
    hook: Callable[[list], Callable] | None,
    level: str,
    steps: int,
    plan: dict | None = None,
    change: Callable[[Block, int], None] | None = None,
) -> tuple[list[str], list, list]:
    """``steps`` training steps of a checkpointed ``make()`` against one without checkpointing,
    each with ``hook(log)`` on its ``a``: bitwise every step; the path each step took and both
    hooks' logs."""
    torch.manual_seed(0)
    reference = make()
    block = copy.deepcopy(reference)
    logs: tuple[list, list] = ([], [])
    if hook is not None:
        reference.a.register_forward_hook(hook(logs[0]))
        block.a.register_forward_hook(hook(logs[1]))
    tapesac_core.checkpoint_module(block, region="block")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    paths = []
    with tapesac_core.use_plan(plan or {}):
        for i in range(steps):
            if change is not None:
                change(reference, i)
                change(block, i)
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(i), requires_grad=True)
            with autocast:
                ref = step(reference, lambda: reference(x).square().sum(), seed=i)
            with tapesac_core.trace() as blocks, autocast:
                got = step(block, lambda: block(x).square().sum(), seed=i)
            assert_bitwise(ref, got)
            paths.append(block_paths(blocks)[0])
    return paths, logs[0], logs[1]


def _mean(out: torch.Tensor) -> float:
    return out.detach().abs().mean().item()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("plan", [None, {"block": {("aten.addmm.default", 0, 0)}}])
def test_a_monitoring_hook_on_some_steps_leaves_every_step_steady(level: str, plan) -> None:
    paths, expected, logged = _run(Block, lambda log: every(3, 3, _mean, log), level, 9, plan)
    assert paths[1:] == ["steady"] * 8  # the hook ran on steps 2, 5 and 8
    assert logged == expected and len(logged) == 3  # once a step: no second run in backward


@pytest.mark.parametrize("level", LEVELS)
def test_a_tape_recorded_while_the_hook_ran_serves_the_steps_it_does_not(level: str) -> None:
    def detached(out: torch.Tensor) -> torch.Tensor:  # kept as a tensor: no host read
        return out.detach().abs().mean()

    paths, expected, logged = _run(Block, lambda log: every(4, 1, detached, log), level, 6)
    assert paths[1:] == ["steady"] * 5  # steps 0 (recorded) and 4 ran the hook
    assert [t.item() for t in logged] == [t.item() for t in expected]


@pytest.mark.parametrize("level", LEVELS)
def test_a_changed_mask_that_a_gradient_reads_still_departs(level: str) -> None:
    """The comparison ``h.detach() > threshold`` is grad-free, but the product reads it."""

    def threshold(block: Block, i: int) -> None:
        block.threshold = 0.1 if i < 2 else 0.2

    paths, _, _ = _run(lambda: Block(threshold=0.1), None, level, 5, change=threshold)
    assert paths[1:3] == ["steady", "diverged"] and paths[4] == "steady"


@pytest.mark.parametrize("level", LEVELS)
def test_a_hook_that_draws_random_numbers_on_some_steps_is_refused_not_wrong(
    level: str,
) -> None:
    """A draw moves the generator the dropout after it draws from: not grad-free. The run of
    the forward in backward (without the draw) would drop other units than the forward did,
    as torch's checkpoint does, silently."""
    with pytest.raises(TapeSACError, match="ran differently when run again in backward"):
        _run(
            lambda: Block(dropout=0.5),
            lambda log: every(3, 3, lambda out: torch.rand(()), log),
            level,
            3,
        )


def test_a_router_monitor_in_an_eager_experts_moe_keeps_its_steps_steady() -> None:
    """Where sizes follow the routing (``data_sizes.py``): a hook logging the router's output
    every 5 calls (steps 4 and 9) was refused at its first steady step."""
    pytest.importorskip("transformers")
    from moe_families import VOCAB, moe_model
    from support import token_ids
    from test_moe_families import _lockstep

    reference, layer = moe_model("qwen3_moe", "eager")
    model = copy.deepcopy(reference)
    logs: tuple[list, list] = ([], [])
    for m, log in zip((reference, model), logs):
        for name, module in m.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(every(5, 5, lambda out: _mean(out[0]), log))
    tapesac_core.checkpoint_modules(model, {layer})
    step = _lockstep(reference, model)
    for i in range(10):
        with tapesac_core.trace() as blocks:
            step(token_ids(i, batch=2, seq=24, vocab=VOCAB), i)
        if i in (4, 8):  # after warm-up: steady on the hook's steps and the others
            assert all(b.steady for b in blocks), [b.diverged for b in blocks]
    assert logs[1] == logs[0] and len(logs[1]) == 4  # two layers, steps 4 and 9
