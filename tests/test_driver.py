"""The step driver under hooks that open a step at the model's forward (Accelerate, the HF
Trainer), without launching: which forwards make one micro-batch's step."""

import logging

import pytest
import torch

from tapesac_core import Controller, checkpoint_modules
from tapesac_lightning.driver import StepDriver, open_at_forward, tokens_in


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Loop:
    """A two-block model with its steps driven as ``TapeSACAccelerator`` drives them."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(Layer(), Layer())
        checkpoint_modules(self.model, {Layer})
        self.controller = Controller(self.model, memory_limit=0.9)
        self.driver = StepDriver(self.controller, tokens_in)
        self.reports: list = []
        open_at_forward(self.model, self.driver, self.finish)

    def finish(self) -> None:
        report = self.driver.close()
        if report is not None:
            self.reports.append(report)

    def forward(self, rows: int) -> torch.Tensor:
        return self.model(torch.randn(rows, 8)).sum()

    def train(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.driver.backward_done = True
        self.finish()  # the optimizer step's hook


def test_a_forward_gone_unread_before_the_next_one_is_left_out_of_its_step(caplog) -> None:
    loop = Loop()
    with caplog.at_level(logging.INFO, logger="tapesac_lightning.driver"):
        for _ in range(2):
            loop.forward(rows=2).item()  # a forward for a log line: its graph freed at once
            loop.train(loop.forward(rows=6))
    assert [(r.step, r.blocks, r.local_tokens) for r in loop.reports] == [
        (0, 2, {"Layer": 6 * 8}),
        (1, 2, {"Layer": 6 * 8}),
    ]
    assert caplog.text.count("reached no backward") == 1  # said once


def test_a_forward_alive_at_the_next_one_that_then_reaches_no_backward_discards_the_step() -> None:
    loop = Loop()
    loss = loop.forward(rows=2)  # a skipped batch: its loss lives on until rebound
    loss = loop.forward(rows=6)
    loop.train(loss)
    assert loop.reports == [] and loop.controller.steps == 0  # its time counts both
    loop.train(loop.forward(rows=6))
    assert loop.reports[-1].blocks == 2 and loop.controller.steps == 1


@pytest.mark.parametrize("forwards", [2, 3])
def test_forwards_before_one_backward_are_one_step(forwards: int) -> None:
    loop = Loop()
    loop.train(sum(loop.forward(rows=6) for _ in range(forwards)))  # DPO: chosen, rejected
    (report,) = loop.reports
    assert report.blocks == 2 * forwards and loop.controller.steps == 1
