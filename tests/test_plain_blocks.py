"""Plain blocks in a plan: run as without checkpointing (not recorded, nothing replayed), mixed
with TapeSAC blocks of the same region type; loss and gradients bitwise those of no checkpointing."""

import copy
import dataclasses

import pytest
import torch
from support import (
    BLOCK_CLASSES,
    SHORT_SCHEDULE,
    WIDE,
    assert_bitwise,
    checkpointed_lm,
    reference_and_copy,
    step,
    token_ids,
)

import tapesac_core
from benchmarks.limit_ends import rise
from benchmarks.measure import live_bytes
from examples.models import DecoderLM
from tapesac_core import PLAIN, TORCH_CHECKPOINT
from tapesac_core.blocks.trace_scope import trace
from tapesac_core.control.profile import merged, plain_bytes, region_profiles
from tapesac_core.measure.memory import profile_memory
from tapesac_core.plan.plan import BlockKind, Plan, RegionPlan


def _model(moe: bool = False) -> tuple[DecoderLM, DecoderLM, torch.Tensor]:
    """A reference model and its TapeSAC copy (dropout on), and a batch."""
    reference, model = reference_and_copy(num_layers=4, dropout=0.1, moe=moe)
    return reference, model, token_ids(1, batch=2, seq=32)


def _step(model: DecoderLM, ids: torch.Tensor, seed: int = 0) -> tuple:
    torch.manual_seed(seed)  # dropout draws the same numbers in both runs
    return step(model, lambda: model.loss(ids))


MIXES = {
    "plain, must-only, plain, planned": [PLAIN, set(), PLAIN, {("aten.mm.default", 0, 0)}],
    "all plain": [PLAIN],
    "planned first, plain last": [{("aten.mm.default", 1, 0)}, set(), PLAIN, PLAIN],
    "torch checkpoint, plain, planned, must-only": [
        TORCH_CHECKPOINT,
        PLAIN,
        {("aten.mm.default", 0, 0)},
        set(),
    ],
    "all torch checkpoint": [TORCH_CHECKPOINT],
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_mixes_of_plain_and_planned_blocks_are_bitwise(moe, mix) -> None:
    reference, model, ids = _model(moe)
    region = "MoEDecoderLayer" if moe else "DecoderLayer"
    entries = MIXES[mix]
    plain, checkpointed = [], []
    with (
        tapesac_core.use_plan({region: entries}),
        tapesac_core.trace(plain=plain, torch_checkpointed=checkpointed) as blocks,
    ):
        got = _step(model, ids)
    assert_bitwise(_step(reference, ids), got)
    # The region's block counter moved past the blocks not recorded.
    names = [f"layers.{i}" for i in range(4)]
    assert plain == [n for i, n in enumerate(names) if entries[i % len(entries)] is PLAIN]
    assert checkpointed == [
        n for i, n in enumerate(names) if entries[i % len(entries)] is TORCH_CHECKPOINT
    ]
    assert [b.tape.name for b in blocks] == [
        n for n in names if n not in plain and n not in checkpointed
    ]
    assert all(b.replayed for b in blocks)  # the recorded ones still replay


def test_a_mix_changing_between_steps_is_bitwise_at_every_step() -> None:
    reference, model, ids = _model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    mixes = [[PLAIN, set()], [set(), PLAIN], [TORCH_CHECKPOINT, PLAIN], [PLAIN], [set()]]
    for seed, entries in enumerate(mixes):
        want = _step(reference, ids, seed)
        with tapesac_core.use_plan({"DecoderLayer": entries}):
            got = _step(model, ids, seed)
        assert_bitwise(want, got)
        for (m, optimizer), (_, grads) in zip(zip((reference, model), optimizers), (want, got)):
            for name, p in m.named_parameters():
                p.grad = grads[name].clone()
            optimizer.step()


def test_a_solved_plan_runs_its_blocks_as_their_kinds_say_and_reads_older_plans_as_before():
    reference, model, ids = _model()
    tape, plain, ckpt = BlockKind.TAPE, BlockKind.PLAIN, BlockKind.TORCH_CHECKPOINT
    plan = Plan(
        model=("DecoderLayer",),
        regions={
            "DecoderLayer": RegionPlan(
                sequence="any",
                blocks=(frozenset(),) * 4,
                tokens=ids.numel(),
                kinds=(tape, plain, ckpt, plain),
            )
        },
        capacity=0,
        base=0,
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
    )
    loaded = Plan.from_json(plan.to_json())
    assert loaded.regions["DecoderLayer"].kinds == (tape, plain, ckpt, plain)
    assert "values saved per block: [0, plain, torch checkpoint, plain]" in loaded.explain()
    assert not loaded.empty
    ran_plain: list[str] = []
    ran_ckpt: list[str] = []
    with (
        tapesac_core.use_plan(loaded),
        tapesac_core.trace(plain=ran_plain, torch_checkpointed=ran_ckpt),
    ):
        got = _step(model, ids)
    assert (ran_plain, ran_ckpt) == (["layers.1", "layers.3"], ["layers.2"])
    assert_bitwise(_step(reference, ids), got)
    kinds = '"kinds": ["tape", "plain", "torch_checkpoint", "plain"], '
    assert kinds in plan.to_json()
    version_3 = (
        plan.to_json()
        .replace('"version": 5', '"version": 3')
        .replace(kinds, '"plain": [false, true, false, true], ')
    )
    assert Plan.from_json(version_3).regions["DecoderLayer"].kinds == (tape, plain, tape, plain)
    version_2 = plan.to_json().replace('"version": 5', '"version": 2').replace(kinds, "")
    assert Plan.from_json(version_2).regions["DecoderLayer"].kinds == ()  # used as before: none


def test_a_plain_block_holds_what_autograd_saves_as_without_checkpointing() -> None:
    reference, model, ids = _model()
    _, plain = profile_memory(lambda: reference.loss(ids))
    with tapesac_core.use_plan({"DecoderLayer": [PLAIN]}):
        _, all_plain = profile_memory(lambda: model.loss(ids))
    _, must_only = profile_memory(lambda: model.loss(ids))
    assert all_plain.end == plain.end > must_only.end  # exact bytes: the profiler's


def _planned_step(controller, model, ids, seed: int):
    with controller.step(tokens=ids.numel()) as report:
        got = _step(model, ids, seed)
    return report, got


def test_the_planner_runs_blocks_plain_where_memory_allows_and_the_limit_holds() -> None:
    reference, model, ids = _model()
    controller = tapesac_core.Controller(model, "1GiB", **SHORT_SCHEDULE, plain_blocks=True)
    for seed in range(4):
        report, got = _planned_step(controller, model, ids, seed)
    assert report.mode == "planned"
    # With memory to spare every block runs as without checkpointing: nothing recorded.
    assert report.plan.regions["DecoderLayer"].kinds == (BlockKind.PLAIN,) * 4
    assert report.plain_blocks == 4 and report.blocks == 0
    assert "values saved per block: [plain, plain, plain, plain]" in report.plan.explain()
    assert_bitwise(_step(reference, ids, 3), got)
    generous = report.plan
    # A limit between must-only and all plain: the plan's predicted peak fits its capacity and
    # the metered step (the first after solving) stays under the limit.
    limit = (generous.base + generous.predicted_peak) // 2
    controller.replan(memory_limit=limit)
    report, got = _planned_step(controller, model, ids, 4)
    plan = report.plan
    assert plan.predicted_peak <= plan.capacity and report.peak is not None
    assert report.peak <= limit, (report.peak, limit)
    assert report.plain_blocks < 4 and report.plain_blocks + report.blocks == 4
    assert_bitwise(_step(reference, ids, 4), got)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_plain_blocks_peak_as_predicted_autograd_freeing_their_values_in_backward(moe) -> None:
    """A plain block's saved values go when autograd's node that reads them last has run, not
    at the block's end: predicted so (also at the instant of its release, where the MoE's
    all-plain step peaks in the model otherwise), the all-plain step's peak is the metered one."""
    model = checkpointed_lm(BLOCK_CLASSES, **WIDE, moe=moe)
    ids = token_ids(1, batch=2, seq=256)
    controller = tapesac_core.Controller(model, "1GiB", **SHORT_SCHEDULE, meter_every=1)
    ratios = []
    for seed in range(5):
        report, _ = _planned_step(controller, model, ids, seed)
        if report.mode == "planned":
            assert report.plain_blocks == 4
            ratios.append(report.peak / report.predicted_peak)
    assert ratios and all(abs(r - 1) < 0.002 for r in ratios), ratios


class Masked(torch.nn.Module):
    """Keeps, for backward, the entries of its input above ``threshold``: how many, the data
    decides (a boolean-mask index, as tokens routed to an expert)."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.w = torch.nn.Parameter(torch.full((64,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[x > self.threshold]
        return (x * self.w).tanh() + kept.sin().pow(2).sum()


def test_plain_blocks_of_data_dependent_sizes_are_given_the_worst_blocks_bytes() -> None:
    """The first block (the region's reference) keeps the fewest values, the others more: every
    block planned plain is given the most any kept, so the metered step stays under its
    prediction (with the reference's bytes it is 245,694 B over)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Masked(t) for t in (1.5, 0.5, -0.5, -1.5)))
    tapesac_core.checkpoint_modules(model, {Masked})
    x = torch.randn(512, 64, requires_grad=True)
    controller = tapesac_core.Controller(model, "1GiB", **SHORT_SCHEDULE, meter_every=1)
    reports = []
    for _ in range(5):
        with controller.step(tokens=512) as report:
            model(x).sum().backward()
        reports.append(report)
    with trace() as traces:
        model(x).sum().backward()
    kept = [plain_bytes(t.tape) for t in traces]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    profile = controller.profiles["Masked"]
    assert profile.data_dependent and profile.plain_worst == kept[-1]
    planned = [r for r in reports if r.mode == "planned"]
    assert planned and all(r.plain_blocks == 4 for r in planned)
    assert "a plain block is given the bytes of the most any block" in planned[-1].plan.explain()
    for r in planned:
        # Never under. Over by the first block's shortfall from the worst (held to the
        # backward) and by the last block's excess over the reference, which the model frees in
        # that block's backward at the reference's sizes: twice the spread, here.
        assert 0 <= r.predicted_peak - r.peak <= 2 * (kept[-1] - kept[0]) + 1, (
            r.peak,
            r.predicted_peak,
        )


def test_recorded_blocks_of_data_dependent_sizes_are_planned_at_the_worst_sizes() -> None:
    """The reference block (the first) keeps the most, the others fewer: a save set's replay
    bytes on the reference tape are not what it moves on the others. The plan says so, and the
    first planned step meters under its prediction and the limit."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(Masked(t) for t in (-1.5, -0.5, 0.5, 1.5)))
    x = torch.randn(512, 64, requires_grad=True)
    rises = {}
    for name in ("none", "must_only"):
        model = copy.deepcopy(base)
        if name == "must_only":
            tapesac_core.checkpoint_modules(model, {Masked})
        model(x).sum().backward()
        rises[name] = rise(lambda m=model: m(x).sum().backward())
    model = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {Masked})
    allowed = rises["must_only"] + (rises["none"] - rises["must_only"]) * 3 // 10
    static = live_bytes(torch.device("cpu"))
    limit = static + allowed
    controller = tapesac_core.Controller(
        model, limit, margin=0.0, near_limit=1.0, **SHORT_SCHEDULE | dict(control_steps=0)
    )
    report = None
    while report is None or report.mode != "planned":
        with controller.step(tokens=512) as report:
            model(x).sum().backward()
    plan = report.plan
    assert plan is not None and any(plan.regions["Masked"].blocks)  # recorded, saving
    assert "replay sizes depend on data" in plan.explain()
    assert controller.profiles["Masked"].data_factor > 1
    assert report.peak is not None and report.predicted_peak is not None
    assert report.peak <= report.predicted_peak <= limit


class Sliced(Masked):
    """``Masked``, plus a slice of its input whose length each block sets (``rows``): a size no
    op computes from the data, which only comparing blocks shows."""

    def __init__(self, threshold: float, rows: int) -> None:
        super().__init__(threshold)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x[: self.rows].exp().sum()


def test_values_blocks_of_one_op_sequence_size_differently_count_as_sized_by_the_data() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Sliced(t, r) for t, r in ((1.0, 128), (0.5, 256), (1.0, 128))))
    tapesac_core.checkpoint_modules(model, {Sliced})
    x = torch.randn(512, 64, requires_grad=True)

    def profile():
        with trace() as traces:
            model(x).sum().backward()
        assert len({t.tape.fingerprint for t in traces}) == 1
        return region_profiles(list(traces), {"Sliced": 512})["Sliced"]

    first = profile()
    tape = first.tape
    ops = {tape.nodes[v.node].name: v.vid for v in tape.values if v.node >= 0}
    routed, sliced = ops["aten.index.Tensor"], ops["aten.exp.default"]
    assert first.data_dependent and routed in tape.data_sized and sliced not in tape.data_sized
    assert first.varied >= {routed, sliced} and {routed, sliced} <= first.data_sized
    assert ops["aten.tanh.default"] not in first.data_sized  # the same on every block
    # What one profiling step saw differ stays sized by the data after the next.
    second = dataclasses.replace(profile(), varied=frozenset())
    assert merged(first, second).varied == first.varied
    # A block alone in its op sequence has nothing to compare with: every value may be sized by
    # the data, and its region is priced as if all were.
    with trace() as traces:
        model[0](x).sum().backward()
    alone = region_profiles(list(traces), {"Sliced": 512})["Sliced"]
    assert alone.data_sized == {v.vid for v in alone.tape.values}
