"""Property: writes inside a block's forward, through the tensor, its views and its ``.data``,
and ``.data`` swaps, before and after autograd saves it: every call is bitwise that of training
without checkpointing wherever that trains without an error (autograd refuses some writes into
tensors it saved), or a TapeSACError; under must-only and under a plan, recorded and steady."""

from __future__ import annotations

import copy
import logging

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_bitwise, step

import tapesac_core
from tapesac_core.errors import TapeSACError

STEPS = (
    "save",  # autograd saves h
    "save_view",  # autograd saves a view of h, freed at once
    "read",
    "inplace",  # a copy of h, written in place (bumps its version)
    "view_write",  # a copy of h, written through a view
    "data_write",  # h written through .data (a version counter of its own)
    "data_view_write",  # a view of h.data written
    "data_swap",  # h moved to other bytes
)


class Program(torch.nn.Module):
    def __init__(self, steps: list[str]) -> None:
        super().__init__()
        self.steps = steps
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        total = x.sum() * 0
        for s in self.steps:
            if s == "save":
                total = total + h.sin().sum()
            elif s == "save_view":
                total = total + h[:, :4].cos().sum()
            elif s == "read":
                total = total + (h * h).sum()
            elif s == "inplace":
                h = h * 1.0
                h.mul_(1.5)
            elif s == "view_write":
                h = h * 1.0
                h[:, :2].add_(0.25)
            elif s == "data_write":
                h.data.clamp_(-0.3, 0.3)
            elif s == "data_view_write":
                h.data[:, 4:].mul_(-1.0)
            else:
                assert s == "data_swap"
                h.data = h.data * 0.5
        return self.b(h).tanh().sum() + total


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=6), planned=st.booleans())
def test_every_call_is_bitwise_whatever_the_forward_writes(steps: list[str], planned: bool) -> None:
    torch.manual_seed(0)
    reference = Program(steps)
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="p")
    plan = {"p": {("aten.addmm.default", 0, 0), ("aten.mul.Tensor", 0, 0)}} if planned else {}
    logging.disable(logging.WARNING)  # diverged calls say so once each; not what is tested
    try:
        with tapesac_core.use_plan(plan), tapesac_core.trace():
            for s in range(3):  # recorded, then steady-state calls (or diverged ones)
                x = torch.randn(4, 8, requires_grad=True)
                try:
                    ref = step(reference, lambda: reference(x), seed=s)
                except RuntimeError:
                    return  # autograd refuses it without checkpointing too
                try:
                    got = step(module, lambda: module(x), seed=s)
                except TapeSACError:
                    continue
                assert_bitwise(ref, got)
    finally:
        logging.disable(logging.NOTSET)
