"""Planning on measured costs: an injected delay changes the plan; data-dependent blocks fall back."""

import copy
import time

import torch
from support import SHORT_SCHEDULE, FakeMeter

import tapesac_core
from examples.models import ModelConfig, MoEDecoderLayer, rotary_cos_sin
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.tape.kernels import register_kernel
from tapesac_core.units import GiB

SLOW = "tapesac_test_delay.slow_sin.default"


class SlowSin(torch.autograd.Function):
    """sin(x), after sleeping ``delay`` seconds: a kernel whose cost the dispatcher cannot guess."""

    delay = 0.0

    @staticmethod
    def forward(ctx, x):
        time.sleep(SlowSin.delay)
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


slow_sin = register_kernel(
    "tapesac_test_delay::slow_sin",
    SlowSin,
    schema="(Tensor x) -> Tensor",
    fake=lambda x: torch.empty_like(x),
)


class Costly(torch.nn.Module):
    """An expensive matmul, then the opaque kernel, then cheap ops."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, d)

    def forward(self, x):
        return slow_sin(self.a(x)).tanh() * 2.0


# 32 tokens of width 4096: the matmul does 4096 multiply-adds per element the kernel and tanh
# touch, so without the delay it takes some 30 times their time (18 ms against 0.6 ms on one
# thread), a margin no load closes; the delay, a sleep, is over 10 times the matmul, and a loaded
# machine only lengthens it.
TOKENS, WIDTH, DELAY = 32, 4096, 0.4


def _plan_with_delay(delay: float) -> tuple[dict[str, float], set]:
    """Profiled node times by op name, and the one block's planned coordinates."""
    SlowSin.delay = delay
    torch.manual_seed(0)
    model = torch.nn.Sequential(Costly(WIDTH))
    tapesac_core.checkpoint_modules(model, {Costly})
    meter = FakeMeter(base=GiB, per_token=0)
    one_storage = TOKENS * WIDTH * 4
    controller = Controller(
        model,
        GiB + int(1.5 * one_storage),
        meter=meter,
        margin=0.0,
        **(SHORT_SCHEDULE | dict(profile_steps=2)),
    )
    x = torch.randn(TOKENS, WIDTH)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: op times do not depend on what other processes run
    try:
        for _ in range(5):
            with controller.step(tokens=TOKENS) as report:
                model(x).sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert report.mode == PLANNED
    profile = controller.profiles["Costly"]
    times = {
        n.name: profile.node_time[n.index]
        for n in profile.tape.nodes
        if n.index in profile.node_time
    }  # the nodes replay can run
    (coords,) = report.plan.regions["Costly"].blocks
    return times, coords


ADDMM, TANH = "aten.addmm.default", "aten.tanh.default"


def test_a_measured_delay_shows_in_the_profile_and_changes_the_plan() -> None:
    quick_times, quick = _plan_with_delay(0.0)
    slow_times, slow = _plan_with_delay(DELAY)
    # Saving the matmul's output removes its replay; saving tanh's removes the kernel's and
    # tanh's (see below). The profile orders them as the costs do, far apart either way.
    assert quick_times[ADDMM] > quick_times[SLOW] + quick_times[TANH]
    assert slow_times[SLOW] >= DELAY > slow_times[ADDMM]
    # Without the delay the matmul is the expensive op: its output is saved. With it, the same
    # bytes are worth more after the kernel: saving tanh's output makes the kernel and tanh dead.
    assert quick == {(ADDMM, 0, 0)}
    assert slow == {(TANH, 0, 0)}


def test_blocks_with_data_dependent_op_sequences_keep_the_plan_by_anchored_coordinates() -> None:
    from support import assert_bitwise, assert_replayed_as_predicted, step

    torch.manual_seed(0)
    config = ModelConfig(
        moe=True,
        skip_empty_experts=True,
        num_experts=8,
        top_k=1,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
    )
    plain = torch.nn.ModuleList(MoEDecoderLayer(config) for _ in range(4))
    layers = copy.deepcopy(plain)
    tapesac_core.checkpoint_modules(layers, {MoEDecoderLayer})
    controller = Controller(
        layers,
        GiB,
        meter=FakeMeter(base=0, per_token=0),
        **SHORT_SCHEDULE,
    )
    g = torch.Generator().manual_seed(0)
    changed = kept = 0
    for _ in range(8):
        x = torch.randn(1, 6, 32, generator=g)
        cos, sin = rotary_cos_sin(6, 16, config.rope_theta, x)

        def loss(model: torch.nn.Module) -> torch.Tensor:
            h = x
            for layer in model:
                h = layer(h, cos, sin)
            return h.sum()

        with controller.step(tokens=6) as report:
            got = step(layers, lambda: loss(layers))
        assert_bitwise(step(plain, lambda: loss(plain)), got)
        assert_replayed_as_predicted(report.block_traces)
        drifted = [b for b in report.block_traces if b.sequence_changed]
        changed += len(drifted)
        kept += sum(bool(b.tape.planned) for b in drifted)
    region = report.plan.regions["MoEDecoderLayer"]
    profile = controller.profiles["MoEDecoderLayer"]
    assert report.mode == PLANNED and sum(profile.shares_reference) < 4 == len(region.blocks)
    assert all(region.blocks) and "anchored coordinates" in report.plan.explain()
    # Blocks whose routing changed their op sequence still saved values of the plan.
    assert 0 < kept <= changed


def _fixed_routing(moe: torch.nn.Module, selected: torch.Tensor) -> None:
    """Route token t to experts ``selected[t]``, weighted by the router's probabilities."""

    def route(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(moe.router(tokens), dim=-1).gather(1, selected)
        return probs / probs.sum(dim=-1, keepdim=True), selected

    moe.route = route


_TOKENS = torch.arange(16)
ROUND_ROBIN = torch.stack([_TOKENS % 4, (_TOKENS + 1) % 4], dim=1)  # every expert: 8 tokens
TO_EXPERTS_0_AND_1 = torch.stack([_TOKENS * 0, _TOKENS * 0 + 1], dim=1)  # experts 2, 3 idle


def _routed_moe(skip_empty_experts: bool) -> tuple[torch.nn.Module, torch.nn.Module, tuple]:
    """A 4-expert top-2 MoE layer, the same layer checkpointed, and its inputs (16 tokens)."""
    torch.manual_seed(0)
    config = ModelConfig(
        moe=True,
        skip_empty_experts=skip_empty_experts,
        num_experts=4,
        top_k=2,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        moe_intermediate_size=64,
        dropout=0.0,
    )
    plain = MoEDecoderLayer(config)
    block = tapesac_core.checkpoint_module(copy.deepcopy(plain))
    x = torch.randn(1, 16, 32)
    return plain, block, (x, *rotary_cos_sin(16, 16, config.rope_theta, x))


def _reference_tape(block: torch.nn.Module, args: tuple) -> tapesac_core.Tape:
    with tapesac_core.trace() as traces:
        block(*args).sum().backward()
    return traces[0].tape


def _one_region_plan(tape: tapesac_core.Tape, saved: set[int], **region: object):
    """A solved-plan stand-in saving ``saved`` in the one block of ``tape``'s region."""
    from tapesac_core.plan.plan import Plan, RegionPlan

    return Plan(
        model=("m",),
        capacity=0,
        base=0,
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
        regions={
            tape.region: RegionPlan(
                sequence=tape.fingerprint,
                blocks=(frozenset(map(tape.coord, saved)),),
                tokens=16,
                **region,
            )
        },
    )


def _forward_bytes(
    block: torch.nn.Module, plan, args: tuple
) -> tuple[int, tapesac_core.BlockTrace]:
    """Live bytes (measured) the block's forward leaves for backward under ``plan``; its trace."""
    from support import assert_replayed_as_predicted

    from tapesac_core.measure.memory import LiveTensorMeter

    with tapesac_core.trace() as traces, LiveTensorMeter() as meter:
        with tapesac_core.use_plan(plan):
            out = block(*args)
        left = meter.reading().current - out.untyped_storage().nbytes()
    out.sum().backward()
    assert_replayed_as_predicted(traces)
    return left, traces[0]


def test_a_planned_value_that_outgrows_its_block_budget_is_replayed_instead() -> None:
    from support import assert_bitwise, step

    plain, block, args = _routed_moe(skip_empty_experts=False)
    _fixed_routing(block.mlp, ROUND_ROBIN)
    tape = _reference_tape(block, args)
    (up,) = [
        n for n in tape.nodes if n.module == "mlp.experts.0.up_proj" and n.name == "aten.mm.default"
    ]
    budget = tape.saved_bytes(up.outs)
    assert budget == 8 * 64 * 4  # expert 0's up projection of its 8 tokens, fp32
    plan = _one_region_plan(tape, set(up.outs), block_bytes=(budget,))

    def forward_bytes(routing: torch.Tensor, planned: bool) -> tuple[int, int]:
        """Live bytes the forward leaves for backward, and the planned values not kept."""
        _fixed_routing(block.mlp, routing)
        left, trace = _forward_bytes(block, plan if planned else {}, args)
        return left, trace.over_budget

    must_only, _ = forward_bytes(ROUND_ROBIN, planned=False)
    kept, over = forward_bytes(ROUND_ROBIN, planned=True)
    assert (kept - must_only, over) == (budget, 0)
    must_only, _ = forward_bytes(TO_EXPERTS_0_AND_1, planned=False)
    kept, over = forward_bytes(TO_EXPERTS_0_AND_1, planned=True)
    assert (kept - must_only, over) == (0, 1)  # 16 tokens' worth would have doubled the bytes
    # Exact either way.
    _fixed_routing(plain.mlp, TO_EXPERTS_0_AND_1)
    ref = step(plain, lambda: plain(*args).sum())
    with tapesac_core.use_plan(plan):
        assert_bitwise(ref, step(block, lambda: block(*args).sum()))


def test_anchored_coordinates_keep_the_values_of_submodules_whose_ops_did_not_change() -> None:
    from support import assert_bitwise, step

    plain, block, args = _routed_moe(skip_empty_experts=True)
    _fixed_routing(block.mlp, ROUND_ROBIN)
    tape = _reference_tape(block, args)

    def value(module: str, op: str) -> int:
        (node,) = [n for n in tape.nodes if n.module == module and n.name == op]
        return node.outs[0]

    # The query projection and the shared expert run the same ops however tokens are routed;
    # the router's softmax is issued by the MoE module itself, whose loop over experts changes.
    chosen = {
        value("self_attn.q_proj", "aten.mm.default"),
        value("mlp.shared_expert.up_proj", "aten.mm.default"),
        value("mlp", "aten._softmax.default"),
    }
    anchors = frozenset(tape.anchor(v) for v in chosen)
    plan = _one_region_plan(
        tape,
        chosen,
        anchors=(anchors,),
        modules={m: tape.module_fingerprints[m] for m, *_ in anchors},
    )
    _fixed_routing(block.mlp, TO_EXPERTS_0_AND_1)
    must_only, _ = _forward_bytes(block, {}, args)
    kept, trace = _forward_bytes(block, plan, args)
    drifted = trace.tape
    assert trace.sequence_changed and drifted.fingerprint != tape.fingerprint
    assert {drifted.anchor(v) for v in drifted.planned} == {a for a in anchors if a[0] != "mlp"}
    assert kept - must_only == drifted.saved_bytes(drifted.planned) == 2 * 16 * 64 * 4
    _fixed_routing(plain.mlp, TO_EXPERTS_0_AND_1)
    with tapesac_core.use_plan(plan):
        assert_bitwise(
            step(plain, lambda: plain(*args).sum()), step(block, lambda: block(*args).sum())
        )


class _CastBlock(torch.nn.Module):
    """A linear layer under bf16 autocast: the weight cast does not grow with tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.proj(x).float().sin()


def test_values_that_do_not_grow_with_tokens_are_not_scaled_in_the_plan() -> None:
    from tapesac_core.control.profile import region_profiles
    from tapesac_core.control.solve import scaled

    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(_CastBlock(), region="cast")
    x = torch.randn(8, 64, requires_grad=True)
    with tapesac_core.trace(time_nodes=True) as blocks:
        block(x).sum().backward()
    profile = region_profiles(blocks, {"cast": 8})["cast"]
    tape = profile.tape
    casts = tape.token_independent
    # The weight and bias casts to bf16 and the transposed weight: from parameters alone.
    assert sorted(tape.coord(v) for v in casts) == [
        ("aten._to_copy.default", 0, 0),
        ("aten._to_copy.default", 1, 0),
        ("aten.t.default", 0, 0),
    ]
    points = profile.frontier(beam_width=8, max_set_size=8)
    with_weight = [p for p in points if profile.graph.value_ids(p.saved) & casts]
    assert with_weight  # some save sets keep the weight cast
    for p in with_weight:
        fixed = tape.saved_bytes(profile.graph.value_ids(p.saved) & casts)
        assert fixed > 0 and profile.bytes_at(p, 4.0) == fixed + 4 * (p.bytes - fixed)
    at_4x = scaled(points, 4.0, profile.bytes_at)  # what the solver plans with at 4x the tokens
    reference = {p.saved: p for p in points}
    assert at_4x[0].bytes == 0
    assert all(q.bytes == profile.bytes_at(reference[q.saved], 4.0) for q in at_4x)
