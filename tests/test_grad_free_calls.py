"""Calls that leave the gradients alone (``tape/grad_free.py``): a monitoring hook that runs on
some steps only no longer stops training. Before, each step the hook ran on departed from its
tape, and its backward's run of the forward (the hook's counter moved on) was refused with a
``TapeSACError`` where ``torch.utils.checkpoint`` is right. Now that run may skip the forward's
grad-free calls, and a tape recorded while the hook ran serves the steps it does not; at the
call level and, under autocast, at the op level. What the skipping must never let through (a
mask read by a product, a custom ``autograd.Function`` saving what such calls made, a random
draw) departs or is refused, never wrong."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from support import ScaledBySaved, assert_bitwise, block_paths, step

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
    input_grad: bool = True,
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
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(i))
            x.requires_grad_(input_grad)
            with autocast:
                ref = step(reference, lambda: reference(x).square().sum(), seed=i)
            with tapesac_core.trace() as blocks, autocast:
                got = step(block, lambda: block(x).square().sum(), seed=i)
            assert_bitwise(ref, got)
            paths.append(block_paths(blocks)[0])
    return paths, logs[0], logs[1]


def _mean(out: torch.Tensor) -> float:
    return out.detach().abs().mean().item()


def _mean_without_grad(out: torch.Tensor) -> float:
    with torch.no_grad():  # its arguments require grad, its outputs do not
        return out.abs().mean().item()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("plan", [None, {"block": {("aten.addmm.default", 0, 0)}}])
@pytest.mark.parametrize("stat", [_mean, _mean_without_grad])
def test_a_monitoring_hook_on_some_steps_trains_bitwise(level: str, plan, stat) -> None:
    paths, expected, logged = _run(Block, lambda log: every(3, 3, stat, log), level, 9, plan)
    # The hook runs on step 2: that step departs, and its backward's run of the forward (the
    # hook's counter at 4) skips the hook's calls. Its counter runs one ahead from there, as
    # under torch's checkpoint, which runs the forward again too: it runs on steps 4 and 6.
    assert paths[1:3] == ["steady", "diverged"]
    assert [i for i, p in enumerate(paths) if p == "diverged"] == [2, 4, 6]
    assert logged[0] == expected[0] and len(logged) == 4


@pytest.mark.parametrize("level", LEVELS)
def test_a_monitoring_hook_reading_a_tensor_from_outside_the_block_trains_bitwise(level) -> None:
    """The run in backward skips the hook's calls, and so its read of ``target``: before, that
    run was refused for reading other tensors from outside the block than the forward."""
    target = torch.randn(4, D)

    def error(out: torch.Tensor) -> float:
        return (out.detach() - target).abs().mean().item()

    paths, expected, logged = _run(Block, lambda log: every(3, 3, error, log), level, 7)
    assert [i for i, p in enumerate(paths) if p == "diverged"] == [2, 4, 6]
    assert logged[0] == expected[0]


@pytest.mark.parametrize("level", LEVELS)
def test_a_hook_reading_another_view_of_an_outside_storage_than_the_forward_trains(level):
    """The hook reads row 1 of an outside tensor, the block row 0: its run in backward meets row
    0 first, which the forward met second (found by review: refused, where it is right)."""
    row0, row1 = torch.rand(2, D) + 0.5  # two views of one storage, made once

    class Scaled(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * row0).float()

    def error(out: torch.Tensor) -> float:
        return (out.detach() - row1).abs().mean().item()

    paths, expected, logged = _run(Scaled, lambda log: every(3, 3, error, log), level, 7)
    assert [i for i, p in enumerate(paths) if p == "diverged"] == [2, 4, 6]


class Masked(Block):
    def __init__(self) -> None:
        super().__init__()
        self.__dict__["mask"] = torch.rand(D) + 0.5  # a plain tensor read from outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu() * self.mask).float()


@pytest.mark.parametrize("level", LEVELS)
def test_a_run_in_backward_reading_a_tensor_moved_since_the_forward_is_refused(level) -> None:
    """The hook's step departs; before its backward the loop moves ``mask`` (``.data =``, no
    version bump): its run of the forward would read it moved (found by review: accepted)."""
    block = Masked()
    target = torch.randn(4, D)
    block.a.register_forward_hook(every(3, 3, lambda out: (out.detach() - target).sum(), []))
    tapesac_core.checkpoint_module(block, region="block")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    for i in range(3):
        with autocast, tapesac_core.trace() as traces:
            loss = block(torch.randn(4, D, requires_grad=True)).square().sum()
        if i < 2:
            loss.backward()
    assert traces[0].diverged
    block.mask.data = block.mask.data * 2
    with pytest.raises(TapeSACError, match="outside the block was moved"):
        loss.backward()


@pytest.mark.parametrize("level", LEVELS)
def test_a_tape_recorded_while_the_hook_ran_serves_the_steps_it_does_not(level: str) -> None:
    def detached(out: torch.Tensor) -> torch.Tensor:  # kept as a tensor: no host read
        return out.detach().abs().mean()

    paths, expected, logged = _run(Block, lambda log: every(4, 1, detached, log), level, 6)
    assert paths[1:] == ["steady"] * 5  # steps 0 (recorded) and 4 ran the hook
    assert [t.item() for t in logged] == [t.item() for t in expected]  # no run in backward


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


def test_a_router_monitor_in_an_eager_experts_moe_trains_bitwise() -> None:
    """Where sizes follow the routing (``data_sizes.py``): a hook logging the router's output
    every 5 calls (step 4, then one step later for each of its steps that departed) was refused
    at its first steady step."""
    pytest.importorskip("transformers")
    from moe_families import VOCAB, moe_model
    from support import token_ids
    from test_moe_families import _lockstep

    reference, layer = moe_model("qwen3_moe", "eager")
    reference.config.use_cache = False
    model = copy.deepcopy(reference)
    logs: tuple[list, list] = ([], [])
    for m, log in zip((reference, model), logs):
        for name, module in m.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(every(5, 5, lambda out: _mean(out[0]), log))
    tapesac_core.checkpoint_modules(model, {layer})
    step = _lockstep(reference, model)
    paths = []
    for i in range(10):
        with tapesac_core.trace() as blocks:
            step(token_ids(i, batch=2, seq=24, vocab=VOCAB), i)  # bitwise, or it raises
        paths.append(["steady" if b.steady else b.diverged for b in blocks])
    assert paths[4] == [None, None] or "steady" not in paths[4], paths  # the hook's step
    assert logs[1][:2] == logs[0][:2]


class ScheduledClip(torch.autograd.Function):
    """A straight-through sign: saves the mask ``|h| <= clip``, made without grad."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, clip: float) -> torch.Tensor:
        ctx.save_for_backward(h.abs() <= clip)
        return torch.sign(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        return g * mask, None


class Binarized(Block):
    def __init__(self) -> None:
        super().__init__()
        self.clip = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(ScheduledClip.apply(self.a(x), self.clip)).float()


@pytest.mark.parametrize("level", LEVELS)
def test_a_custom_function_saving_a_mask_from_a_scheduled_number_departs(level: str) -> None:
    """Inside ``Function.forward`` grad mode is off, but the comparison reads the input, which
    requires grad: not grad-free (found by a review: passed over, it was saved as the tape's
    old mask, wrong from the schedule's change on)."""

    def clip(block: Block, i: int) -> None:
        block.clip = 1.0 if i < 2 else 0.25

    paths, _, _ = _run(Binarized, None, level, 5, change=clip)
    assert paths[1:3] == ["steady", "diverged"] and paths[4] == "steady"


class Reports(Block):
    """Returns beside its output the mask a product saved, or on some steps its input."""

    def __init__(self) -> None:
        super().__init__()
        self.report_input = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        mask = (h.detach() > 0).to(h.dtype)
        return self.b(h * mask).float(), x.detach() if self.report_input else mask


@pytest.mark.parametrize("level", LEVELS)
def test_an_output_that_is_another_tensor_than_the_tapes_is_not_taken_alive(level: str) -> None:
    """Backward takes a block output that is a saved value alive, instead of replaying it; a
    step returning its input there (the same calls otherwise) gave backward the input as the
    mask: wrong gradients, silently (found by a review; older than grad-free calls)."""
    torch.manual_seed(0)
    reference = Reports()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="block")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    kept = []  # a logger keeping what the block reported, alive through backward
    for i in range(4):
        for m in (reference, block):
            m.report_input = i == 2
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(i), requires_grad=True)

        def loss(m: torch.nn.Module) -> torch.Tensor:
            out, report = m(x)
            kept.append(report)
            return out.square().sum()

        with autocast:
            ref = step(reference, lambda: loss(reference), seed=i)
        with tapesac_core.trace() as blocks, autocast:
            got = step(block, lambda: loss(block), seed=i)
        assert_bitwise(ref, got)
        assert blocks[0].steady == (i > 0)


@pytest.mark.parametrize("level", LEVELS)
def test_a_hook_under_inference_mode_is_no_crash(level: str) -> None:
    """Inference tensors have no version to read: such calls are not grad-free. The step the
    hook runs on departs, and its run in backward, without the hook, is refused, as before."""

    def stat(out: torch.Tensor) -> float:
        with torch.inference_mode():
            return out.detach().abs().mean().item()

    with pytest.raises(TapeSACError, match="ran differently when run again in backward"):
        _run(Block, lambda log: every(3, 3, stat, log), level, 3)


class Scaled(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@pytest.mark.parametrize("level", LEVELS)
def test_a_run_in_backward_that_makes_a_call_the_forward_skipped_is_refused(level: str) -> None:
    """The tape was recorded while the hook ran (step 0); step 3 skips its calls, then departs
    (a new scale), and in its run in backward the hook (counter moved on) runs: its calls are
    the tape's, but not the forward's. Accepted, the hook's state moved twice (found by a
    review); refused, as a call only the run makes is."""

    def scale(block: Block, i: int) -> None:
        block.scale = 1.0 if i < 3 else 0.5

    def detached(out: torch.Tensor) -> torch.Tensor:
        return out.detach().abs().mean()

    with pytest.raises(TapeSACError, match="none there \\(a grad-free call it skipped\\)"):
        _run(Scaled, lambda log: every(4, 1, detached, log), level, 4, change=scale)


class Frozen(Block):
    def __init__(self) -> None:
        super().__init__()
        self.a.requires_grad_(False)


@pytest.mark.parametrize("level", LEVELS)
def test_a_hook_call_returning_its_argument_leaves_its_source(level: str) -> None:
    """``out.float()`` of a float output that needs no grad (a frozen first layer, an input
    that needs none) returns ``out``: a call of the tape that does so no longer gives the
    block's own tensor a new source, which steps without the hook then read from elsewhere
    (refused before, found by a review)."""

    def as_float(out: torch.Tensor) -> torch.Tensor:
        return out.float().abs().mean()

    hook = lambda log: every(4, 1, as_float, log)  # noqa: E731
    paths, expected, logged = _run(Frozen, hook, level, 6, input_grad=False)
    assert paths[1:] == ["steady"] * 5
    assert [t.item() for t in logged] == [t.item() for t in expected]


class DoubleBuffered(Block):
    """Uses the previous refresh's mask; on a refresh, computes the next one without grad. A
    custom Function saves the mask it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.refresh = False
        self.register_buffer("mask", torch.ones(4, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = self.mask
        if self.refresh:
            self.refresh = False  # the run in backward does not refresh
            self.mask = (h.detach().abs() > 0.3).to(h.dtype)
        return self.b(ScaledBySaved.apply(h, mask)).float()


@pytest.mark.parametrize("level", LEVELS)
def test_a_run_in_backward_saving_another_tensor_is_never_read(level: str) -> None:
    """The run in backward skips the refresh and hands the Function the new mask (found by a
    review: read by backward, silently). Each step is bitwise, or refused."""

    def refresh(block: Block, i: int) -> None:
        block.refresh = i == 2

    try:
        paths, _, _ = _run(DoubleBuffered, None, level, 4, change=refresh)
    except TapeSACError as e:
        assert "saved tensor 2 was made by other calls than the forward's" in str(e)
    else:
        assert paths[2] == "diverged"
