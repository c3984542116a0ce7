"""The checkpoint contract: clear errors for unsupported use, and the cases that must just work."""

import logging
import random
from collections import Counter

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from support import (
    OpCounter,
    assert_bitwise,
    brute_force_replay,
    process_group_of_one,
    require_deterministic,
    step,
)

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
    with pytest.raises(
        TapeSACError, match=r"block 'inner' is nested inside checkpointed block 'Stack'"
    ):
        tapesac_core.checkpoint(model, _x())


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stacks = torch.nn.ModuleList([Stack(), Stack()])

    def forward(self, x):
        return self.stacks[1](self.stacks[0](x))


def _wrap_errors(first, second) -> str:
    """The error of ``second(model)`` after ``first(model)``; neither ran a forward."""
    model = Outer()
    first(model)
    with pytest.raises(TapeSACError) as error:
        second(model)
    return str(error.value)


def _blocks(model):
    return tapesac_core.checkpoint_modules(model, {Block})


def _stacks(model):
    return tapesac_core.checkpoint_modules(model, {Stack})


@pytest.mark.parametrize(
    "first, second, inner, outer",
    [
        (_stacks, _blocks, "stacks.0.inner", "stacks.0"),
        (_blocks, _stacks, "stacks.0.inner", "stacks.0"),
        (_blocks, lambda m: tapesac_core.checkpoint_module(m.stacks[1]), "Stack.inner", "Stack"),
        (_stacks, lambda m: tapesac_core.checkpoint_module(m.stacks[1].inner), "Block", "stacks.1"),
    ],
    ids=["child_after_parent", "parent_after_child", "module_around_block", "module_inside_block"],
)
def test_wrapping_a_module_inside_or_around_a_block_is_an_error_naming_both(
    first, second, inner, outer
) -> None:
    message = _wrap_errors(first, second)
    assert f"'{inner}'" in message and f"'{outer}'" in message, message
    assert "Fix: checkpoint only one of them" in message


def test_a_refused_nested_wrap_leaves_the_model_as_it_was() -> None:
    model = Outer()
    tapesac_core.checkpoint_module(model.stacks[1])
    with pytest.raises(TapeSACError, match="'stacks.1.inner'"):
        _blocks(model)  # stacks.0.inner alone would be fine: it is not wrapped either
    assert not hasattr(model.stacks[0].inner, "_tapesac")
    with tapesac_core.trace() as blocks:
        model(_x()).sum().backward()
    assert [b.tape.name for b in blocks] == ["Stack"]


def test_fully_shard_inside_a_block_is_an_error_naming_the_module() -> None:
    """At wrap time when the inner module is sharded first; at the block's forward when it is
    sharded after wrapping (without the check: an invalid-storage RuntimeError from replay)."""
    from torch.distributed.fsdp import fully_shard

    fix = "Fix: apply fully_shard to the block (or a module around it), not to modules inside it"
    with process_group_of_one():
        model = Outer()
        fully_shard(model.stacks[0].inner)
        with pytest.raises(TapeSACError, match=r"block 'stacks.0' contains 'stacks.0.inner'") as e:
            tapesac_core.checkpoint_modules(model, {Stack})
        assert fix in str(e.value) and not any(hasattr(s, "_tapesac") for s in model.stacks)
        model = Outer()
        tapesac_core.checkpoint_modules(model, {Stack})
        fully_shard(model.stacks[1].inner)
        with pytest.raises(TapeSACError, match=r"block 'stacks.1' contains 'stacks.1.inner'"):
            model(_x())
        fully_shard(model)  # the whole model (around the blocks) is what FSDP2 users do: allowed
        with pytest.raises(TapeSACError, match="stacks.1.inner"):
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


def _scale_weight(self, x):
    with torch.no_grad():
        self.proj.weight.mul_(1.0)
    return self.proj(x)


@pytest.mark.parametrize(
    "body, what",
    [
        (lambda self, x: x.add_(1.0) * 2, "block input 0"),
        (_scale_weight, "param 'proj.weight'"),
        (lambda self, x: self.offset.add_(1.0) * x, "buffer 'offset'"),
    ],
    ids=["input", "parameter", "buffer"],
)
def test_writing_into_a_block_input_parameter_or_buffer_is_an_error(body, what) -> None:
    class Mutates(Block):
        forward = body

    block = tapesac_core.checkpoint_module(Mutates())
    with pytest.raises(TapeSACError, match=f"aten.*writes in place into {what}"):
        block(_x().clone())


def test_a_plan_coordinate_the_block_lacks_is_a_warning_naming_it(caplog) -> None:
    block = tapesac_core.checkpoint_module(Block())
    with (
        caplog.at_level(logging.WARNING),
        tapesac_core.use_plan({"Block": {("aten.mm.default", 5, 0), ("aten.tanh.default", 0, 0)}}),
    ):
        block(_x())
    assert "('aten.mm.default', 5, 0)" in caplog.text
    assert "aten.tanh" not in caplog.text


def test_a_malformed_plan_is_an_error() -> None:
    with pytest.raises(TapeSACError, match="is not a coordinate"):
        with tapesac_core.use_plan({"Block": ["aten.mm.default"]}):
            pass


def test_use_plan_takes_a_solved_plan_or_a_mapping_not_a_look_alike() -> None:
    class LookAlike:  # a Plan's method, but not a Plan
        def coordinates(self) -> dict:
            return {"Block": [{("aten.mm.default", 0, 0)}]}

    with pytest.raises(TapeSACError, match="maps region names to coordinates, got LookAlike"):
        with tapesac_core.use_plan(LookAlike()):
            pass


def test_tensor_subclasses_inside_a_block_are_an_error() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(4), torch.randn(4)).requires_grad_()
    with pytest.raises(TapeSACError, match="tensor subclass TwoTensor"):
        tapesac_core.checkpoint(torch.sin, x)


class SparseInside(torch.nn.Module):
    """A sparse tensor reaches its ops as an input, a plain attribute or an op's output."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.where = where
        self.sparse = torch.eye(4).to_sparse()

    def forward(self, x: torch.Tensor, sparse: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x).float()
        with torch.autocast("cpu", enabled=False):  # sparse.mm has no autocast rule
            if self.where == "made":
                return torch.sparse.mm(h.to_sparse(), self.a.weight)
            return torch.sparse.mm(self.sparse if sparse is None else sparse, h)


@pytest.mark.parametrize("where", ["input", "attribute", "made"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_sparse_tensor_inside_a_block_is_an_error_naming_the_fix(where, autocast) -> None:
    """Before: ``NotImplementedError: Cannot access storage of SparseTensorImpl`` from inside
    the recorder, on every call. The block then still trains without it."""
    block = tapesac_core.checkpoint_module(SparseInside(where), region="sparse")
    x = torch.randn(4, 4, requires_grad=True)
    sparse = torch.eye(4).to_sparse() if where == "input" else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(TapeSACError, match=r"sparse_coo tensor .* Fix: make the sparse"):
            block(x, sparse)
        block.where = "dense"
        block.sparse = torch.eye(4)
        block(x).float().sum().backward()
    assert x.grad is not None


def test_a_policy_error_on_a_hugging_face_model_suggests_its_decoder_class() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    with pytest.raises(TapeSACError) as error:
        tapesac_core.checkpoint_modules(model, lambda m: False)
    message = str(error.value)
    assert (
        "policy callable test_a_policy_error_on_a_hugging_face_model_suggests_its_decoder_class.<locals>.<lambda>"
        in message
    )
    assert "e.g. {Qwen3DecoderLayer}" in message and "DecoderLayer}" not in message.replace(
        "Qwen3DecoderLayer}", ""
    )


def test_a_policy_matching_nothing_or_of_the_wrong_type_is_an_error() -> None:
    with pytest.raises(TapeSACError, match=r"policy \{Conv2d\} matches no module of Stack"):
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


def test_a_value_taken_alive_and_packed_twice_is_never_replayed() -> None:
    def keeps(x, w):
        h = (x * w).exp()  # exp saves its result h
        return h * h, h  # mul packs h twice; h itself stays alive with the caller

    x, w = _x(), torch.randn(8, requires_grad=True)
    h_ref = (x * w).exp()
    ref = torch.autograd.grad((h_ref * h_ref + h_ref).sum(), [x, w])
    with tapesac_core.trace() as blocks:
        y, h = tapesac_core.checkpoint(keeps, x, w)
    got = torch.autograd.grad((y + h).sum(), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    b = blocks[0]
    h_vid = b.tape.nodes[1].outs[0]
    assert b.tape.nodes[1].name == "aten.exp.default" and h_vid in b.tape.demand
    assert h_vid in b.alive_taken
    # Every unpack of h is served by the alive tensor: its producers never rerun.
    assert b.replayed == []


def test_checkpoint_of_a_function_names_and_regions_it() -> None:
    def gelu_block(x):
        return torch.nn.functional.gelu(x) * x

    with tapesac_core.trace() as blocks:
        tapesac_core.checkpoint(gelu_block, _x(), region="mlp").sum().backward()
    assert (blocks[0].tape.name, blocks[0].tape.region) == (
        "test_checkpoint_of_a_function_names_and_regions_it.<locals>.gelu_block",
        "mlp",
    )


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


def _chain(x):
    y = x.sin()  # saves x (a leaf)
    z = y.exp()  # saves z
    w = (z * 3.0).tanh()  # the multiplication saves nothing; tanh saves w
    return w.sum()


NAMES = [
    "aten.sin.default",
    "aten.exp.default",
    "aten.mul.Tensor",
    "aten.tanh.default",
    "aten.sum.default",
]


def test_tape_times_follow_eqs_5_and_6() -> None:
    """Against node sets derived by hand (and times that are powers of two, so a sum names its
    nodes): Eq. 3/6 runs what the saved values need; Eq. 4/5 reruns the prefix up to the last
    missing saved value, skipping only nodes whose outputs are all kept."""
    tape = tapesac_core.record(_chain, torch.randn(4, requires_grad=True))
    assert [n.name for n in tape.nodes] == NAMES
    times = {n.index: float(2**n.index) for n in tape.nodes}  # sin 1, exp 2, mul 4, tanh 8, sum 16
    z, w = tape.nodes[1].outs[0], tape.nodes[3].outs[0]
    assert tape.replay_time((), times) == tape.block_time((), times) == 1 + 2 + 4 + 8
    assert tape.replay_time({z}, times) == 4 + 8  # sin and exp are not needed for w
    assert tape.block_time({z}, times) == 1 + 4 + 8  # torch reruns sin, skips only exp
    assert tape.replay_time({w}, times) == 1 + 2  # z is still needed by exp's backward
    assert tape.block_time({w}, times) == 1 + 2
    assert tape.replay_time({z, w}, times) == tape.block_time({z, w}, times) == 0


def test_replay_runs_what_eq_3_predicts_counted_at_the_dispatcher() -> None:
    x = torch.randn(4, requires_grad=True)
    counts = {}
    for saved in ([], [("aten.exp.default", 0, 0)], [("aten.tanh.default", 0, 0)]):
        out = _chain(x)
        with OpCounter() as plain:
            torch.autograd.grad(out, x)
        with tapesac_core.use_plan({"default": set(saved)}):
            out = tapesac_core.checkpoint(_chain, x)
        with OpCounter() as checkpointed:
            torch.autograd.grad(out, x)
        counts[len(counts)] = checkpointed.counts - plain.counts
        counts[len(counts) - 1].pop("aten.detach.default", None)  # autograd wraps unpacked values
    assert counts[0] == Counter(NAMES[:4])  # the sum's backward reads no saved value
    assert counts[1] == Counter(["aten.mul.Tensor", "aten.tanh.default"])
    assert counts[2] == Counter(["aten.sin.default", "aten.exp.default"])


def test_the_library_closure_agrees_with_brute_force_on_every_save_set() -> None:
    from blocks import case

    tape = case("inplace").must_only
    rng = random.Random(0)
    candidates = [v.vid for v in tape.values if v.node >= 0]
    for size in (0, 1, 2, 4, 8, len(candidates)):
        for _ in range(5):
            saved = set(rng.sample(candidates, size))
            assert tape.replay_nodes(saved) == brute_force_replay(tape, saved)


def test_a_dtensor_parameter_at_backward_is_an_error_naming_the_fsdp2_order() -> None:
    """FSDP2 applied inside a block reshards its parameters after forward: it frees the
    unsharded tensor's storage the forward read and registers a DTensor; a backward before it
    gathers them again would read freed memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    block = tapesac_core.checkpoint_module(Block())
    with process_group_of_one():
        mesh = init_device_mesh("cpu", (1,))
        out = block(_x())
        unsharded = block.proj.weight
        sharded = distribute_tensor(unsharded.detach().clone(), mesh, [Shard(0)])
        block.proj.weight = torch.nn.Parameter(sharded)
        unsharded.untyped_storage().resize_(0)
        with pytest.raises(
            TapeSACError,
            match=r"block 'Block': param 'proj.weight', which its forward read, has no storage "
            r"in its backward.*Fix: shard with FSDP2 at the checkpointed module or above it",
        ):
            out.sum().backward()


def test_replay_forgets_storages_it_must_not_write_into_once_they_are_freed(monkeypatch) -> None:
    # The allocator reuses a freed address: a stale entry would make replay copy a fresh output
    # before writing into it. Replay's states are captured to look at what they track.
    replays = []
    init = tapesac_core.tape.replay.Replay.__init__

    def capture(self, block):
        init(self, block)
        replays.append(self)

    monkeypatch.setattr(tapesac_core.tape.replay.Replay, "__init__", capture)

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
