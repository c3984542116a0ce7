"""The mandatory set S0: what is always saved, and why replay never recomputes it."""

import copy
import dataclasses

import blocks
import pytest
import torch
import torch.distributed as dist
from support import OpCounter, assert_bitwise, step

import tapesac_core
from tapesac_core.tape.tape import COLLECTIVE, DYNAMIC_SHAPE, INVISIBLE_WRITE, NO_PRODUCER, OP

F32 = 4


class DynamicCalls(OpCounter):
    """Also lists the calls of ops tagged with a data-dependent output shape, with their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.dynamic: list[tuple[str, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.dynamic_output_shape in func.tags:
            self.dynamic.append((str(func), args, kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class Routed(torch.nn.Module):
    """Token selection with data-dependent shapes, as in MoE dispatch."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        picked = torch.nonzero(h[:, 0] > 0).flatten()  # dynamic shape: mandatory
        masked = h[h[:, 1] > 0]  # boolean index: mandatory
        counts = torch.tensor([1, 2, 1, 2, 1, 2, 1, 2])
        repeated = h.repeat_interleave(counts, dim=0, output_size=12)  # shape known: replayed
        return (h[picked].exp().sum() + masked.exp().sum() + repeated.exp().sum()) * h


def _exact_block(module) -> tapesac_core.BlockTrace:
    """Checkpoint ``module``; its gradients must be bitwise those without; its block's trace."""
    x = torch.randn(4, 8, requires_grad=True)
    ref = step(module, lambda: module(x).sum())
    tapesac_core.checkpoint_module(module)
    with tapesac_core.trace() as blocks:
        got = step(module, lambda: module(x).sum())
    assert_bitwise(ref, got)
    return blocks[0]


def _backward_counted(module, x):
    """The reference step of ``module`` on ``x`` (loss: sum of squares); then, checkpointed, one
    traced forward and its backward under ``DynamicCalls``: (reference, block trace, counter)."""
    ref = step(module, lambda: (module(x) ** 2).sum())
    tapesac_core.checkpoint_module(module)
    torch.manual_seed(0)
    with tapesac_core.trace() as blocks:
        out = module(x)
    loss = (out**2).sum()
    with DynamicCalls() as counter:
        loss.backward()
    return ref, blocks[0], counter


def _reasons(tape) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for vid, reason in tape.mandatory.items():
        node = tape.values[vid].node
        out.setdefault(reason, set()).add(
            tape.nodes[node].name if node >= 0 else tape.values[vid].kind
        )
    return out


def test_data_dependent_shapes_are_mandatory_and_backward_never_syncs() -> None:
    torch.manual_seed(0)
    module = Routed()
    x = torch.randn(8, 8, requires_grad=True)
    ref, block, counter = _backward_counted(module, x)
    tape = block.tape
    reasons = _reasons(tape)
    # torch.tensor([...]) is built outside the dispatcher: a tensor without a recorded producer.
    assert reasons == {
        DYNAMIC_SHAPE: {"aten.nonzero.default", "aten.index.Tensor"},
        NO_PRODUCER: {"external"},
    }
    index_nodes = [n for n in tape.nodes if n.name == "aten.index.Tensor"]
    # h[mask] (boolean) is mandatory, h[picked] (integer) is replayed.
    assert [any(v in tape.mandatory for v in n.outs) for n in index_nodes] == [True, False]
    # No host synchronisation during backward: no item(), no nonzero, no boolean index; what
    # replays with a dynamic-shape tag has a shape known without reading data.
    assert counter.counts["aten._local_scalar_dense.default"] == 0
    assert counter.counts["aten.nonzero.default"] == 0
    replayed = {name for name, _, _ in counter.dynamic}
    assert replayed == {"aten.index.Tensor", "aten.repeat_interleave.Tensor"}
    for name, args, kwargs in counter.dynamic:
        if name == "aten.index.Tensor":
            assert all(i is None or i.dtype == torch.int64 for i in args[1])
        else:
            assert kwargs["output_size"] == 12
    assert tape.mandatory_bytes == tape.bytes_of(tape.mandatory) > 0
    got = step(module, lambda: (module(x) ** 2).sum())
    assert_bitwise(ref, got)


def test_sizes_that_follow_the_data_are_told_apart_from_those_the_inputs_fix() -> None:
    """In the MoE block, what each expert computes is sized by the tokens routed to it; the
    attention, the router, the shared expert, the token-shaped output its experts are added
    into and everything after it are sized by the block's input alone."""
    tape = blocks.case("moe").must_only
    sized = tape.data_sized
    made = [(tape.nodes[v.node], v.vid) for v in tape.values if v.node >= 0]
    expert = [v for n, v in made if (n.module or "").startswith("mlp.experts.")]
    weights = set(tape.token_independent)  # the experts' transposed weights: views of parameters
    routed = {v for n, v in made if n.name == "aten.nonzero.default"}
    assert expert and weights & set(expert) and routed
    assert set(expert) - weights | routed <= sized and not weights & sized
    fixed = [v for n, v in made if not (n.module or "").startswith("mlp")]
    shared = [v for n, v in made if (n.module or "").startswith(("mlp.router", "mlp.shared"))]
    index_put = [v for n, v in made if n.name == "aten.index_put_.default"]
    assert fixed and shared and index_put
    assert not sized & {*fixed, *shared, *index_put, *tape.outputs}
    # The ops between routing and the experts' sum: every one reads a routed index or weight.
    assert all(
        v in sized
        for n, v in made
        if n.module == "mlp" and n.name in ("aten.index_select.default", "aten.unsqueeze.default")
    )
    # After a number read from a tensor (.item()) any size may follow it.
    synced = dataclasses.replace(tape, host_sync=True)
    assert synced.data_sized == {v.vid for v in tape.values if v.kind == OP}
    dense = blocks.case("dense").must_only
    assert not dense.data_sized


def test_tensors_without_a_recorded_producer_are_mandatory() -> None:
    scale = torch.randn(8)  # read by the block, produced outside it, not a parameter

    class UsesGlobal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            return (x * scale).sin() * self.w

    block = _exact_block(UsesGlobal())
    tape = block.tape
    assert _reasons(tape) == {NO_PRODUCER: {"external"}}
    (vid,) = tape.mandatory
    assert tape.values[vid].meta.shape == scale.shape
    assert tape.mandatory_bytes == 8 * F32
    assert {tape.values[v].name for v in tape.leaves if tape.values[v].kind == "param"} == {"w"}


def test_buffers_filled_by_an_invisible_kernel_are_mandatory() -> None:
    class Opaque(torch.nn.Module):
        def forward(self, x):
            buf = torch.empty(x.shape)
            buf.numpy()[:] = 0.5  # a write the dispatcher never sees, like a Triton kernel's
            return (x * buf).exp()

    block = _exact_block(Opaque())
    tape = block.tape
    assert _reasons(tape) == {INVISIBLE_WRITE: {"aten.empty.memory_format"}}
    assert tape.mandatory_bytes == 32 * F32
    assert "aten.empty.memory_format" not in {tape.nodes[i].name for i in block.replayed}


def test_an_allocation_written_by_a_recorded_op_is_not_mandatory() -> None:
    class Written(torch.nn.Module):
        def forward(self, x):
            buf = torch.empty_like(x)
            buf.copy_(x.sin())
            return buf.exp()

    block = _exact_block(Written())
    assert block.tape.mandatory == {}


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_collective_outputs_are_mandatory_and_never_replayed(process_group) -> None:
    group_name = process_group.group_name

    class Reduces(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.proj(x).sin()
            reduced = torch.ops._c10d_functional.all_reduce(h.detach(), "sum", group_name)
            return torch.ops._c10d_functional.wait_tensor(reduced) * h

    torch.manual_seed(0)
    module = Reduces()
    assert COLLECTIVE in _reasons(_exact_block(module).tape)
    with tapesac_core.trace() as blocks:
        out = module(torch.randn(4, 8, requires_grad=True))
    with OpCounter() as counter:
        out.sum().backward()
    assert COLLECTIVE in _reasons(blocks[0].tape)
    assert not [name for name in counter.counts if "c10d" in name]


def test_collectives_on_buffers_the_block_did_not_produce_are_not_recorded(process_group) -> None:
    bucket = torch.zeros(8)  # stands for FSDP's communication buffer

    class Communicates(torch.nn.Module):
        def forward(self, x):
            dist.all_reduce(bucket)
            return x.sin()

    module = tapesac_core.checkpoint_module(Communicates())
    x = torch.randn(8, requires_grad=True)
    with tapesac_core.trace() as blocks:
        module(x).sum().backward()
    assert [n.name for n in blocks[0].tape.nodes] == ["aten.sin.default"]


def test_copies_of_a_checkpointed_module_checkpoint_their_own_blocks() -> None:
    module = tapesac_core.checkpoint_module(torch.nn.Linear(4, 4))
    twin = copy.deepcopy(module)
    x = torch.randn(2, 4, requires_grad=True)
    with tapesac_core.trace() as blocks:
        twin(x).sum().backward()
    assert blocks[0].tape.values[1].kind == "param"
    assert twin.weight.grad is not None and module.weight.grad is None


def test_repeat_interleave_without_output_size_is_mandatory_and_never_replayed() -> None:
    class Repeats(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.proj(x)
            counts = (h[:, 0] > 0).long() + 1  # 1 or 2 copies of each row: a shape from data
            return h.repeat_interleave(counts, dim=0).exp().sum() * h

    torch.manual_seed(0)
    module = Repeats()
    x = torch.randn(6, 8, requires_grad=True)
    ref, block, counter = _backward_counted(module, x)
    tape = block.tape
    (node,) = [n for n in tape.nodes if n.name == "aten.repeat_interleave.Tensor"]
    assert "output_size" not in node.kwargs or node.kwargs["output_size"] is None
    assert {tape.mandatory.get(v) for v in node.outs} == {DYNAMIC_SHAPE}
    # Backward replays what it needs around it (the projection, the comparison) but not it.
    assert counter.dynamic == [] and counter.counts["aten.repeat_interleave.Tensor"] == 0
    assert node.index not in block.replayed and block.replayed
    module.zero_grad(set_to_none=True)
    assert_bitwise(ref, step(module, lambda: (module(x) ** 2).sum()))
