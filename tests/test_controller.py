"""The controller's state machine, with memory readings the test chooses (an injected meter)."""

import dataclasses
import gc
import json
import logging
import weakref

import pytest
import torch
from support import (
    SHORT_SCHEDULE,
    SMALL,
    FakeMeter,
    run_step,
    setup_controller,
    tiny_lm,
    token_ids,
)

import tapesac_core
from examples.models import DecoderLayer
from tapesac_core.control.controller import (
    CONTROL,
    FULL,
    PLANNED,
    PROFILE,
    SAMPLE,
    WARMUP,
    Controller,
)
from tapesac_core.measure.memory import MemoryReading
from tapesac_core.plan import bucket, upper_edge
from tapesac_core.plan.plan import PLAN_VERSION
from tapesac_core.tape.steady_cache import steady_cache
from tapesac_core.units import GiB, KiB, MiB


class CachingAllocatorMeter(FakeMeter):
    """Reads as a caching allocator does: reserved memory is never given back, so after one step
    near the limit it stays there; ``retries`` allocations retried in the next metered step."""

    def __init__(self) -> None:
        super().__init__(base=8 * MiB)  # small, so that 1% of the limit is less than the plan
        self.reserved = self.start = self.retries = self.window_retries = 0

    def __enter__(self) -> "CachingAllocatorMeter":
        self.start, self.window_retries, self.retries = self.reserved, self.retries, 0
        return self

    def reading(self) -> MemoryReading:
        r = super().reading()
        self.reserved = max(self.reserved, r.peak)
        return dataclasses.replace(
            r,
            reserved=self.reserved,
            alloc_retries=self.window_retries,
            reserved_growth=self.reserved - self.start,
        )


def test_the_controller_keeps_no_tape_of_a_finished_step() -> None:
    """The last report stays on the controller for logs, without its block traces: the tapes
    go when the caller drops its report, but those the blocks' steady-state caches keep, which
    hold no random generator state (blocks with random ops are not cached)."""
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        report = run_step(model, meter, c, 32)
    assert report.mode == PLANNED and len(report.block_traces) == 3
    tapes = [weakref.ref(t.tape) for t in report.block_traces]
    assert c.report.plan is report.plan and c.report.block_traces == []
    del report
    gc.collect()
    cached = {id(t) for m in model.modules() for t in steady_cache(m).tapes()}
    assert all(t() is None or id(t()) in cached for t in tapes)
    assert not any(n.rng for t in tapes if t() is not None for n in t().nodes)


def test_state_machine_warmup_profile_control_then_one_plan_per_bucket() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    modes = [run_step(model, meter, c, 32).mode for _ in range(5)]
    assert modes == [WARMUP, PROFILE, CONTROL, PLANNED, PLANNED]
    assert len(c.plans) == 1
    (key,) = c.plans
    q = bucket(64, 1.1)
    assert key == (q,)
    # Solved for the tokens the bucket has seen, not its upper edge (66).
    assert c.plans[key].regions["DecoderLayer"].tokens == 64 < upper_edge(q, 1.1)
    assert not c.plans[key].empty
    # Fewer tokens in the same bucket reuse the plan: no new solve, no new memory sample.
    readings, plan = meter.readings, c.plans[key]
    report = run_step(model, meter, c, 31)  # 62 tokens: 1.1**q <= 62 < 64 < 1.1**(q+1)
    assert bucket(62, 1.1) == q and report.mode == PLANNED and c.plans == {key: plan}
    assert meter.readings == readings


def test_a_bucket_is_solved_for_the_most_tokens_it_has_seen(caplog) -> None:
    # The must-only peak grows by 1 MiB per token: 128 MiB at 64 tokens, 130 MiB at 66 (the
    # same bucket). The capacity, 130.1 MiB, lets the plan solved at 64 save more than it can
    # keep at 66.
    model, meter, c = setup_controller(int(130.1 * MiB / 0.98), FakeMeter(per_token=MiB))
    for _ in range(4):
        run_step(model, meter, c, 32)
    (key,) = c.plans
    at_64, capacity = c.plans[key], c.budget.capacity(c.memory)
    assert at_64.regions["DecoderLayer"].tokens == 64 and not at_64.empty
    assert at_64.predicted_peak <= capacity < c.predicted_peak(at_64, {"DecoderLayer": 66})
    # 66 tokens: the plan would not fit them, so the bucket is solved for them before the step.
    with caplog.at_level(logging.INFO, logger="tapesac_core"):
        readings = meter.readings
        report = run_step(model, meter, c, 33)
    at_66 = c.plans[key]
    assert report.plan is at_66 and at_66.regions["DecoderLayer"].tokens == 66
    assert "bucket (43,) is solved again: tokens {'DecoderLayer': 66} are more than" in caplog.text
    assert not at_66.empty and report.predicted_peak <= capacity < at_66.predicted_peak + 2**20
    assert meter.readings > readings and report.peak  # the new plan's first step is metered
    # No new most: the same plan, whatever the count in the bucket.
    for seq in (33, 32, 31):
        assert run_step(model, meter, c, seq).plan is at_66


def test_more_tokens_keep_a_plan_predicted_to_fit_them(caplog) -> None:
    model, meter, c = setup_controller(1024 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 31)  # 62 tokens
    (key,) = c.plans
    plan = c.plans[key]
    with caplog.at_level(logging.INFO, logger="tapesac_core"):
        report = run_step(model, meter, c, 33)  # 66 tokens, the same bucket
    assert report.plan is plan and plan.regions["DecoderLayer"].tokens == 62
    assert report.predicted_peak == c.predicted_peak(plan, {"DecoderLayer": 66})
    assert report.predicted_peak < plan.predicted_peak + 2 * 4096 * 4  # scaled to 66 tokens
    assert "solved again" not in caplog.text
    # The bucket remembers 66: solved again (here: a new limit), the plan is for 66.
    c.replan()
    assert c.plan_for(62).regions["DecoderLayer"].tokens == 66


def test_a_new_bucket_gets_its_own_plan_solved_for_its_tokens() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    report = run_step(model, meter, c, 36)  # 72 tokens: 12.5% more, a new bucket, no new sample
    assert report.mode == CONTROL
    report = run_step(model, meter, c, 36)
    assert report.mode == PLANNED and len(c.plans) == 2
    assert report.plan.regions["DecoderLayer"].tokens == 72


def test_memory_is_sampled_again_when_tokens_move_more_than_15_percent() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    assert [s.tokens for s in c.memory.samples] == [64]
    assert run_step(model, meter, c, 36).mode == CONTROL  # 72 tokens: within 15%
    assert run_step(model, meter, c, 38).mode == SAMPLE  # 76 tokens: 18.75% away
    assert [s.tokens for s in c.memory.samples] == [64, 76]


def test_a_region_is_profiled_again_when_its_tokens_exceed_twice_the_reference() -> None:
    model, meter, c = setup_controller(64 * MiB + 8 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    assert c.profiles["DecoderLayer"].tokens == 64
    report = run_step(model, meter, c, 66)  # 132 tokens > 2 x 64
    assert report.mode == PROFILE
    assert c.profiles["DecoderLayer"].tokens == 132


def test_fragmentation_near_the_limit_shrinks_the_plan(caplog) -> None:
    limit = 64 * MiB + 2 * MiB
    model, meter, c = setup_controller(limit)
    for _ in range(3):
        run_step(model, meter, c, 32)
    meter.extra = (
        int(0.995 * limit) - meter.base - meter.per_token * 64
    )  # the planned step reads 99.5%
    with caplog.at_level(logging.WARNING):
        first = run_step(model, meter, c, 32)
    assert first.mode == PLANNED and first.peak == int(0.995 * limit)
    first = first.plan
    assert "raising the fragmentation estimate" in caplog.text
    meter.extra = 0
    second = run_step(model, meter, c, 32).plan
    assert c.memory.extra_fragmentation > 0
    assert second.saved_bytes < first.saved_bytes
    assert second.capacity < first.capacity


def _near_limit_step(limit, caplog, meter=None):
    """Three steps to the first plan, then one planned step whose peak reads 99.5% of the limit
    (on a ``CachingAllocatorMeter`` unless ``meter`` is given)."""
    model, meter, c = setup_controller(limit, meter or CachingAllocatorMeter())
    for _ in range(3):
        run_step(model, meter, c, 32)
    meter.extra = int(0.995 * limit) - meter.base - meter.per_token * 64
    with caplog.at_level(logging.WARNING):
        near = run_step(model, meter, c, 32)
    meter.extra = 0
    assert near.mode == PLANNED and near.plan.saved_bytes > 0
    return model, meter, c, near.plan


def _raises(caplog) -> int:
    return caplog.text.count("raising the fragmentation estimate")


def test_reserved_memory_left_by_one_near_limit_step_raises_once_and_leaves_the_plan_stable(
    caplog,
) -> None:
    limit = 8 * MiB + 650 * KiB
    model, meter, c, before = _near_limit_step(limit, caplog)
    with caplog.at_level(logging.WARNING):
        plans = [run_step(model, meter, c, 32).plan for _ in range(6)]
    assert meter.reserved == int(0.995 * limit)  # the allocator still holds the near-limit peak
    assert _raises(caplog) == 1
    assert c.memory.extra_fragmentation == max(
        int(int(0.995 * limit) - 0.99 * limit), int(0.01 * limit)
    )
    assert 0 < plans[0].saved_bytes < before.saved_bytes  # the one real event shrank the plan
    assert all(p.coordinates() == plans[0].coordinates() for p in plans)
    assert "the near-limit rule lowered the capacity" in plans[0].explain()
    assert "near-limit rule" not in before.explain()


class LiveBytesMeter(CachingAllocatorMeter):
    """Reads live tensor bytes, as the CPU meter does: no allocator, nothing fragments."""

    def reading(self) -> MemoryReading:
        return dataclasses.replace(super().reading(), allocator=False)


def test_a_live_bytes_meter_near_the_limit_raises_nothing(caplog) -> None:
    """A plan that fills the limit on a meter of live bytes is what was asked for: the near-limit
    rule (fragmentation) has nothing to estimate there."""
    model, meter, c, near = _near_limit_step(8 * MiB + 650 * KiB, caplog, LiveBytesMeter())
    with caplog.at_level(logging.WARNING):
        plans = [run_step(model, meter, c, 32).plan for _ in range(3)]
    assert _raises(caplog) == 0 and c.memory.extra_fragmentation == 0
    assert all(p.coordinates() == near.coordinates() for p in plans)
    assert "near-limit rule" not in plans[-1].explain()


def test_allocation_retries_raise_once_although_the_peak_is_below_the_limit(caplog) -> None:
    limit = 8 * MiB + 650 * KiB
    model, meter, c = setup_controller(limit, CachingAllocatorMeter())
    for _ in range(3):
        run_step(model, meter, c, 32)
    meter.retries = 3  # the first planned step: the allocator freed its cache and retried
    with caplog.at_level(logging.WARNING):
        first = run_step(model, meter, c, 32)
        plans = [run_step(model, meter, c, 32).plan for _ in range(4)]
    assert first.mode == PLANNED and first.peak < 0.99 * limit
    assert _raises(caplog) == 1
    assert c.memory.extra_fragmentation == int(0.01 * limit)
    assert plans[0].capacity < first.plan.capacity
    assert all(p.coordinates() == plans[0].coordinates() for p in plans)


def test_a_sample_step_that_fits_in_memory_reserved_earlier_measures_no_fragmentation(
    caplog,
) -> None:
    limit = 8 * MiB + 650 * KiB
    model, meter, c, _ = _near_limit_step(limit, caplog)
    assert run_step(model, meter, c, 38).mode == SAMPLE  # 76 tokens: a new memory sample
    assert meter.reserved > meter.base + meter.per_token * 76
    assert c.memory.measured_fragmentation == 0


def _planned(limit, **settings):
    """The plan of the first planned step, with node times fixed at 1 ms (no timing noise)."""
    model, meter, c = setup_controller(limit, **settings)
    for _ in range(2):
        run_step(model, meter, c, 32)
    for profile in c.profiles.values():
        profile.node_time = dict.fromkeys(profile.node_time, 1e-3)
    for _ in range(2):
        report = run_step(model, meter, c, 32)
    assert report.mode == PLANNED
    return report.plan


def test_later_blocks_get_the_larger_sets() -> None:
    everything = _planned(GiB, margin=0.0)
    per_block = everything.saved_bytes // 3
    plan = _planned(everything.base + int(1.5 * per_block), margin=0.0)
    sizes = [len(b) for b in plan.regions["DecoderLayer"].blocks]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes
    assert plan.saved_bytes <= plan.capacity - plan.base


def test_the_must_only_peak_above_the_limit_warns_once_and_runs_must_only(caplog) -> None:
    model, meter, c = setup_controller(
        64 * MiB
    )  # the fake must-only peak is 64 MiB + tokens x 4 KiB
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            report = run_step(model, meter, c, 32)
    assert report.mode == PLANNED and report.plan.empty and report.saved_bytes == 0
    assert caplog.text.count("no plan fits") == 1
    # At the tokens seen, 64: 64 MiB + 64 x 4 KiB; the capacity is the limit less 2%.
    assert "the must-only step alone needs 64.25 MiB" in caplog.text
    assert "predicted at 64.25 MiB, 1.53 MiB above the 62.72 MiB the limit leaves" in caplog.text
    assert "Fix: a memory_limit of at least 65.53 MiB" in caplog.text
    # The metered planned step near the limit raises nothing: there is no lower plan to solve.
    assert "raising the fragmentation estimate" not in caplog.text and c.plans


def test_state_dict_round_trip_reuses_plans_without_profiling() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    state = c.state_dict()
    model2, meter2, fresh = setup_controller(64 * MiB + 2 * MiB)
    fresh.load_state_dict(state)
    assert fresh.plans.keys() == c.plans.keys()
    assert fresh.plans[(bucket(64, 1.1),)] == c.plans[(bucket(64, 1.1),)]
    report = run_step(
        model2, meter2, fresh, 32
    )  # resumed: no warm-up, no profiling, the stored plan
    assert report.mode == PLANNED and report.plan == c.plans[(bucket(64, 1.1),)]
    assert not fresh.profiles  # nothing was profiled again
    with pytest.raises(tapesac_core.TapeSACError, match="another model"):
        fresh.load_state_dict({**state, "model": "Other"})


def test_a_version_4_state_with_buckets_named_as_text_resumes_its_plans_and_times() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    state = json.loads(json.dumps(c.state_dict()))  # as the HF Trainer's checkpoints keep it
    by_bucket = ("plans", "must_only_times", "planned_times", "full_times")
    old = {
        **state,
        "version": 4,
        "model": ",".join(state["model"]),
        **{f: {",".join(map(str, k)): v for k, v in state[f]} for f in by_bucket},
    }
    model2, meter2, fresh = setup_controller(64 * MiB + 2 * MiB)
    fresh.load_state_dict(old)
    assert fresh.plans == c.plans and fresh.times.state_dict() == c.times.state_dict()
    assert run_step(model2, meter2, fresh, 32).mode == PLANNED


def test_a_version_5_state_naming_the_model_as_text_resumes_its_plans_and_times() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    state = json.loads(json.dumps(c.state_dict()))  # as the HF Trainer's checkpoints keep it
    assert state["model"] == ["DecoderLayer"] == list(c.model_key.regions)
    old = {**state, "version": 5, "model": "DecoderLayer"}  # as version 5 wrote it
    model2, meter2, fresh = setup_controller(64 * MiB + 2 * MiB)
    fresh.load_state_dict(old)
    assert fresh.plans == c.plans and fresh.times.state_dict() == c.times.state_dict()
    assert run_step(model2, meter2, fresh, 32).mode == PLANNED
    with pytest.raises(tapesac_core.TapeSACError, match=r"\['Other'\].*another model"):
        fresh.load_state_dict({**state, "model": ["Other"]})


def test_full_checkpointing_control_steps_run_torch_checkpoint_on_every_block_and_record_none() -> (
    None
):
    model, meter, c = setup_controller(64 * MiB + 2 * MiB, full_control_every=3)
    counted = []
    original = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        counted.append(kwargs.get("use_reentrant"))
        return original(fn, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = counting
    try:
        reports = [run_step(model, meter, c, seq=16) for _ in range(12)]
    finally:
        torch.utils.checkpoint.checkpoint = original
    modes = [r.mode for r in reports]
    # warm-up, profile, control; then a full step before the first planned step and one per
    # three planned steps of the bucket.
    assert modes == [
        WARMUP,
        PROFILE,
        CONTROL,
        FULL,
        PLANNED,
        PLANNED,
        PLANNED,
        FULL,
        PLANNED,
        PLANNED,
        PLANNED,
        FULL,
    ]
    full = [r for r in reports if r.mode == FULL]
    assert [(r.blocks, r.replayed_nodes, r.torch_checkpointed, r.peak) for r in full] == [
        (0, 0, 3, None)
    ] * 3
    assert counted == [False] * 9  # torch.utils.checkpoint(use_reentrant=False), every block
    assert all(r.blocks == 3 for r in reports if r.mode != FULL)
    # The first planned step is metered (CPU), not timed: no ratio until the second.
    assert reports[4].measured_speedup is None and reports[4].measured_speedup_vs_full is None
    assert "metered for memory, not timed" in reports[4].measured_reason
    later = reports[5]
    assert later.measured_reason is None
    assert later.measured_speedup == pytest.approx(
        c.times.must_only[later.bucket][0] / c.times.planned[later.bucket][0]
    )
    assert later.measured_speedup_vs_full == pytest.approx(
        c.times.full[later.bucket][0] / c.times.planned[later.bucket][0]
    )


def test_measured_reason_names_what_is_missing() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    first = run_step(model, meter, c, seq=16)
    assert first.measured_speedup is None
    assert first.measured_reason == (
        "no plan yet for this token bucket (warming up, profiling or sampling memory)"
    )


def _micro_batches(seq: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (2, seq), generator=g) for _ in range(2)]


def test_several_micro_batches_in_one_step_are_an_error_saying_to_bracket_each() -> None:
    # Under Eq. 8: the peak-aware model plans several micro-batches in one step correctly
    # (tests/test_peak_sweep.py::test_two_micro_batches_in_one_step_the_second_starts_from_freed_memory).
    model, meter, c = setup_controller(64 * MiB + 2 * MiB, memory_model="sum")
    for _ in range(4):
        run_step(model, meter, c, 32)
    first, second = _micro_batches()
    with pytest.raises(
        tapesac_core.TapeSACError,
        match=r"block 'layers.0' ran its forward after the backward.*Fix: bracket "
        r"each micro-batch in its own `with controller.step",
    ):
        with c.step(tokens=first.numel()):
            model.loss(first).backward()
            model.loss(second).backward()
    # Two forwards, then one backward of both: both micro-batches' blocks are alive together,
    # as the plan counts them, and that is accepted.
    with c.step(tokens=first.numel()) as report:
        (model.loss(first) + model.loss(second)).backward()
    assert report.blocks == 6


def test_gradient_accumulation_with_one_step_per_micro_batch_is_bitwise() -> None:
    plain = tiny_lm(**SMALL)
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    model.load_state_dict(plain.state_dict())
    for _ in range(4):
        run_step(model, meter, c, 32)
    modes = []
    for ids in _micro_batches():
        plain.loss(ids).backward()
        with c.step(tokens=ids.numel()) as report:
            model.loss(ids).backward()
        modes.append(report.mode)
    assert modes == [PLANNED, PLANNED] and not c.plan.empty
    got = dict(model.named_parameters())
    different = [n for n, p in plain.named_parameters() if not torch.equal(p.grad, got[n].grad)]
    assert not different


def test_a_zero_memory_limit_runs_must_only_in_planned_steps(caplog) -> None:
    model, meter, c = setup_controller(0.0)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            run_step(model, meter, c, 32)
        must_only = run_step(model, meter, c, 32)  # a control step: must-only by definition
        assert must_only.mode == CONTROL
        report = run_step(model, meter, c, 32)
    # Asked for, so said once at info level, never warned about.
    assert caplog.text.count("memory_limit is 0: every step runs must-only") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert report.mode == PLANNED and report.plan.empty and report.saved_bytes == 0
    for b, m in zip(report.block_traces, must_only.block_traces, strict=True):
        assert b.saved <= frozenset(b.tape.mandatory) and not b.tape.planned
        assert b.replayed == m.replayed


def test_a_control_step_runs_every_control_every_planned_steps() -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB, control_every=3)
    modes = [run_step(model, meter, c, 32).mode for _ in range(11)]
    assert modes == [WARMUP, PROFILE, CONTROL] + [PLANNED] * 3 + [CONTROL] + [PLANNED] * 3 + [
        CONTROL
    ]
    assert len(c.times.must_only[(bucket(64, 1.1),)]) == 3  # the three control steps' times


def test_secondary_regions_bucket_their_largest_count_so_far_with_their_own_factor() -> None:
    model = tiny_lm(**SMALL)
    last = model.layers[2]
    tapesac_core.checkpoint_modules(
        model, {DecoderLayer}, regions=lambda m: "vision" if m is last else "text"
    )
    meter = FakeMeter()
    c = Controller(
        model,
        64 * MiB + 2 * MiB,
        meter=meter,
        **SHORT_SCHEDULE,
        secondary_regions={"vision"},
        secondary_bucket_factor=2.0,
    )
    ids = token_ids(0, batch=2, seq=32)
    meter.tokens = ids.numel()

    def run(vision: int):
        with c.step(tokens={"text": ids.numel(), "vision": vision}) as report:
            model.loss(ids).backward()
        model.zero_grad(set_to_none=True)
        return report

    reports = [run(v) for v in (8, 8, 8, 15, 4)]  # 8..15 share bucket 3 of factor 2; 4: 8 so far
    assert [r.mode for r in reports] == [WARMUP, PROFILE, CONTROL, PLANNED, PLANNED]
    assert {r.bucket for r in reports} == {(bucket(64, 1.1), 3)}
    assert reports[-1].tokens["vision"] == 4  # the bucket, not the count, remembers the largest
    assert reports[-1].plan.regions["vision"].tokens == 15  # the most seen in its bucket
    assert reports[-1].plan.regions["text"].tokens == 64
    # 16 is a new bucket (4); from then on 9 is in it too (with factor 1.1 it would be bucket 23).
    reports = [run(v) for v in (16, 16, 9)]
    assert [r.mode for r in reports] == [CONTROL, PLANNED, PLANNED]
    assert {r.bucket[1] for r in reports} == {4} and bucket(9, 1.1) == 23
    assert reports[-1].plan.regions["vision"].tokens == 16
    # Memory is sampled by primary tokens only: the vision count never asked for a new sample.
    assert [s.tokens for s in c.memory.samples] == [64]


def test_a_step_above_its_predicted_peak_adds_the_error_and_solves_again(caplog) -> None:
    # Capacity leaves about 1.9 MiB beside the must-only peak (64.25 MiB); the plan saves less.
    limit = int((64.25 + 1.91) * MiB / 0.98)
    model, meter, c = setup_controller(limit, meter_every=1)  # every planned step metered
    for _ in range(3):
        run_step(model, meter, c, 32)
    first = run_step(model, meter, c, 32)
    edge = first.plan.regions["DecoderLayer"].tokens
    assert first.mode == PLANNED and first.predicted_peak == first.plan.peak_at_tokens(
        c.memory.base(64), 64 / edge
    )
    assert c.memory.model_error == 0 and first.plan.saved_bytes > 0
    meter.extra = 2 * MiB  # the model was wrong: the step measures 2 MiB more than before
    with caplog.at_level(logging.INFO):
        checked = run_step(model, meter, c, 32)
    error = checked.peak - checked.predicted_peak
    assert error > 0.02 * limit and "above the predicted" in caplog.text
    meter.extra = 0
    again = run_step(model, meter, c, 32)  # the error is applied at the next step (all ranks agree)
    assert c.memory.model_error == error
    # The error comes off the capacity (and the near-limit watch may take fragmentation off too).
    assert again.plan.capacity <= first.plan.capacity - error
    assert again.plan.saved_bytes < first.plan.saved_bytes
    # The same under-prediction again is what the correction already covers: it is not added a
    # second time (errors of one size adding up would shrink the plans step after step).
    meter.extra = 2 * MiB
    repeated = run_step(model, meter, c, 32)
    meter.extra = 0
    run_step(model, meter, c, 32)
    assert repeated.peak - repeated.predicted_peak > 0.02 * limit
    assert c.memory.model_error == error


def test_without_peak_correction_the_error_is_only_reported() -> None:
    limit = int((64.25 + 1.91) * MiB / 0.98)
    model, meter, c = setup_controller(limit, peak_correction=False)
    for _ in range(3):
        run_step(model, meter, c, 32)
    meter.extra = 2 * MiB
    report = run_step(model, meter, c, 32)
    assert report.peak - report.predicted_peak > 0.02 * limit
    assert c.memory.model_error == 0 and c.plans


def test_a_state_of_an_older_version_is_solved_again_with_an_info_log(caplog) -> None:
    model, meter, c = setup_controller(64 * MiB + 2 * MiB)
    for _ in range(4):
        run_step(model, meter, c, 32)
    state = c.state_dict()
    assert state["version"] == 6
    old = {
        **state,
        "version": 2,
        "plans": [(k, json.dumps({**json.loads(v), "version": 1})) for k, v in state["plans"]],
    }
    model2, meter2, fresh = setup_controller(64 * MiB + 2 * MiB)
    with caplog.at_level(logging.INFO):
        fresh.load_state_dict(old)
    assert not fresh.plans and "state version 2" in caplog.text and "solved again" in caplog.text
    modes = [run_step(model2, meter2, fresh, 32).mode for _ in range(3)]
    assert modes == [PROFILE, PLANNED, PLANNED]  # profiled again, then the bucket is solved anew
    assert fresh.plan.version == PLAN_VERSION and fresh.plan.predicted_peak > 0


def test_replan_under_a_new_limit_solves_each_bucket_again_from_the_same_profiles() -> None:
    # The fake must-only peak is 64 MiB + 64 tokens x 4 KiB; saving everything takes ~240 KiB.
    model, meter, c = setup_controller(64 * MiB + 256 * KiB + 100 * KiB, margin=0.0)
    with pytest.raises(tapesac_core.TapeSACError, match="plan_for needs profiled blocks"):
        c.plan_for(64)
    for _ in range(4):
        report = run_step(model, meter, c, 32)
    assert report.mode == PLANNED and c.plan_for(64) is report.plan  # the cached plan
    profiles = dict(c.profiles)
    c.replan(memory_limit=GiB)
    assert not c.plans and c.limit_bytes() == GiB
    generous = c.plan_for(64)
    assert generous.capacity > report.plan.capacity
    assert generous.saved_bytes > report.plan.saved_bytes and c.profiles == profiles
    c.replan()  # the same limit: solved again, to the same plan
    assert c.plan_for(64).to_json() == generous.to_json()
