"""A method: one way of running the same training step (a model copy checkpointed one way, the
context its steps run in), and what was measured of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch


def loss_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One step without the optimizer (forward, loss, backward), leaving no gradients behind."""
    model.zero_grad(set_to_none=True)
    model.loss(ids).backward()
    model.zero_grad(set_to_none=True)


@dataclasses.dataclass
class Method:
    name: str
    family: str
    model: torch.nn.Module
    context: Callable[[], Any] = nullcontext
    setup: Callable[[], Any] = nullcontext  # context for the first (warm-up) step: compile here
    note: str = ""
    error: str | None = None
    limit: int | None = None  # TapeSAC planned: the limit, in bytes above those live at step start
    plan: Any = None
    # TapeSAC planned by the Controller: its predicted step peak, in bytes above those live at
    # step start (Controller.predicted_peak)
    predicted_peak: int | None = None
    peak: int | None = None
    backward_flops: int | None = None
    forward_flops: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)

    def step(self, ids: torch.Tensor) -> None:
        with self.context():
            loss_backward(self.model, ids)

    def warm(self, ids: torch.Tensor) -> None:
        """Two steps under ``setup`` (torch.compile compiles here, under its budget's patch)."""
        with self.setup():
            self.step(ids)
            self.step(ids)
