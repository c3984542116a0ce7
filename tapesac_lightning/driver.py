"""What both integrations share: token counting and the per-micro-batch step driver.

One controller step is one micro-batch: its forward and backward, plus the optimizer step when
one follows. The Lightning callback and the Accelerate hooks only decide *when* a step opens and
closes; what opening and closing mean lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from tapesac_core import Controller, StepReport, TapeSACError
from tapesac_core.blocks.trace_scope import traced_blocks
from tapesac_core.tape.block import BlockTrace
from tapesac_core.tensors import tensor_leaves

logger = logging.getLogger(__name__)

TokenCounter = Callable[[Any], int | Mapping[str, int]]


def tokens_in(batch: Any) -> int:
    """Tokens of a batch: elements of its first integer tensor, else of its first tensor."""
    tensors = tensor_leaves(batch)
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
    """Opens and closes controller steps (``begin_step``, ``end_step``) around micro-batches,
    for integrations that see a training loop only through hooks (no ``with`` block spans the
    micro-batch).

    Integrations that open a step at the model's forward tell each forward (``forward_begins``):
    a forward with grad that reached no backward (a logging forward, a skipped batch) is then
    found once autograd has freed its blocks with nothing read, and kept out of the controller's
    measurements. Until then it cannot be told from the first of two forwards before one
    backward (DPO: chosen and rejected), so it joins the open step."""

    def __init__(self, controller: Controller, count_tokens: TokenCounter) -> None:
        self.controller = controller
        self.count_tokens = count_tokens
        # Set by integrations that see backward: the open step then needs only its optimizer step.
        self.backward_done = False
        self._open = False
        # The open step's block traces (its forwards append to them) and where each forward
        # told by ``forward_begins`` starts among them.
        self._blocks: list[BlockTrace] = []
        self._forwards: list[int] = []
        self._told_unused = False

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self, batch: Any) -> None:
        """Start the step of a micro-batch; a step still open is discarded first."""
        self.discard(StepDiscarded("a new micro-batch began before this one finished"))
        self.controller.begin_step(tokens=self.count_tokens(batch))
        self._open = True
        blocks = traced_blocks()  # the trace the step just opened
        self._blocks = blocks if blocks is not None else []

    def forward_begins(self) -> None:
        """A forward of the model begins in the open step."""
        self._forwards.append(len(self._blocks))

    def only_unused_forwards(self) -> bool:
        """Whether no forward of the open step reached a backward, on any rank: none trained.
        A collective under torch.distributed: every rank asks at the same forward."""
        unused = self._unused()
        return not self._on_any_rank(not (unused and all(unused)))

    def _unused(self) -> list[bool]:
        """Per forward told by ``forward_begins``, whether it reached no backward (known once
        autograd freed its blocks)."""
        ends = [*self._forwards[1:], len(self._blocks)]
        return [_reached_no_backward(self._blocks[s:e]) for s, e in zip(self._forwards, ends)]

    def close(self) -> StepReport | None:
        """Finish the open step; its report (None if no step was open, or if a forward of it
        reached no backward: its time and memory would count that forward, so it is discarded)."""
        # A step's one forward is its micro-batch's own (its backward came). Of several, one that
        # reached no backward is in the step's time and memory; every rank discards, or none.
        if len(self._forwards) > 1 and self._on_any_rank(any(self._unused())):
            self.leave_out_unused()
            return None
        if not self._end():
            return None
        self.controller.end_step()
        # The controller's copy, without the block traces: the step's tapes need not outlive it.
        return self.controller.report

    def leave_out_unused(self) -> None:
        """Discard the open step for its forwards that reached no backward; say so once."""
        if not self._told_unused:
            self._told_unused = True
            logger.info(
                "TapeSAC: a forward of the model with grad enabled reached no backward (a "
                "forward for logging, a skipped batch): it is left out of TapeSAC's steps, and a "
                "step it shared with a training micro-batch (its output still alive when that "
                "micro-batch's forward began) is not measured. Fix: run forwards that do not "
                "train under torch.no_grad()"
            )
        self.discard(StepDiscarded("a forward of the step reached no backward"))

    def discard(self, exception: BaseException) -> None:
        """End the open step with ``exception``: nothing it measured is kept."""
        if self._end():
            self.controller.end_step(exception)

    def _on_any_rank(self, flag: bool) -> bool:
        """``flag`` of any rank: the ranks' steps stay one sequence (their plans are agreed)."""
        return bool(self.controller.ranks.largest([int(flag)])[0])

    def _end(self) -> bool:
        """Forget the open step; whether one was open."""
        was_open, self._open = self._open, False
        self.backward_done = False
        self._blocks, self._forwards = [], []
        return was_open


def _reached_no_backward(blocks: list[BlockTrace]) -> bool:
    """Whether a forward's blocks are all freed with no saved value read: autograd dropped its
    graph without a backward through it. A block that saved nothing tells nothing."""
    return any(b.tape.demand for b in blocks) and all(b.released and not b.unpacked for b in blocks)


def open_at_forward(
    model: torch.nn.Module, driver: StepDriver, finish: Callable[[], None]
) -> RemovableHandle:
    """Opens a micro-batch's step at the model's first forward with grad enabled: later forwards
    of the same micro-batch and forwards under ``no_grad`` open none. A step still open whose
    backward is done (its closing event never came) is ``finish``-ed first; one whose every
    forward already reached no backward (freed unread) is discarded, and this forward opens a
    fresh step."""

    def before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: not a training step
        if driver.is_open and not driver.backward_done:
            if not driver.only_unused_forwards():
                driver.forward_begins()
                return  # another forward of the same micro-batch
            driver.leave_out_unused()  # none of its forwards trained
        finish()
        driver.open((args, kwargs))
        driver.forward_begins()

    # First of the pre-forward hooks, so the step also times FSDP's root all-gather.
    return model.register_forward_pre_hook(before_forward, prepend=True, with_kwargs=True)
