"""The checkpoint contract: clear errors for unsupported use, and the cases that must just work."""

import logging

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from support import assert_bitwise, require_deterministic, step

import tapesac_core
from tapesac_core import TapeSACError


class Block(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.register_buffer("offset", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * x + self.offset


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()

    def forward(self, x):
        return self.inner(x).sin()


def _x():
    return torch.randn(4, 8, requires_grad=True)


def test_nested_blocks_are_an_error_naming_both() -> None:
    model = Stack()
    tapesac_core.checkpoint_modules(model, {Block})
    tapesac_core.checkpoint_module(model, region="outer")
    with pytest.raises(TapeSACError, match=r"block 'inner' is nested inside checkpointed block 'Stack'"):
        model(_x())


def test_checkpoint_modules_skips_modules_inside_selected_ones() -> None:
    model = Stack()
    assert tapesac_core.checkpoint_modules(model, lambda m: isinstance(m, (Stack, Block))) == [""]


def test_reentrant_checkpoint_around_a_block_is_an_error() -> None:
    block = tapesac_core.checkpoint_module(Block())
    out = torch_checkpoint.checkpoint(block, _x(), use_reentrant=True)
    with pytest.raises(TapeSACError, match="ran during a backward pass"):
        out.sum().backward()


def test_non_reentrant_torch_checkpoint_around_a_block_is_an_error() -> None:
    block = tapesac_core.checkpoint_module(Block())
    with pytest.raises(TapeSACError, match="runs inside torch.utils.checkpoint"):
        torch_checkpoint.checkpoint(block, _x(), use_reentrant=False)


def test_backward_inside_a_block_forward_is_an_error() -> None:
    def grad_inside(x):
        y = x.exp()
        (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        return y * g

    with pytest.raises(TapeSACError, match="Reentrant use is not supported"):
        tapesac_core.checkpoint(grad_inside, _x())


def test_double_backward_is_a_clear_error() -> None:
    block = tapesac_core.checkpoint_module(Block())
    x = _x()
    with pytest.raises(TapeSACError, match="create_graph=True"):
        torch.autograd.grad(block(x).sum(), x, create_graph=True)


def _scale_weight(self, x):
    with torch.no_grad():
        self.proj.weight.mul_(1.0)
    return self.proj(x)


@pytest.mark.parametrize("body, what", [
    (lambda self, x: x.add_(1.0) * 2, "block input 0"),
    (_scale_weight, "param 'proj.weight'"),
    (lambda self, x: self.offset.add_(1.0) * x, "buffer 'offset'"),
], ids=["input", "parameter", "buffer"])
def test_writing_into_a_block_input_parameter_or_buffer_is_an_error(body, what) -> None:
    class Mutates(Block):
        forward = body

    block = tapesac_core.checkpoint_module(Mutates())
    with pytest.raises(TapeSACError, match=f"aten.*writes in place into {what}"):
        block(_x().clone())


def test_a_plan_coordinate_the_block_lacks_is_a_warning_naming_it(caplog) -> None:
    block = tapesac_core.checkpoint_module(Block())
    with caplog.at_level(logging.WARNING), tapesac_core.use_plan(
            {"Block": {("aten.mm.default", 5, 0), ("aten.tanh.default", 0, 0)}}):
        block(_x())
    assert "('aten.mm.default', 5, 0)" in caplog.text
    assert "aten.tanh" not in caplog.text


def test_a_malformed_plan_is_an_error() -> None:
    with pytest.raises(TapeSACError, match="is not a coordinate"):
        with tapesac_core.use_plan({"Block": ["aten.mm.default"]}):
            pass


def test_tensor_subclasses_inside_a_block_are_an_error() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(4), torch.randn(4)).requires_grad_()
    with pytest.raises(TapeSACError, match="tensor subclass TwoTensor"):
        tapesac_core.checkpoint(torch.sin, x)


def test_a_policy_matching_nothing_or_of_the_wrong_type_is_an_error() -> None:
    with pytest.raises(TapeSACError, match="matches no module"):
        tapesac_core.checkpoint_modules(Stack(), {torch.nn.Conv2d})
    with pytest.raises(TypeError, match="policy must be"):
        tapesac_core.checkpoint_modules(Stack(), "Block")
    with pytest.raises(TapeSACError, match="already checkpointed"):
        tapesac_core.checkpoint_module(tapesac_core.checkpoint_module(Block()))


def test_without_grad_a_block_runs_plainly() -> None:
    block = tapesac_core.checkpoint_module(Block())
    with torch.no_grad(), tapesac_core.trace() as blocks:
        block(_x())
    assert blocks == []


def test_in_eval_mode_with_grad_a_block_is_still_checkpointed() -> None:
    torch.manual_seed(0)
    block = Block().eval()
    x = _x()
    ref = step(block, lambda: block(x).sum())
    tapesac_core.checkpoint_module(block)
    with tapesac_core.trace() as blocks:
        got = step(block, lambda: block(x).sum())
    assert_bitwise(ref, got)
    assert len(blocks) == 1 and blocks[0].replayed


def test_retain_graph_replays_again_and_autograd_grad_works() -> None:
    torch.manual_seed(0)
    block = Block()
    x = _x()
    out = block(x).sum()
    ref = torch.autograd.grad(out, [x, block.proj.weight], retain_graph=True)
    tapesac_core.checkpoint_module(block)
    with tapesac_core.trace() as blocks:
        out = block(x).sum()
    first = torch.autograd.grad(out, [x, block.proj.weight], retain_graph=True)
    second = torch.autograd.grad(out, [x], retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, first))
    assert torch.equal(second[0], ref[0])
    replayed = blocks[0].replayed
    assert len(replayed) == 2 * len(set(replayed))  # every node once per backward pass


def test_a_demanded_value_still_alive_is_taken_not_replayed() -> None:
    def keeps(x, w):
        h = x * w
        return h.exp(), h  # exp saves its result; h itself stays alive with the caller

    x, w = _x(), torch.randn(8, requires_grad=True)
    h_ref = x * w
    ref = torch.autograd.grad((h_ref.exp() * h_ref).sum(), [x, w])
    with tapesac_core.trace() as blocks:
        e, h = tapesac_core.checkpoint(keeps, x, w)
    got = torch.autograd.grad((e * h).sum(), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    b = blocks[0]
    assert b.alive_taken and b.tape.nodes[0].name == "aten.mul.Tensor"
    assert 0 not in b.replayed  # h was alive: the multiplication never reran


def test_checkpoint_of_a_function_names_and_regions_it() -> None:
    def gelu_block(x):
        return torch.nn.functional.gelu(x) * x

    with tapesac_core.trace() as blocks:
        tapesac_core.checkpoint(gelu_block, _x(), region="mlp").sum().backward()
    assert (blocks[0].tape.name, blocks[0].tape.region) == ("test_checkpoint_of_a_function_names_and_regions_it.<locals>.gelu_block", "mlp")


def test_a_value_read_after_two_writes_through_views_replays_exactly() -> None:
    """Replay keeps an old version still read on a copy of the whole storage, so a view of that
    storage read again later keeps its recorded offset and strides."""
    def writes_twice(x):
        base = x * 3
        a = base[2:]
        a.mul_(2)
        r = base.clone()  # reads base after the first write, before the second
        a.add_(1)
        return r.sin().sum() + a.cos().sum()

    x = torch.randn(8, requires_grad=True)
    ref = torch.autograd.grad(writes_twice(x), x)
    got = torch.autograd.grad(tapesac_core.checkpoint(writes_twice, x), x)
    assert torch.equal(ref[0], got[0])


def test_ops_with_keyword_only_tensor_arguments_replay() -> None:
    def sorted_search(s, h, idx):
        return torch.searchsorted(s, h.sin(), sorter=idx).float() * h

    s = torch.tensor([3.0, 1.0, 2.0])
    idx = torch.argsort(s)
    h = torch.randn(5, requires_grad=True)
    ref = torch.autograd.grad(sorted_search(s, h, idx).sum(), h)
    got = torch.autograd.grad(tapesac_core.checkpoint(sorted_search, s, h, idx).sum(), h)
    assert torch.equal(ref[0], got[0])


def test_a_plan_may_save_a_view_read_again_after_a_write() -> None:
    def refresh(x):
        base = x * 3
        base[:2].mul_(2)
        return base.exp()  # reads base again after the write through its view

    x = torch.randn(6, requires_grad=True)
    tape = tapesac_core.record(refresh, x)
    (alias,) = [n for n in tape.nodes if n.name == "tapesac.alias"]
    coord = (alias.name, alias.k, 0)
    ref = torch.autograd.grad(refresh(x).sum(), x)
    with tapesac_core.use_plan({"default": {coord}}), tapesac_core.trace() as blocks:
        got = torch.autograd.grad(tapesac_core.checkpoint(refresh, x).sum(), x)
    assert torch.equal(ref[0], got[0])
    assert blocks[0].tape.planned == {alias.outs[0]}


def test_tape_times_follow_eqs_5_and_6() -> None:
    tape = tapesac_core.record(lambda x: (x.sin() * 2).exp().sum(), torch.randn(4, requires_grad=True))
    times = {n.index: float(n.index + 1) for n in tape.nodes}
    assert tape.replay_time((), times) == sum(times[i] for i in tape.replay_nodes())
    assert tape.block_time((), times) == sum(times[i] for i in tape.block_nodes())


def test_replay_forgets_storages_it_must_not_write_into_once_they_are_freed(monkeypatch) -> None:
    # The allocator reuses a freed address: a stale entry would make replay copy a fresh output
    # before writing into it. Replay's states are captured to look at what they track.
    replays = []
    init = tapesac_core.replay.Replay.__init__

    def capture(self, block):
        init(self, block)
        replays.append(self)

    monkeypatch.setattr(tapesac_core.replay.Replay, "__init__", capture)

    def block(x):
        u = x * 3
        u.add_(1)  # replay writes into its own fresh output
        return u.sin() + x.exp()  # sin saves u, exp its result: both handed to autograd

    x = _x()
    ref = torch.autograd.grad((block(x) ** 2).sum(), [x])
    got = torch.autograd.grad((tapesac_core.checkpoint(block, x) ** 2).sum(), [x])
    assert torch.equal(ref[0], got[0])
    (replay,) = replays
    # Left after backward: the block input only; the replayed values autograd read are freed.
    assert len(replay.not_ours) == 1 and x in replay.not_ours


def test_bitwise_checks_refuse_to_run_without_deterministic_algorithms() -> None:
    require_deterministic()  # the session turned them on (tests/conftest.py)
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(AssertionError, match="use_deterministic_algorithms"):
            require_deterministic()
    finally:
        torch.use_deterministic_algorithms(True)
