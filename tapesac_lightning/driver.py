"""What both integrations share: token counting and the per-micro-batch step driver.

One controller step is one micro-batch: its forward and backward, plus the optimizer step when
one follows. The Lightning callback and the Accelerate hooks only decide *when* a step opens and
closes; what opening and closing mean lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from tapesac_core import Controller, StepReport, TapeSACError

TokenCounter = Callable[[Any], int | Mapping[str, int]]


def tokens_in(batch: Any) -> int:
    """Tokens of a batch: elements of its first integer tensor, else of its first tensor."""
    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise TapeSACError(
            "the batch holds no tensor to count tokens from. Fix: pass "
            "tokens=lambda batch: ... returning the token count"
        )
    integer = [
        t
        for t in tensors
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    ]
    return (integer or tensors)[0].numel()


class StepDiscarded(Exception):
    """Ends a step whose micro-batch never finished (skipped, or a new one began first): the
    controller drops it, as after an exception, so it sets no time and no peak."""


class StepDriver:
    """Opens and closes ``controller.step`` around micro-batches, for integrations that see a
    training loop only through hooks (no ``with`` block spans the micro-batch)."""

    def __init__(self, controller: Controller, count_tokens: TokenCounter) -> None:
        self.controller = controller
        self.count_tokens = count_tokens
        # Set by integrations that see backward: the open step then needs only its optimizer step.
        self.backward_done = False
        self._step: Any = None

    @property
    def is_open(self) -> bool:
        return self._step is not None

    def open(self, batch: Any) -> None:
        """Start the step of a micro-batch; a step still open is discarded first."""
        self.discard(StepDiscarded("a new micro-batch began before this one finished"))
        self.backward_done = False
        self._step = self.controller.step(tokens=self.count_tokens(batch))
        self._step.__enter__()

    def close(self) -> StepReport | None:
        """Finish the open step; its report (None if no step was open)."""
        step, self._step = self._step, None
        self.backward_done = False
        if step is None:
            return None
        step.__exit__(None, None, None)
        return self.controller.report

    def discard(self, exception: BaseException) -> None:
        """End the open step with ``exception``: nothing it measured is kept."""
        step, self._step = self._step, None
        self.backward_done = False
        if step is not None:
            step.__exit__(type(exception), exception, exception.__traceback__)


def open_at_forward(
    model: torch.nn.Module, driver: StepDriver, finish: Callable[[], None]
) -> RemovableHandle:
    """Opens a micro-batch's step at the model's first forward with grad enabled: later forwards
    of the same micro-batch and forwards under ``no_grad`` open none. A step still open whose
    backward is done (its closing event never came) is ``finish``-ed first."""

    def before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: not a training step
        if driver.is_open and not driver.backward_done:
            return  # another forward of the same micro-batch
        finish()
        driver.open((args, kwargs))

    # First of the pre-forward hooks, so the step also times FSDP's root all-gather.
    return model.register_forward_pre_hook(before_forward, prepend=True, with_kwargs=True)
