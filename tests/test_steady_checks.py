"""A steady-state call runs from its cached tape only if its forward ran the tape's ops
(``tape/op_checks.py``): what a training loop or the data changes between calls, with the shapes
of every saved tensor the same, is a divergence, never a stale replay. Each case trains two
blocks under a must-only Controller for 24 steps, every step bitwise with the same model run
without checkpointing; calls whose Python numbers repeat run in steady state, those that changed
them diverge (and their backward runs the forward again)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import ScaledBySaved, assert_bitwise, block_paths, step

import tapesac_core
from tapesac_core.errors import TapeSACError
from tapesac_core.tape.op_checks import shown
from tapesac_core.tape.steady import Recorded

D = 8
STEPS = 24
GLOBAL = {"value": 1.0}


class Knob(torch.nn.Module):
    """A block whose forward reads a number that the loop or the data changes (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)
        self.drop = torch.nn.Dropout(0.1)
        self.scale = 1.0
        self.flag = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        kind = self.kind
        if kind == "attribute":
            h = h * self.scale
        elif kind == "dropout_p":
            h = self.drop(h)
        elif kind == "item_scalar":
            h = h * (int(x.argmax().item()) % 3 + 1)
        elif kind == "item_exponent":
            h = h.pow(int(x.argmax().item()) % 3 + 1)
        elif kind == "global":
            h = h * GLOBAL["value"]
        elif kind == "branch":
            # Both ops run either way, and make autograd nodes of one kind: only which one's
            # output the next op reads (and saves) changes.
            double, triple = h * 2.0, h * 3.0
            h = double if self.flag else triple
        return self.b(h).tanh() + x


def _change(models: list[Knob], i: int) -> None:
    """What the training loop changes before step ``i``: a value held for four steps, in three phases."""
    phase = (i // 4) % 3
    GLOBAL["value"] = 1.0 + 0.5 * phase
    for model in models:
        for block in model:
            block.scale = 1.0 + 0.25 * phase
            block.drop.p = (0.1, 0.2, 0.3)[phase]
            block.flag = phase != 1


def _batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, D, generator=g).requires_grad_()


@pytest.mark.parametrize(
    "kind", ["attribute", "dropout_p", "item_scalar", "item_exponent", "global", "branch"]
)
def test_numbers_the_loop_or_the_data_change_never_replay_a_stale_tape(kind: str) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(Knob(kind), Knob(kind))
    model = copy.deepcopy(reference)
    for block in model:
        tapesac_core.checkpoint_module(block)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    controller = tapesac_core.Controller(model, 0.0, warmup_steps=1, profile_steps=1)
    steady = diverged = 0
    for i in range(STEPS):
        _change([reference, model], i)
        x = _batch(i)
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        with controller.step(tokens=x.numel()) as report:
            got = step(model, lambda: model(x).pow(2).sum(), seed=i)
        assert_bitwise(ref, got)
        steady += report.steady_blocks
        diverged += report.diverged_blocks
        for optimizer in optimizers:
            optimizer.step()
    GLOBAL["value"] = 1.0
    assert steady > 0, "no call ran in steady state: the test checks nothing"
    assert diverged > 0, "no call departed from its tape: the loop changed nothing it saw"


class Swappable(torch.nn.Module):
    """Reads one of two parameters of one shape, as a module attribute says."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(D, D) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(D, D) * 0.3)
        self.first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ (self.w1 if self.first else self.w2)).sin()


def test_which_parameter_an_op_reads_is_checked() -> None:
    """``x @ w1`` and ``x @ w2`` are the same op on tensors of one shape: the check tells them
    apart by the parameter's name, and the call that switched is recomputed."""
    torch.manual_seed(0)
    reference = Swappable()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, D, requires_grad=True)
    paths = []
    for first in (True, True, False, False, False):
        reference.first = block.first = first
        ref = step(reference, lambda: reference(x).sum())
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).sum())
        assert_bitwise(ref, got)
        paths.append("diverged" if blocks[0].diverged else blocks[0].steady)
    assert paths == [False, True, "diverged", False, True]


@pytest.mark.parametrize(
    ("autocast", "message"),
    [
        # Checked at the torch-function level (``call_checks.py``).
        (False, "call 1 (Tensor.mul): argument 1 is 2.0, the tape's 1.0"),
        # Autocast on: checked op by op (``op_checks.py``; its casts are ops too).
        (True, "op 5 (aten.mul.Tensor): argument 1 is 2.0, the tape's 1.0"),
    ],
)
def test_a_divergence_names_the_call_or_op_and_the_argument(autocast: bool, message: str) -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Knob("attribute"))
    x = torch.randn(4, D, requires_grad=True)
    for scale in (1.0, 1.0, 2.0):
        block.scale = scale
        with tapesac_core.trace() as blocks, torch.autocast("cpu", enabled=autocast):
            block(x).sum().backward()
    assert blocks[0].diverged == message
    assert not blocks[0].steady


class Split(torch.nn.Module):
    """Splits its hidden state by a list of sizes the loop may change."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.sizes = [2] * 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.sin() for p in torch.split(self.a(x), self.sizes, dim=1)], 1)


def test_a_divergence_names_the_element_of_a_long_argument_that_differs() -> None:
    block = tapesac_core.checkpoint_module(Split())
    x = torch.randn(4, 64, requires_grad=True)
    for sizes in ([2] * 32, [2] * 32, [2] * 30 + [1, 3]):
        block.sizes = sizes
        with tapesac_core.trace() as blocks:
            block(x).sum().backward()
    assert blocks[0].diverged == "call 1 (split): argument 1[30] is 1, the tape's 2"


def test_a_message_shows_any_argument_in_a_short_line() -> None:
    assert shown(torch.UntypedStorage(256)) == "a storage of 256 bytes"  # not its 256 bytes
    assert shown(list(range(100))) == repr(list(range(100)))[:77] + "..."


def _paths(make: type[torch.nn.Module], calls: int, change: Any) -> list[str]:
    """``make()`` checkpointed against a copy without, ``change(model, i)`` applied to both
    before call ``i``: bitwise every call; the path each call took."""
    torch.manual_seed(0)
    reference = make()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    paths = []
    for i in range(calls):
        for m in (reference, block):
            change(m, i)
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(i), requires_grad=True)
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum(), seed=i)
        assert_bitwise(ref, got)
        paths.append(block_paths(blocks)[0])
    return paths


class SharedExternal(torch.nn.Module):
    """Two plain tensor attributes, one tensor when recorded: the tape holds the unsaved
    ``shift`` on the packed ``scale``'s storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.scale = self.shift = torch.ones(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.scale + self.shift).sin()


def _split_shift(m: SharedExternal, i: int) -> None:
    if i == 2:
        m.shift = torch.full((D,), 3.0)


def test_external_tensors_are_told_apart_by_storage() -> None:
    paths = _paths(SharedExternal, 4, _split_shift)
    assert paths == [str(Recorded.FIRST_CALL), "steady", "diverged", str(Recorded.FIRST_CALL)]


class Signed(torch.nn.Module):
    """``copysign`` by a product with ``z`` (the sign of every element is the sign of ``z``), or
    by ``v`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.z: Any = 0.0
        self.v = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.copysign(self.a(x), self.v).tanh()
        return torch.copysign(h, (self.b(x).abs() * self.z).real)


@pytest.mark.parametrize(
    "knob, before, after",
    [
        ("z", 0.0, -0.0),
        ("z", 0j, complex(-0.0, 0.0)),
        ("v", float("nan"), -float("nan")),
    ],
    ids=["minus_zero", "complex_minus_zero", "minus_nan"],
)
def test_numbers_equal_by_double_equals_but_not_by_sign_are_told_apart(
    knob: str, before: Any, after: Any
) -> None:
    def change(m: Signed, i: int) -> None:
        setattr(m, knob, before if i < 2 else after)

    paths = _paths(Signed, 4, change)
    assert paths == [str(Recorded.FIRST_CALL), "steady", "diverged", str(Recorded.FIRST_CALL)]


class Forked(torch.nn.Module):
    """Dropout under an RNG-state tracker (Megatron's ``fork``): the forward sets the default
    generator's state, with no op the dispatcher sees, and restores it after."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.drop = torch.nn.Dropout(0.5)
        self.state = torch.Generator().manual_seed(123).get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with self.fork():
            h = self.drop(h)
        return self.b(h).tanh()


def test_random_ops_replay_from_the_state_they_drew_from_whatever_set_it() -> None:
    """Steady-state calls read each random op's generator state as it is dispatched."""
    paths = _paths(Forked, 4, lambda m, i: None)
    assert paths == [str(Recorded.FIRST_CALL)] + ["steady"] * 3


class Ramped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.alpha = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.alpha + x).sin()


def _ramp(m: Ramped, i: int) -> None:
    m.alpha = min(i, 4) / 4  # a warm-up: 0, .25, .5, .75, then 1 for good


def test_a_schedule_that_settles_runs_in_steady_state_again() -> None:
    """Tapes whose first steady-state calls diverge twice in a row make the next calls record
    (4, then 8, ... 64 of them), not every call from then on."""
    paths = _paths(Ramped, 14, _ramp)
    assert "diverged" in paths and str(Recorded.GRAPH_DIFFERS) in paths
    assert paths[-3:] == ["steady"] * 3


class Pick(torch.autograd.Function):
    """Saves ``sin`` or ``cos`` of its input as ``flag`` says: both computed either way."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, flag: bool) -> torch.Tensor:
        a, b = h.sin(), h.cos()
        ctx.save_for_backward(a if flag else b)
        return h * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (saved,) = ctx.saved_tensors
        return g * saved, None


class Picking(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.flag = True
        self.counted = False  # the forward flips the flag itself, every call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        flag = self.calls % 2 == 0 if self.counted else self.flag
        return Pick.apply(self.a(x), flag).tanh()


@pytest.mark.parametrize("autocast", [False, True])
def test_what_a_custom_function_saves_is_checked_by_where_it_came_from(autocast: bool) -> None:
    """The same calls either way; only the saved tensor differs (same shape and dtype). Before,
    the step after the flag changed ran from the tape and saved the tape's choice: wrong
    gradients, silently, at both levels."""

    def flip(m: torch.nn.Module, i: int) -> None:
        m.flag = i < 2

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        paths = _paths(Picking, 4, flip)
    assert paths[1:3] == ["steady", "diverged"]


def test_a_run_in_backward_that_saves_another_tensor_is_refused() -> None:
    """A departed call's run in backward makes the same calls, but its Function saves the other
    tensor (the forward's counter moved): refused, where it would read what it saved."""
    block = tapesac_core.checkpoint_module(Picking())
    block.counted = True
    x = torch.randn(4, D, requires_grad=True)
    block(x).sum().backward()  # recorded, flag False
    with pytest.raises(TapeSACError, match="saved tensor 2 was made by other calls"):
        block(x).sum().backward()  # flag True: departs; its run in backward saves as False


class ScaledByAttribute(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.scale = torch.ones(1, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledBySaved.apply(self.a(x), self.scale.detach()).tanh()


@pytest.mark.parametrize("autocast", [False, True])
def test_a_saved_external_whose_sizes_follow_the_batch_stays_steady(autocast: bool) -> None:
    """A tensor the loop sets per batch, saved by a Function: its source is compared without
    its sizes, which its size template binds (found by a review: every call departed)."""
    torch.manual_seed(0)
    reference = ScaledByAttribute()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    paths = []
    for i, rows in enumerate((2, 3, 4, 5, 6, 7, 8)):
        for m in (reference, block):
            m.scale = torch.linspace(0.5, 1.5, D).repeat(rows, 1)
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(i), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref = step(reference, lambda: reference(x).float().sum(), seed=i)
            with tapesac_core.trace() as blocks:
                got = step(block, lambda: block(x).float().sum(), seed=i)
        assert_bitwise(ref, got)
        paths.append(block_paths(blocks)[0])
    assert paths[-3:] == ["steady"] * 3, paths


class SaveHalf(torch.autograd.Function):
    """Saves a view of its input (as fused kernels save ``q`` after a transpose)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h[:, : D // 2])
        return h * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (half,) = ctx.saved_tensors
        return g * half.repeat(1, 2)


class SavingAView(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SaveHalf.apply(self.a(x)).tanh()


def test_a_custom_function_saving_a_view_runs_in_steady_state() -> None:
    """The recorder's pack hook reads ``t._base``; where a Function saves, no torch function
    runs, and the call log took that read for a call of the forward: every steady call then
    departed (found by a review)."""
    assert _paths(SavingAView, 4, lambda m, i: None)[1:] == ["steady"] * 3
