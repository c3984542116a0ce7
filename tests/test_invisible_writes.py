"""Writes the dispatcher cannot see: found by the verifying step, then saved (mandatory)."""

import copy
import functools
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from support import FakeMeter, assert_bitwise, step

import tapesac_core
from tapesac_core.errors import TapeSACError
from tapesac_core.tape.tape import INVISIBLE_WRITE


@torch.library.custom_op("tapesac_test_invisible::bump", mutates_args=())
def bump(x: torch.Tensor) -> None:
    """Adds 1 to ``x`` in place although its schema says it writes nothing (a hidden write)."""
    x.add_(1)


class Inner(torch.nn.Module):
    def forward(self, x):
        h = x.sin()
        bump(h.detach())  # h now holds sin(x) + 1, unknown to the tape
        return h


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.inner(x) * x).tanh()  # the multiplication saves h


def test_a_hidden_write_is_found_by_the_verifying_step_then_saved(caplog) -> None:
    torch.manual_seed(0)
    module, x = Block(), torch.randn(4, 8, requires_grad=True)
    ref = step(module, lambda: module(x).sum())
    tapesac_core.checkpoint_module(module, region="hidden_write")
    with caplog.at_level(logging.WARNING), tapesac_core.trace(verify=True) as verifying:
        first = step(module, lambda: module(x).sum())
    assert verifying[0].invisible_writes == [("aten.sin.default", 0, 0)]
    assert "aten.sin.default" in caplog.text and "'inner'" in caplog.text
    assert not torch.equal(first[1]["proj.weight"], ref[1]["proj.weight"])  # replayed sin(x)
    with tapesac_core.trace() as blocks:
        got = step(module, lambda: module(x).sum())
    assert_bitwise(ref, got)
    tape = blocks[0].tape
    (sin,) = [v for v in tape.mandatory if tape.coord(v) == ("aten.sin.default", 0, 0)]
    assert tape.mandatory[sin] == INVISIBLE_WRITE


def test_the_verifying_step_finds_nothing_where_replay_is_exact(caplog) -> None:
    torch.manual_seed(0)
    module, x = Block(), torch.randn(4, 8, requires_grad=True)
    module.inner.forward = lambda x: x.sin() + 1  # the same values, written visibly
    ref = step(module, lambda: module(x).sum())
    tapesac_core.checkpoint_module(module, region="no_hidden_write")
    with caplog.at_level(logging.WARNING), tapesac_core.trace(verify=True) as blocks:
        got = step(module, lambda: module(x).sum())
    assert_bitwise(ref, got)
    assert blocks[0].invisible_writes == [] and "dispatcher" not in caplog.text
    assert blocks[0].replayed  # replay ran, and was compared


def test_the_controller_looks_for_hidden_writes_in_its_first_step_only(caplog) -> None:
    torch.manual_seed(0)
    module, x = Block(), torch.randn(4, 8, requires_grad=True)
    ref = step(module, lambda: module(x).sum())
    tapesac_core.checkpoint_module(module, region="hidden_write_controller")
    controller = tapesac_core.Controller(module, "1GiB", meter=FakeMeter(), warmup_steps=2)
    reports = []
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # warm-up (verifying), warm-up, profile
            with controller.step(tokens=4) as report:
                got = step(module, lambda: module(x).sum())
            reports.append(report)
    assert [r.block_traces[0].invisible_writes for r in reports] == [
        [("aten.sin.default", 0, 0)],
        [],
        [],
    ]
    assert caplog.text.count("out of the dispatcher's sight") == 1
    assert_bitwise(ref, got)


def test_a_fingerprint_sees_a_changed_or_moved_element_beyond_its_first_chunk() -> None:
    from tapesac_core.tape.verify import fingerprint

    t = torch.randn(3 << 20)  # three chunks
    changed, swapped = t.clone(), t.clone()
    changed[-1] += 1
    swapped[[1, -1]] = swapped[[-1, 1]]
    assert torch.equal(fingerprint(t), fingerprint(t.clone()))
    assert not torch.equal(fingerprint(t), fingerprint(changed))
    assert not torch.equal(fingerprint(t), fingerprint(swapped))


def _verified(region: str = "hidden_write") -> tuple[Block, torch.Tensor]:
    """A checkpointed Block whose hidden write a verifying step found."""
    torch.manual_seed(0)
    module, x = Block(), torch.randn(4, 8, requires_grad=True)
    tapesac_core.checkpoint_module(module, region=region)
    with tapesac_core.trace(verify=True) as verifying:
        step(module, lambda: module(x).sum())
    assert verifying[0].invisible_writes == [("aten.sin.default", 0, 0)]
    return module, x


def _mandatory_coords(module: Block, x: torch.Tensor) -> set:
    with tapesac_core.trace() as blocks:
        step(module, lambda: module(x).sum())
    tape = blocks[0].tape
    return {tape.coord(v) for v, why in tape.mandatory.items() if why == INVISIBLE_WRITE}


def test_two_models_in_one_process_keep_their_own_findings() -> None:
    found, x = _verified()
    torch.manual_seed(0)
    other = tapesac_core.checkpoint_module(Block(), region="hidden_write")  # same region name
    other.inner.forward = lambda x: x.sin() + 1  # no hidden write in this one
    assert _mandatory_coords(found, x) == {("aten.sin.default", 0, 0)}
    assert _mandatory_coords(other, x) == set()  # the first model's finding is not its own


def test_a_controller_state_keeps_the_findings_for_a_resumed_run() -> None:
    found, x = _verified()
    controller = tapesac_core.Controller(found, "1GiB", meter=FakeMeter())
    state = controller.state_dict()
    assert state["hidden_writes"] == {"hidden_write": [["aten.sin.default", 0, 0]]}
    torch.manual_seed(0)
    resumed = Block()
    ref = step(resumed, lambda: resumed(x).sum())  # without checkpointing
    tapesac_core.checkpoint_module(resumed, region="hidden_write")
    restored = tapesac_core.Controller(resumed, "1GiB", meter=FakeMeter(), warmup_steps=0)
    restored.load_state_dict(state)
    # Its first step saves the output the hidden write changed: exact without verifying again.
    with restored.step(tokens=4) as report:
        got = step(resumed, lambda: resumed(x).sum())
    assert report.block_traces[0].invisible_writes == []
    assert_bitwise(ref, got)


class RReLU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.rrelu(self.proj(x), training=True).sin()


def test_a_write_without_a_version_bump_is_what_backward_reads() -> None:
    """aten.rrelu_with_noise fills ``noise``, which autograd saved before the op, without
    bumping its version: autograd reads the written noise, so the block must give it that
    (it gave the allocation's content before the write, and wrong gradients, every call)."""
    torch.manual_seed(0)
    module, x = RReLU(), torch.randn(4, 8, requires_grad=True)
    refs = [step(module, lambda: module(x).sum(), seed=s) for s in range(3)]
    tapesac_core.checkpoint_module(module, region="rrelu")
    for plan in ({}, {"rrelu": {("aten.rrelu_with_noise.default", 0, 0)}}):
        with tapesac_core.use_plan(plan), tapesac_core.trace():
            for s in range(3):
                assert_bitwise(refs[s], step(module, lambda: module(x).sum(), seed=s))


class Viewed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        noise = torch.empty_like(h)
        y = h[:2] * noise[:2].zero_()  # autograd saves the view of noise
        return torch.ops.aten.rrelu_with_noise(h, noise, 0.1, 0.3, True).sum() + y.sum()


def test_a_view_saved_before_a_write_without_a_version_bump_reads_what_was_written() -> None:
    """Autograd reads the view's bytes as the write left them: the view is read again from
    the write (an alias value), as a tensor written through another alias is."""
    torch.manual_seed(0)
    module, x = Viewed(), torch.randn(4, 8, requires_grad=True)
    refs = [step(module, lambda: module(x), seed=s) for s in range(2)]
    tapesac_core.checkpoint_module(module, region="viewed")
    with tapesac_core.trace() as traces:
        for s in range(2):
            assert_bitwise(refs[s], step(module, lambda: module(x), seed=s))
    assert any(n.name == "tapesac.alias" for n in traces[0].tape.nodes)


def assert_three_calls_bitwise(cls: Callable[[], torch.nn.Module], region: str, plan: dict) -> None:
    """Three calls of a checkpointed copy of ``cls()`` under ``plan`` (recorded, then steady),
    each on a new batch, bitwise those of the module without checkpointing."""
    torch.manual_seed(0)
    reference = cls()
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region=region)
    with tapesac_core.use_plan(plan), tapesac_core.trace():
        for s in range(3):
            x = torch.randn(4, 8, requires_grad=True)
            ref = step(reference, lambda: reference(x).square().sum(), seed=s)
            assert_bitwise(ref, step(module, lambda: module(x).square().sum(), seed=s))


class DataWritten(torch.nn.Module):
    """Writes a saved tensor through ``.data``, whose version counter is not the tensor's:
    autograd reads the written bytes with no error. ``dropped``: after dropping the tensor,
    where only its storage tells where the write lands."""

    def __init__(self, dropped: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.dropped = dropped

    def forward(self, x):
        h = self.a(x)
        y = h.sin()  # saves h
        if self.dropped:
            d = h.data
            del h
            d.clamp_(-0.1, 0.1)
            return self.b(y)
        h.data.clamp_(-0.1, 0.1)
        return self.b(y + h.cos())  # cos reads (and saves) h as written


@pytest.mark.parametrize("plan", [{}, {"written": {("aten.addmm.default", 0, 0)}}])
@pytest.mark.parametrize("dropped", [False, True])
def test_a_saved_tensor_written_through_data_is_what_backward_reads(plan, dropped: bool) -> None:
    assert_three_calls_bitwise(functools.partial(DataWritten, dropped), "written", plan)


class Retargeted(torch.nn.Module):
    """Points a new tensor at a saved tensor's bytes with ``set_`` and writes through it."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.source = source

    def forward(self, x):
        h = self.a(x)
        y = h.sin()
        if self.source == "storage":
            d = torch.empty(0).set_(h.untyped_storage(), 0, h.shape, h.stride())
        else:
            d = torch.empty(0).set_(h)
        d.mul_(2)
        return self.b(y)


@pytest.mark.parametrize("source", ["storage", "tensor"])
def test_set_inside_a_forward_is_refused_naming_the_fix(source: str) -> None:
    # Replay cannot follow a tensor set_ points elsewhere (a storage argument would even be the
    # recorded call's): before, the gradients were wrong, silently.
    module = tapesac_core.checkpoint_module(Retargeted(source), region="set")
    with pytest.raises(
        TapeSACError, match=r"aten\.set_.*other bytes.*Fix: make the tensor as a view"
    ):
        module(torch.randn(4, 8, requires_grad=True))


class DataSwapped(torch.nn.Module):
    """Swaps a tensor's storage with ``.data =`` (no op, no version bump) inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.register_buffer("other", torch.randn(4, 8))
        self.register_buffer("low", torch.randn(4, 8, dtype=torch.bfloat16))
        self.swap: bool | str = True

    def forward(self, x):
        h = self.a(x)
        if self.swap == "buffer":
            h.data = self.other * 1.0
        elif self.swap == "as_is":  # under autocast: no op at all
            h.data = self.low
        elif self.swap == "transposed":  # a square h: the same address in another layout
            h.data = h.data.t()
        elif self.swap:
            h.data = h.data.clamp(-0.5, 0.5)
        return self.b(h.sin())  # sin saves h: what it holds after the swap


@pytest.mark.parametrize("plan", [{}, {"swapped": {("aten.addmm.default", 0, 0)}}])
def test_a_storage_swapped_with_data_inside_the_forward_is_what_backward_reads(plan) -> None:
    """The tape took ``h`` for the linear's output after the swap (same object, same version)
    and replayed the linear: wrong gradients on every call, silently."""
    torch.manual_seed(0)
    reference = DataSwapped()
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="swapped")
    swaps: list[bool | str] = [True, True, True, False, False, True, "buffer", "buffer", True]
    with tapesac_core.use_plan(plan), tapesac_core.trace() as traces:
        for s, swap in enumerate(swaps):
            x = torch.randn(4, 8, requires_grad=True)
            reference.swap = module.swap = swap
            ref = step(reference, lambda: reference(x).square().sum(), seed=s)
            assert_bitwise(ref, step(module, lambda: module(x).square().sum(), seed=s))
    assert sum(t.steady for t in traces) >= 3  # calls like the one before run in steady state


@pytest.mark.parametrize("level", ["calls", "ops"])
def test_a_tensor_moved_to_another_layout_at_its_address_is_what_backward_reads(level) -> None:
    """``h.data = h.data.t()`` on a square ``h`` keeps its data address: the recorder took ``h``
    for the linear's output after the move (wrong gradients on every call, silently)."""
    torch.manual_seed(0)
    reference = DataSwapped()
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="transposed")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    swaps: list[bool | str] = ["transposed", "transposed", "transposed", False, "transposed"]
    with tapesac_core.trace() as traces:
        for s, swap in enumerate(swaps):
            x = torch.randn(8, 8, requires_grad=True)
            reference.swap = module.swap = swap
            with autocast:
                ref = step(reference, lambda: reference(x).float().square().sum(), seed=s)
                got = step(module, lambda: module(x).float().square().sum(), seed=s)
            assert_bitwise(ref, got)
    assert traces[1].steady and traces[2].steady  # calls like the one before


def _trains_bitwise(make: Callable[[], torch.nn.Module], level: str, steps: int = 3) -> None:
    """``steps`` steps of a checkpointed ``make()`` bitwise against one without checkpointing,
    call by call (``level`` "calls") or op by op under autocast ("ops")."""
    torch.manual_seed(0)
    reference = make()
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="moved")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    for s in range(steps):
        x = torch.randn(4, 8, requires_grad=True)
        with autocast:
            ref = step(reference, lambda: reference(x).float().square().sum(), seed=s)
            got = step(module, lambda: module(x).float().square().sum(), seed=s)
        assert_bitwise(ref, got)


class BitMoved(torch.nn.Module):
    """Moves a tensor to its conjugate or negative view with ``.data =``: the same address,
    strides, shape and dtype, another bit."""

    def __init__(self, bit: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.bit = bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).float()
        if self.bit == "neg":
            g = h * 1.0
            g.data = torch._neg_view(g.data)
            return (g.sin() * h).sum(-1)
        z = torch.complex(h, h * 0.5)
        z.data = z.data.conj()
        return (z * (torch.linspace(-1, 1, 8, dtype=torch.complex64) * 1j + 0.3)).abs()


@pytest.mark.parametrize("bit, level", [("neg", "calls"), ("neg", "ops"), ("conj", "calls")])
def test_a_tensor_moved_to_its_conjugate_or_negative_view_is_what_backward_reads(bit, level):
    """Found by review: the recorder knew a tensor by layout but not by these bits (wrong
    gradients on every call). Complex numbers have no bfloat16 autocast: conj is calls only."""
    _trains_bitwise(lambda: BitMoved(bit), level)


class ParametersMoved(torch.nn.Module):
    """Parameters moved with ``.data =`` inside the forward, as real code does: standardised
    through ``.data`` before use, or released after use (to other bytes, the same values) as
    ZeRO-3 does before it gathers them again for backward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.how = how
        if how == "released":
            for m in (self.a, self.b):
                m.register_forward_hook(self._release)

    @staticmethod
    def _release(module: torch.nn.Module, args: Any, out: Any) -> None:
        for p in module.parameters():
            p.data = p.data.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "standardised":
            w = self.a.weight.data
            self.a.weight.data = (w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + 1e-5)
        return self.b(self.a(x).sin())


@pytest.mark.parametrize("how", ["standardised", "released"])
@pytest.mark.parametrize("level", ["calls", "ops"])
def test_parameters_moved_inside_the_forward_as_real_code_does_train_bitwise(how, level):
    """Backward fetches parameters by name, as FSDP2 and ZeRO-3 need (a refusal of moves after
    a read, tried this session, refused these; found by review)."""
    _trains_bitwise(lambda: ParametersMoved(how), level)


class ReadsMask(torch.nn.Module):
    def __init__(self, saved: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.__dict__["mask"] = torch.rand(8) + 0.5  # a plain tensor read from outside
        self.saved = saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # a product saves the mask; a sum does not (replay alone reads it)
        return (h * self.mask if self.saved else h + self.mask).sin()


@pytest.mark.parametrize("saved", [True, False])
@pytest.mark.parametrize("level", ["calls", "ops"])
def test_a_tensor_read_from_outside_moved_before_backward_is_refused_where_saved(saved, level):
    """Plain autograd reads a tensor it saved where it is at backward, the block kept it where
    it was: wrong gradients before (found by review). One autograd did not save, which the
    block keeps for replay only, is read as the forward read it, as plain autograd did."""
    torch.manual_seed(0)
    reference = ReadsMask(saved)
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="mask")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if level == "ops" else nullcontext()
    x = torch.randn(4, 8, requires_grad=True)
    with autocast:
        expected, loss = reference(x).float().sum(), module(x).float().sum()
    for m in (reference, module):
        m.mask.data = m.mask.data * 2  # no version bump
    if saved:
        with pytest.raises(TapeSACError, match="read from outside the block was moved"):
            loss.backward()
        return
    assert_bitwise(step(reference, lambda: expected), step(module, lambda: loss))


def test_a_storage_swapped_with_data_on_some_calls_only_makes_those_calls_diverge() -> None:
    """Under autocast a steady-state call is checked op by op, and ``h.data = self.low``
    dispatches no op: only the swapped tensor's data address tells the call from its tape."""
    torch.manual_seed(0)
    reference = DataSwapped()
    module = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="swapped")

    def loss(m: DataSwapped, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        return y.float().square().sum()

    swaps: list[bool | str] = [False, False, "as_is", "as_is", False]
    with tapesac_core.trace() as traces:
        for s, swap in enumerate(swaps):
            x = torch.randn(4, 8, requires_grad=True)
            reference.swap = module.swap = swap
            ref = step(reference, lambda: loss(reference, x), seed=s)
            assert_bitwise(ref, step(module, lambda: loss(module, x), seed=s))
    assert [bool(t.diverged) for t in traces] == [False, False, True, False, True]


class Halves(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        noise = torch.empty(2, *h.shape)  # one buffer, each call writing its own half
        a = torch.ops.aten.rrelu_with_noise(h, noise[0], 0.1, 0.3, True)
        b = torch.ops.aten.rrelu_with_noise(h * 2, noise[1], 0.1, 0.3, True)
        return (a * b).sin()


def test_writes_without_a_version_bump_into_disjoint_views_are_what_backward_reads() -> None:
    """The second write leaves the first half, saved before it, as it was: no refusal."""
    torch.manual_seed(0)
    module, x = Halves(), torch.randn(4, 8, requires_grad=True)
    refs = [step(module, lambda: module(x).sum(), seed=s) for s in range(2)]
    tapesac_core.checkpoint_module(module, region="halves")
    with tapesac_core.trace():
        for s in range(2):
            assert_bitwise(refs[s], step(module, lambda: module(x).sum(), seed=s))


class RunningStats(torch.nn.Module):
    """Batch norm over running statistics made inside the block, one of them saved before
    ``aten.native_batch_norm`` updates it: a write its schema does not declare, with no
    version bump, so autograd reads the updated statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.proj(x)
        mean, var = torch.zeros(8) + 0.5, torch.ones(8) * 2
        y = h * mean
        z = torch.nn.functional.batch_norm(h, mean, var, training=True)
        return (y + z * var + self.norm(h)).sin()


def test_undeclared_writes_of_batch_norm_are_what_backward_reads() -> None:
    torch.manual_seed(0)
    module, x = RunningStats().eval(), torch.randn(4, 8, requires_grad=True)  # self.norm: eval
    refs = [step(module, lambda: module(x).sum(), seed=s) for s in range(3)]
    tapesac_core.checkpoint_module(module, region="stats")
    keep = {"stats": {("aten.add.Tensor", 0, 0), ("aten.mul.Tensor", 0, 0)}}  # keeps mean
    for plan in ({}, keep):
        with tapesac_core.use_plan(plan), tapesac_core.trace():
            for s in range(3):
                assert_bitwise(refs[s], step(module, lambda: module(x).sum(), seed=s))


def test_batch_norm_updating_its_buffers_in_training_is_refused_naming_the_fix() -> None:
    class Normed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(8, momentum=0.1)

        def forward(self, x):
            n = self.norm
            return torch.nn.functional.batch_norm(
                x, n.running_mean, n.running_var, n.weight, n.bias, training=True
            ).sin()

    module = tapesac_core.checkpoint_module(Normed(), region="normed")
    with pytest.raises(TapeSACError, match="running_mean.*checkpoint the modules around"):
        module(torch.randn(4, 8, requires_grad=True))


class WrittenAfterSwapsAndViews(torch.nn.Module):
    """A tensor moved off ``h``'s storage (``o.data = ...``) before ``h`` is written through
    ``.data`` keeps its own bytes; a view of ``h`` saved and freed before the write reads the
    written bytes, as autograd holds it (its base's counter did not move)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        o = h.detach()
        o.data = self.c(x).detach()
        y = h[:, :4].sin()  # saves a view of h, freed at once
        h.data.clamp_(-0.1, 0.1)
        return self.b(x) * o + h + y.sum()


@pytest.mark.parametrize("plan", [{}, {"swapped": {("aten.addmm.default", 0, 0)}}])
def test_a_write_through_data_reaches_what_is_on_the_storage_and_nothing_else(plan) -> None:
    assert_three_calls_bitwise(WrittenAfterSwapsAndViews, "swapped", plan)
