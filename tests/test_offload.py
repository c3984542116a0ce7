"""Offload's mechanism (issue 42): what a block holds for backward, copied to host memory at the
end of its forward and back at its backward, forced by ``trace(offload=...)`` (plans choose it
in ``test_offload_controller.py``). On CPU the copies are synchronous: bitwise, nothing outliving its step, the
host pool reused."""

import dataclasses

import pytest
import torch
from support import assert_bitwise, reference_and_copy, step, token_ids

import tapesac_core
from examples.models import rotary_cos_sin
from tapesac_core.errors import TapeSACError
from tapesac_core.measure.memory import memory_meter
from tapesac_core.plan.plan import BlockKind, Plan, RegionPlan
from tapesac_core.tape.host_pool import HostPool
from tapesac_core.tape.offload import Offload, State, alone_bytes
from tapesac_core.tape.tape import INPUT, OP

# Matrix products' outputs saved (every one of a dense layer, the attention's of a MoE layer,
# whose experts' follow the routing): values for the blocks to hold, and so to offload.
MM = "aten.mm.default"
PLAN = {
    "DecoderLayer": {(MM, k, 0) for k in range(7)},
    "MoEDecoderLayer": {(MM, k, 0) for k in range(4)},
}
CPU = torch.device("cpu")


def _step(model, ids, seed, offload):
    with tapesac_core.use_plan(PLAN), tapesac_core.trace(offload=offload) as blocks:
        got = step(model, lambda: model.loss(ids), seed)
    return got, blocks


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_offloaded_values_come_back_bitwise_and_the_pool_is_reused(moe) -> None:
    reference, model = reference_and_copy(moe=moe)
    ids = token_ids(0)
    pool = HostPool(CPU)
    allocations = []
    for seed in range(4):
        offload = Offload(pool)
        got, blocks = _step(model, ids, seed, offload)
        assert offload.bytes > 0
        assert pool.outstanding == 0  # every buffer back once its block's backward ran
        assert_bitwise(step(reference, lambda: reference.loss(ids), seed), got)
        allocations.append(pool.allocations)
    # Steady-state calls (from the second step) offload too; the pool made no buffer after the
    # first step.
    assert all(b.steady for b in blocks)
    assert allocations == [allocations[0]] * 4


def test_a_block_holds_no_value_an_op_made_between_its_forward_and_its_backward() -> None:
    _, model = reference_and_copy()
    ids = token_ids(0)
    pool = HostPool(CPU)
    offload = Offload(pool)
    with tapesac_core.use_plan(PLAN), tapesac_core.trace(offload=offload) as traces:
        loss = model.loss(ids)
        blocks = [t.block() for t in traces]
        assert all(b.offloaded is not None for b in blocks)
        assert not any(b.values[v].kind == OP for b in blocks for v in b.held)
        # Its inputs too, once the next block started (the caller had let go of them); the
        # last block's stay, and so do inputs every block shares (the rotary tables).
        assert [alone_bytes(b, (INPUT,)) > 0 for b in blocks] == [False] * 3 + [True]
        assert all(any(b.values[v].kind == INPUT for v in b.held) for b in blocks)
        loss.backward()
        assert all(b.offloaded is None for b in blocks)
    assert offload.bytes == pool.bytes and pool.outstanding == 0


def test_offloading_frees_what_it_copied_out_and_prefetching_costs_at_most_a_block() -> None:
    _, model = reference_and_copy()
    ids = token_ids(0, seq=128)
    pool = HostPool(CPU)

    def measured(offload):
        with memory_meter(CPU) as meter:
            with tapesac_core.use_plan(PLAN), tapesac_core.trace(offload=offload) as blocks:
                loss = model.loss(ids)
                after_forward = meter.reading().current
                loss.backward()
            model.zero_grad(set_to_none=True)
        return after_forward, meter.reading().peak, len(blocks)

    measured(Offload(pool))  # the pool's buffers made, outside the measured steps
    offload = Offload(pool)
    (kept, kept_peak, _), (offloaded, peak, blocks) = measured(None), measured(offload)
    # Between forward and backward the device holds exactly the offloaded bytes less; in
    # backward each block's values come back one block early (4 equal blocks here).
    assert kept - offloaded == offload.bytes > 0
    assert peak <= kept_peak + offload.bytes // blocks, (peak, kept_peak, offload.bytes)


def test_a_failed_backward_gives_every_buffer_back() -> None:
    _, model = reference_and_copy()
    ids = token_ids(0)
    pool = HostPool(CPU)

    def fail(*_):
        raise RuntimeError("a hook failed")

    handle = model.layers[1].register_full_backward_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        _step(model, ids, 0, Offload(pool))
    handle.remove()
    assert pool.bytes > 0 and pool.outstanding == 0


def _offloading(model, ids, flags):
    """A plan of ``model``'s dense layers saving nothing beyond S0, the blocks of ``flags``
    offloading."""
    with tapesac_core.trace() as traces:
        model.loss(ids)
    tape = traces[0].tape
    region = RegionPlan(
        sequence=tape.fingerprint,
        blocks=(frozenset(),) * len(flags),
        tokens=ids.numel(),
        offloaded=tuple(flags),
    )
    return Plan(
        model=(tape.region,),
        regions={tape.region: region},
        capacity=0,
        base=0,
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
    )


def test_an_offloading_block_after_one_that_keeps_comes_back_one_block_ahead_too() -> None:
    """Blocks 0 and 2 of 4 offload: block 2 comes back as block 3's backward starts, block 0 as
    block 1's does (its first unpack: one block ahead, where the peak model counts it back and
    the planner prices its copy hidden), not with block 2."""
    reference, model = reference_and_copy(moe=False)
    ids = token_ids(0)
    plan = _offloading(model, ids, [True, False, True, False])
    states = {}

    def seen(layer):
        def hook(*_):
            states[layer] = [b.offloaded.state if b.offloaded else None for b in blocks]

        return hook

    handles = [model.layers[i].register_full_backward_pre_hook(seen(i)) for i in (1, 0)]
    pool = HostPool(CPU)
    offload = Offload(pool, frozenset())  # no region forced: the plan's blocks
    with tapesac_core.use_plan(plan), tapesac_core.trace(offload=offload) as traces:
        torch.manual_seed(0)
        loss = model.loss(ids)
        blocks = [t.block() for t in traces]
        assert [b.offloaded is not None for b in blocks] == [True, False, True, False]
        loss.backward()
        grads = [p.grad for p in model.parameters()]
    for h in handles:
        h.remove()
    torch.manual_seed(0)
    reference.loss(ids).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(reference.parameters(), grads))
    # Block 1's backward: block 2 is back (one block ahead), block 0 still on the host.
    assert states[1][0] is State.ON_HOST and states[1][2] is None
    assert states[0][0] is State.COMING_BACK  # since block 1's first unpack
    assert pool.outstanding == 0


@pytest.mark.parametrize("after", [BlockKind.PLAIN, BlockKind.TORCH_CHECKPOINT])
def test_an_offloading_block_before_one_run_plain_or_under_torch_s_checkpoint_comes_back_ahead(
    after,
) -> None:
    """Block 0 offloads, block 1 runs plain or under torch's checkpoint (no unpack hook of
    TapeSAC's): block 1's backward start (its outputs' first gradient) starts block 0's copy
    back, as a recorded block's first unpack does."""
    reference, model = reference_and_copy(moe=False)
    ids = token_ids(0)
    plan = _offloading(model, ids, [True, False, False, False])
    (name, region), *_ = plan.regions.items()
    kinds = (BlockKind.TAPE, after, BlockKind.TAPE, BlockKind.TAPE)
    plan = dataclasses.replace(plan, regions={name: dataclasses.replace(region, kinds=kinds)})
    states = []
    handle = model.layers[0].register_full_backward_pre_hook(
        lambda *_: states.append(blocks[0].offloaded.state)
    )
    with tapesac_core.use_plan(plan), tapesac_core.trace(offload=Offload(HostPool(CPU))) as traces:
        torch.manual_seed(0)
        loss = model.loss(ids)
        blocks = [t.block() for t in traces]
        assert len(blocks) == 3 and blocks[0].offloaded is not None
        loss.backward()
        grads = [p.grad for p in model.parameters()]
    handle.remove()
    torch.manual_seed(0)
    reference.loss(ids).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(reference.parameters(), grads))
    assert states == [State.COMING_BACK]  # on the host before


class _Passing(torch.nn.Module):
    """A block returning its output and a parameter of its own (a leaf) unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.prefix = torch.nn.Parameter(torch.randn(2, 16))

    def forward(self, x):
        return self.proj(x).relu(), self.prefix


def test_a_block_run_plain_hooks_only_its_own_nodes_and_only_for_its_step() -> None:
    """Run plain between two offloading blocks, it returns a parameter (a leaf: no hook may stay
    on it past the step); a gradient asked of its output alone runs neither its backward nor
    the one before, and brings nothing back; its backward does."""
    torch.manual_seed(0)
    first, middle, last = _Offloaded(), _Passing(), _Offloaded()
    for m in (first, middle, last):
        tapesac_core.checkpoint_module(m)
    x = torch.randn(4, 16)
    pool = HostPool(CPU)
    for _ in range(3):
        offload = Offload(pool, regions=frozenset({"_Offloaded"}))
        with (
            tapesac_core.use_plan({"_Passing": [BlockKind.PLAIN]}),
            tapesac_core.trace(offload=offload) as traces,
        ):
            h, prefix = middle(first(x))
            loss = last(h).sum() + prefix.sum()
            torch.autograd.grad(loss, [h], retain_graph=True)
            assert traces[0].block().offloaded.state is State.ON_HOST
            loss.backward()
        assert not middle.prefix._backward_hooks and not offload._hooks
    assert pool.outstanding == 0


class _Kept(torch.nn.Module):
    """A block whose forward runs under autocast where ``cast`` is set: a steady-state call
    with it set departs from its tape (``diverged``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.cast = False

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cast):
            h = self.proj(x).tanh()
        return h.float().sin()


class _Offloaded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x).tanh().sin()


def test_a_diverged_call_after_an_offloading_block_starts_its_copy_back_and_measures_nothing(
    caplog,
) -> None:
    """The middle block's steady-state call diverges (it holds nothing: its backward runs its
    forward again): its first unpack still starts the copy back of the block before it, and
    its inputs are not measured (0 bytes alone would be counted against later plans)."""
    torch.manual_seed(0)
    first, kept, last = _Offloaded(), _Kept(), _Offloaded()
    for m in (first, kept, last):
        tapesac_core.checkpoint_module(m)
    x = torch.randn(4, 16, requires_grad=True)
    pool = HostPool(CPU)
    for call in range(3):
        kept.cast = call == 2
        states = []
        handle = first.register_full_backward_pre_hook(
            lambda *_: states.append(blocks[0].offloaded.state)
        )
        offload = Offload(pool, regions=frozenset({"_Offloaded"}))
        with caplog.at_level("ERROR"), tapesac_core.trace(offload=offload) as traces:
            loss = last(kept(first(x))).sum()
            blocks = [t.block() for t in traces]
            loss.backward()
        handle.remove()
        assert states == [State.COMING_BACK], call
    assert traces[1].diverged is not None and traces[1].inputs_alone is None
    assert traces[0].inputs_alone is not None


def test_an_input_written_after_its_forward_stays_and_backward_refuses_it() -> None:
    """The caller writes into a block's input after the block's forward and lets go of it: as
    without offload, backward refuses the written value (it is not copied to the host)."""
    _, model = reference_and_copy(moe=False)
    ids = token_ids(0)
    layers = model.layers

    def loss():
        h = model.embed_tokens(ids)
        cos, sin = rotary_cos_sin(ids.shape[1], model.config.head_dim, model.config.rope_theta, h)
        for layer in layers:
            out = layer(h, cos, sin)
            if layer is layers[1]:
                h.mul_(2.0)  # written after layer 1's forward, then dropped
            h = out
        return model.lm_head(model.norm(h)).float().square().mean()

    with tapesac_core.trace(offload=Offload(HostPool(CPU))):
        value = loss()
        with pytest.raises(TapeSACError, match="written in place after its forward"):
            value.backward()


def test_a_backward_after_its_step_ended_is_an_error_naming_the_fix() -> None:
    _, model = reference_and_copy()
    ids = token_ids(0)
    pool = HostPool(CPU)
    with tapesac_core.use_plan(PLAN), tapesac_core.trace(offload=Offload(pool)):
        loss = model.loss(ids)
    assert pool.outstanding == 0
    with pytest.raises(TapeSACError, match="run the backward inside the same step"):
        loss.backward()


def test_the_pool_gives_buffers_of_a_size_class_again() -> None:
    pool = HostPool(CPU)
    first = pool.take(1000)
    assert first.numel() == 1024 and pool.allocations == 1 and pool.outstanding == 1024
    pool.give(first)
    again = pool.take(700)  # the same class: the same buffer
    assert again.data_ptr() == first.data_ptr() and pool.allocations == 1
    pool.take(1000)  # the class's only buffer is out: a new one
    assert pool.allocations == 2 and pool.bytes == 2048


def test_a_request_without_a_free_buffer_of_its_class_takes_a_larger_free_one() -> None:
    pool = HostPool(CPU)
    large = pool.take(4000)
    pool.give(large)
    small = pool.take(100)  # no free buffer of 128 bytes: the free 4096-byte one, not a new one
    assert small.data_ptr() == large.data_ptr() and pool.allocations == 1
    pool.give(small)
    for step_bytes in ([3000, 3000], [200, 900], [900, 900], [100, 2000]):  # follow the data
        taken = [pool.take(n) for n in step_bytes]
        for buffer in taken:
            pool.give(buffer)
    # The first step's two buffers serve the later steps: no buffer per size class they ask for.
    assert pool.allocations == 2 and pool.bytes == 4096 + 4096


def _hf_qwen3_moe():
    pytest.importorskip("transformers")
    from moe_families import VOCAB, moe_model

    base, layer = moe_model("qwen3_moe", "eager")
    return base, layer, lambda m, ids: m(input_ids=ids, labels=ids).loss, VOCAB


def _hf_qwen3():
    pytest.importorskip("transformers")
    from benchmarks.steady_state import hf_stack

    base, layer, _, _ = hf_stack(64, layers=2)
    return base, layer, lambda m, ids: m.loss(ids), 1024


@pytest.mark.parametrize("build", [_hf_qwen3_moe, _hf_qwen3], ids=["qwen3_moe_eager", "qwen3"])
def test_hugging_face_layers_offloaded_are_bitwise_every_step(build) -> None:
    import copy

    base, layer, loss, vocab = build()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {layer})
    # The attention's four projections saved (the MoE's routing also holds what it indexes by).
    plan = {layer.__name__: {(MM, k, 0) for k in range(4)}}
    pool = HostPool(CPU)
    offloaded = []
    for seed in range(4):
        ids = token_ids(seed, batch=2, seq=24, vocab=vocab)  # routing changes every step
        offload = Offload(pool)
        with tapesac_core.use_plan(plan), tapesac_core.trace(offload=offload):
            got = step(model, lambda: loss(model, ids), seed)
        assert_bitwise(step(reference, lambda: loss(reference, ids), seed), got)
        assert pool.outstanding == 0
        offloaded.append(offload.bytes)
    assert all(offloaded)


class _Tanh(torch.nn.Module):
    """A block whose saved value (tanh's result) is its output: alive outside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def test_a_storage_alive_outside_the_block_stays_and_conjugate_views_stay() -> None:
    block = tapesac_core.checkpoint_module(_Tanh())
    x = torch.randn(32, 64, requires_grad=True)
    pool = HostPool(CPU)
    offload = Offload(pool)
    with tapesac_core.use_plan({"_Tanh": {("aten.tanh.default", 0, 0)}}):
        with tapesac_core.trace(offload=offload):
            block(x).sum().backward()
    assert offload.bytes == 0  # copying it would free nothing

    # A layout does not carry the conjugate bit: such a value stays on the device, bitwise.
    w = torch.randn(8, 8, dtype=torch.cfloat, requires_grad=True)
    w2 = torch.randn(4, 8, dtype=torch.cfloat, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.cfloat)

    def conjugated(h: torch.Tensor) -> torch.Tensor:
        return (h @ w).conj() * w2

    def grads(run) -> list[torch.Tensor]:
        w.grad = w2.grad = None
        (run().abs() ** 2).sum().backward()
        return [w.grad, w2.grad]

    want = grads(lambda: conjugated(x))
    offload = Offload(pool)
    with tapesac_core.use_plan({"r": {("aten._conj.default", 0, 0)}}):
        with tapesac_core.trace(offload=offload):
            got = grads(lambda: tapesac_core.checkpoint(conjugated, x, region="r"))
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and offload.bytes == 0


def test_restored_values_go_with_the_block_and_a_freed_block_gives_its_buffers_back() -> None:
    _, model = reference_and_copy()
    ids = token_ids(0)
    pool = HostPool(CPU)
    with memory_meter(CPU) as meter:
        start = meter.reading().current
        offload = Offload(pool)
        with tapesac_core.use_plan(PLAN), tapesac_core.trace(offload=offload):
            model.loss(ids).backward()
            model.zero_grad(set_to_none=True)
            # Nothing restored outlives its block; the pool's buffers stand for host memory on
            # CPU, which a meter of the device does not count.
            assert pool.bytes > 0 and meter.reading().current == start
            # A forward whose backward never runs: its buffers come back when it is freed.
            model.loss(ids)
            assert pool.outstanding == 0
    assert offload.bytes > 0


def test_a_failed_copy_back_gives_each_buffer_back_once_and_training_goes_on(monkeypatch) -> None:
    import tapesac_core.tape.offload as offload_module

    reference, model = reference_and_copy()
    ids = token_ids(0)
    pool = HostPool(CPU)
    calls = []

    class Torch:  # the module's torch, with the second copy back's allocation failing
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *args, **kwargs):
            if kwargs.get("dtype") is torch.uint8 and args and args[0] > 0:
                calls.append(args[0])
                if len(calls) == 2:
                    raise torch.OutOfMemoryError("out of memory (simulated)")
            return torch.empty(*args, **kwargs)

    monkeypatch.setattr(offload_module, "torch", Torch())
    with pytest.raises(torch.OutOfMemoryError):
        _step(model, ids, 0, Offload(pool))
    monkeypatch.undo()
    free = [b.data_ptr() for buffers in pool._free.values() for b, _ in buffers]
    assert len(free) == len(set(free)) == pool.allocations and pool.outstanding == 0
    for seed in range(1, 3):  # the loop skips the batch and goes on
        got, _ = _step(model, ids, seed, Offload(pool))
        assert_bitwise(step(reference, lambda: reference.loss(ids), seed), got)
