"""A training step under a TapeSAC controller, shared by the examples, benchmarks and tests."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from examples.models import DecoderLM
from tapesac_core.control.controller import Controller, StepReport


def train_step(
    model: DecoderLM,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    controller: Controller | None = None,
    count_flops: bool = False,
) -> tuple[StepReport | None, int]:
    """Forward, backward and optimizer step on ``ids``; the controller's report and backward FLOPs."""
    flops = FlopCounterMode(display=False) if count_flops else None
    if controller is None:
        loss = model.loss(ids)
        _backward(loss, flops)
        report = None
    else:
        with controller.step(tokens=ids.numel()) as report:
            loss = model.loss(ids)
            _backward(loss, flops)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return report, flops.get_total_flops() if flops is not None else 0


def _backward(loss: torch.Tensor, flops: FlopCounterMode | None) -> None:
    if flops is None:
        loss.backward()
    else:
        with flops:
            loss.backward()
