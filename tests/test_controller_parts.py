"""The controller's parts on their own: no model, no device, no process group."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from tapesac_core import TapeSACConfig, TapeSACError
from tapesac_core.control.budget import Correction, MemoryBudget
from tapesac_core.control.measured_times import SpeedupWatch, StepTimes
from tapesac_core.control.memory_model import MemoryModel, MemorySample
from tapesac_core.control.plan_cache import ModelKey
from tapesac_core.control.ranks import RankAgreement
from tapesac_core.control.schedule import StepSchedule
from tapesac_core.control.step_report import (
    CONTROL,
    FULL,
    PLANNED,
    PROFILE,
    SAMPLE,
    WARMUP,
    StepMode,
    bucket_entries,
    from_bucket_entries,
)
from tapesac_core.control.token_buckets import TokenBuckets
from tapesac_core.measure.memory import MemoryReading
from tapesac_core.plan import bucket, upper_edge
from tapesac_core.units import GiB, MiB


def _reading(peak: int, **changes) -> MemoryReading:
    fields = dict(peak=peak, current=0, reserved=peak, total=64 * GiB, free=32 * GiB) | changes
    return MemoryReading(**fields)


# ---------------------------------------------------------------------- StepMode


def test_step_modes_read_and_write_as_their_values() -> None:
    assert StepMode("planned") is StepMode.PLANNED and StepMode.PLANNED == "planned"
    assert f"{StepMode.CONTROL}" == str(StepMode.CONTROL) == "control"
    assert json.dumps({"mode": StepMode.FULL}) == '{"mode": "full"}'
    assert [m for m in StepMode if m.must_only] == [
        StepMode.WARMUP,
        StepMode.PROFILE,
        StepMode.SAMPLE,
        StepMode.CONTROL,
    ]


def test_bucket_entries_keep_their_indices_through_json_and_read_states_before_version_5() -> None:
    times = {(43, 7): [0.1, 0.2], (5, 0): [0.3]}
    entries = bucket_entries(times)
    assert entries == [([43, 7], [0.1, 0.2]), ([5, 0], [0.3])]
    assert from_bucket_entries(entries) == times
    assert from_bucket_entries(json.loads(json.dumps(entries))) == times
    assert from_bucket_entries({"43,7": [0.1, 0.2], "5,0": [0.3]}) == times  # version 4


def test_a_model_key_is_its_region_types_and_reads_the_text_states_before_version_6() -> None:
    key = ModelKey(("attention", "moe"))
    assert key.matches_state(json.loads(json.dumps(key.to_state())))
    assert key.matches_state("attention,moe")  # version 5 and before
    assert not key.matches_state(["attention"]) and not key.matches_state("attention")
    # A region type named with a comma is another model, though its text would read the same.
    joined = ModelKey(("attention,moe",))
    assert joined != key and not key.matches_state(joined.to_state())


# ---------------------------------------------------------------------- TokenBuckets


def test_token_buckets_read_counts_per_region_and_key_them() -> None:
    config = TapeSACConfig(memory_limit=0.5, secondary_regions={"vision"})
    buckets = TokenBuckets(["attention", "vision"], config)
    assert buckets.per_region(100) == {"attention": 100, "vision": 100}
    assert buckets.per_region({"vision": 7, "*": 50}) == {"attention": 50, "vision": 7}
    assert buckets.primary({"attention": 50, "vision": 700}) == 50  # vision is secondary
    key = buckets.key({"attention": 100, "vision": 40})
    assert key == (bucket(100, 1.1), bucket(40, 1.25))
    # A secondary region keeps its largest count so far; the primary follows the step.
    assert buckets.key({"attention": 60, "vision": 10}) == (bucket(60, 1.1), bucket(40, 1.25))
    assert buckets.edges(key) == {
        "attention": upper_edge(bucket(100, 1.1), 1.1),
        "vision": upper_edge(bucket(40, 1.25), 1.25),
    }


@pytest.mark.parametrize(
    "tokens, match",
    [
        ({"mlp": 3, "*": 1}, r"unknown region types \['mlp'\]"),
        ({"attention": 3}, r"tokens miss region types \['vision'\]"),
        (0, "token counts must be >= 1"),
    ],
)
def test_bad_token_counts_are_errors_naming_the_regions(tokens, match) -> None:
    buckets = TokenBuckets(["attention", "vision"], TapeSACConfig(memory_limit=0.5))
    with pytest.raises(TapeSACError, match=match):
        buckets.per_region(tokens)


# ---------------------------------------------------------------------- MemoryBudget


def _budget(limit="100MiB", **settings) -> tuple[MemoryBudget, MemoryModel]:
    memory = MemoryModel()
    memory.add(MemorySample(tokens=64, peak=40 * MiB, outside=3 * MiB, fragmentation=2 * MiB))
    return MemoryBudget(TapeSACConfig(memory_limit=limit, **settings), lambda: GiB), memory


def test_capacity_is_the_limit_less_outside_margin_fragmentation_and_model_error() -> None:
    budget, memory = _budget(margin=0.02)
    memory.extra_fragmentation, memory.model_error = MiB, 4 * MiB
    assert budget.limit_bytes() == 100 * MiB
    assert budget.margin_bytes() == pytest.approx(2 * MiB)  # of the absolute limit
    assert budget.capacity(memory) == int(100 * MiB - 3 * MiB - 2 * MiB - 3 * MiB - 4 * MiB)
    fraction, _ = _budget(0.5, margin=0.02)
    assert fraction.limit_bytes() == GiB // 2
    assert fraction.margin_bytes() == pytest.approx(0.02 * GiB)  # of the device's memory


def _plan(predicted_peak=45 * MiB, capacity=96 * MiB) -> SimpleNamespace:
    return SimpleNamespace(
        memory_model="peak", predicted_peak=predicted_peak, capacity=capacity, base=40 * MiB
    )


def test_a_step_above_its_prediction_asks_for_the_unexplained_error_only(caplog) -> None:
    budget, memory = _budget(margin=0.02)
    plan = _plan()
    with caplog.at_level(logging.INFO, logger="tapesac_core.control.budget"):
        asked = budget.check(_reading(50 * MiB), 0, plan, 45 * MiB, memory)
    assert asked == Correction(model_error=5 * MiB) and "above the predicted" in caplog.text
    assert not budget.check(_reading(46 * MiB), 0, plan, 45 * MiB, memory)  # within the margin
    assert budget.apply(asked, memory) and memory.model_error == 5 * MiB
    # The same error again is what the model already corrects: nothing more is asked.
    assert not budget.check(_reading(50 * MiB), 0, plan, 45 * MiB, memory)
    assert not budget.apply(Correction(), memory) and memory.model_error == 5 * MiB
    off, memory = _budget(margin=0.02, peak_correction=False)
    assert not off.check(_reading(90 * MiB), 0, plan, 45 * MiB, memory).model_error


def test_a_full_checkpointing_step_above_its_prediction_corrects_the_model_and_over_the_limit_says_so(
    caplog,
) -> None:
    budget, memory = _budget(margin=0.02)
    with caplog.at_level(logging.INFO, logger="tapesac_core.control.budget"):
        assert not budget.check_full(_reading(46 * MiB), 0, 45 * MiB, memory)  # within the margin
        assert "full-checkpointing step" not in caplog.text
        asked = budget.check_full(_reading(60 * MiB), 0, 45 * MiB, memory)
    # The unexplained error, as for a planned step; under the 100 MiB limit nothing is said.
    assert (
        asked == Correction(model_error=15 * MiB) and "full-checkpointing step" not in caplog.text
    )
    capacity = budget.capacity(memory)
    assert budget.apply(asked, memory) and budget.capacity(memory) == capacity - 15 * MiB
    # Above the limit (with the measured fragmentation, 2 MiB): said once, with the fix.
    with caplog.at_level(logging.INFO, logger="tapesac_core.control.budget"):
        over = budget.check_full(_reading(99 * MiB), 0, 45 * MiB, memory)
        budget.check_full(_reading(99 * MiB), 0, 45 * MiB, memory)
    assert over == Correction(model_error=(99 - 45 - 15) * MiB)
    assert caplog.text.count("above the memory limit 100.00 MiB") == 1, caplog.text
    assert "torch_checkpoint_blocks=False" in caplog.text
    # Memory outside the blocks that moved is measured anew, not taken for an error.
    budget, memory = _budget(margin=0.02)
    assert budget.check_full(_reading(69 * MiB), 24 * MiB, 45 * MiB, memory) == Correction(
        outside_growth=24 * MiB
    )


def test_memory_outside_the_blocks_that_moved_is_measured_anew_not_taken_for_errors() -> None:
    budget, memory = _budget(margin=0.02)  # the sample saw 0 bytes in use at the step's start
    plan = _plan()
    assert budget.outside_moved(MiB, memory) is None  # within the 2 MiB margin
    # 24 MiB more in use at the step's start: the peak is 24 MiB higher, and no model error.
    asked = budget.check(_reading(69 * MiB), 24 * MiB, plan, 45 * MiB, memory)
    assert asked == Correction(outside_growth=24 * MiB)
    capacity = budget.capacity(memory)
    assert budget.apply(asked, memory) and memory.static_growth == 24 * MiB
    assert budget.capacity(memory) == capacity - 24 * MiB
    assert not budget.check(_reading(69 * MiB), 24 * MiB, plan, 69 * MiB, memory)  # known now
    freed = budget.check(_reading(45 * MiB), 0, plan, 69 * MiB, memory)
    assert freed == Correction(outside_growth=0)
    # Samples taken while it is in use are kept at the reference static.
    memory.add(MemorySample(tokens=128, peak=24 * MiB + 70 * MiB, static=24 * MiB))
    assert memory.base(128) == 70 * MiB and memory.samples[-1].static == 0


def test_no_plan_fitting_is_said_once_with_by_how_much_and_the_fix(caplog) -> None:
    budget, memory = _budget()
    plan = SimpleNamespace(memory_model="peak", base=90 * MiB, empty=True, predicted_peak=90 * MiB)
    with caplog.at_level(logging.INFO, logger="tapesac_core.control.budget"):
        budget.say_unfit(plan, 80 * MiB, {"DecoderLayer": 512}, memory)
        budget.say_unfit(plan, 80 * MiB, {"DecoderLayer": 512}, memory)
    assert caplog.text.count("no plan fits: the memory limit 100.00 MiB cannot be met") == 1
    assert "(must-only, nothing more saved) is predicted at 90.00 MiB, 10.00 MiB above the" in (
        caplog.text
    )
    assert "Fix: a memory_limit of at least 110.00 MiB" in caplog.text
    budget.apply(Correction(outside_growth=5 * MiB), memory)  # another situation: said again
    with caplog.at_level(logging.INFO, logger="tapesac_core.control.budget"):
        budget.say_unfit(plan, 75 * MiB, {"DecoderLayer": 512}, memory)
    assert caplog.text.count("no plan fits") == 2 and "5.00 MiB, +5.00 MiB since" in caplog.text


# ---------------------------------------------------------------------- StepTimes


def test_step_times_measure_speedups_per_bucket_and_say_what_is_missing() -> None:
    times, key = StepTimes(), (5,)
    assert "no plan yet" in times.unmeasured_reason(key, planned=False)
    times.add_must_only(key, {"r": 10}, 0.2)
    assert "no planned step timed" in times.unmeasured_reason(key, planned=True)
    times.add_planned(key, None)  # metered: counted, not timed
    assert times.planned_since_control(key) == 1 and times.speedup(key) is None
    for seconds in (0.1, 0.12, 0.08):
        times.add_planned(key, seconds)
    times.add_full(key, 0.3)
    assert times.speedup(key) == pytest.approx(2.0) and times.unmeasured_reason(key, True) is None
    assert times.speedup(key, vs_full=True) == pytest.approx(3.0)
    assert times.planned_since_control(key) == 4 and times.planned_since_full(key) == 0
    assert times.of(key).planned == (0.1, 0.12, 0.08) and times.of((6,)).planned == ()
    restored = StepTimes()
    restored.load_state_dict(times.state_dict(), edges=lambda k: {"r": 10})
    assert restored.state_dict() == times.state_dict()
    times.forget_planned()
    assert times.speedup(key) is None


def test_speedup_watch_profiles_again_after_windows_in_a_row_at_most_twice() -> None:
    watch = SpeedupWatch(band=0.1, windows=2, max_reprofiles=2)
    plan = SimpleNamespace(predicted_speedup=1.2, explain=lambda measured_speedup: "table")
    key = (5,)
    assert not watch.profile_again(key, None, plan)
    assert not watch.profile_again(key, 1.0, plan)  # off by 17%: one window
    assert not watch.profile_again(key, 1.25, plan)  # within the band: the run is broken
    answers = [watch.profile_again(key, 1.0, plan) for _ in range(8)]
    assert answers == [False, True, False, True, False, False, False, False]
    assert watch.reprofiles == 2


# ---------------------------------------------------------------------- StepSchedule


def _cadence(steps: int, full_fits: bool = False, **settings) -> str:
    """The modes of ``steps`` steps of one bucket after warmup (c: control, f: full, p: planned),
    each step's time fed back as the controller does."""
    schedule = StepSchedule(TapeSACConfig(memory_limit=0.5, **settings), "cuda")
    times, key, letters = StepTimes(), (3,), ""
    for _ in range(steps):
        mode = schedule.mode(key, times, profile=False, sample=False, full_fits=full_fits)
        letters += {CONTROL: "c", FULL: "f", PLANNED: "p"}[mode]
        if mode == CONTROL:
            times.add_must_only(key, {"attention": 8}, 1.0)
        elif mode == FULL:
            times.add_full(key, 1.0)
        else:
            times.add_planned(key, 1.0)
    return letters


@pytest.mark.parametrize(
    "settings, modes",
    [
        ({}, "c" + 25 * "p" + "c"),  # one control step, then one per 25 planned
        (dict(control_steps=2, control_every=3, full_control_every=4), "ccfpppcpfppc"),
        (dict(control_every=0), "c" + 10 * "p"),  # control steps only in a new bucket
        (dict(control_steps=0, control_every=3), 6 * "p"),  # none to compare with: never
    ],
)
def test_a_bucket_runs_control_full_and_planned_steps_at_their_cadence(settings, modes) -> None:
    assert _cadence(len(modes), **settings) == modes


def test_torch_checkpoint_blocks_alternate_must_only_and_full_steps_where_full_fits() -> None:
    settings = dict(control_every=0, torch_checkpoint_blocks=True, torch_checkpoint_steps=3)
    assert _cadence(8, full_fits=True, **settings) == "cfcfcfpp"
    assert _cadence(3, full_fits=False, **settings) == "cpp"  # predicted over the limit: none
    assert _cadence(3, full_fits=True, control_every=0) == "cpp"  # off by default


def test_profiling_and_sampling_come_before_the_cadence() -> None:
    schedule, times = StepSchedule(TapeSACConfig(memory_limit=0.5), "cpu"), StepTimes()
    assert schedule.warms_up(1) and not schedule.warms_up(2)  # warmup_steps=2
    assert schedule.mode((3,), times, profile=True, sample=True) == PROFILE
    assert schedule.mode((3,), times, profile=False, sample=True) == SAMPLE
    assert schedule.mode((3,), times, profile=False, sample=False) == CONTROL


def _meterings(schedule: StepSchedule, key: tuple[int, ...], steps: int) -> str:
    """Which of ``steps`` planned steps of bucket ``key`` are metered (m) and which not (-)."""
    return _planned(schedule, key, steps)[0]


def _planned(schedule: StepSchedule, key: tuple[int, ...], steps: int) -> tuple[str, str]:
    """Which of ``steps`` planned steps of bucket ``key`` are metered (m) and which not (-),
    and which record every block (r) and which may run blocks in steady state (-)."""
    metered_marks = recorded_marks = ""
    for _ in range(steps):
        metered = schedule.metered(PLANNED, key, profiled=0)
        recorded = schedule.records(PLANNED, key)
        schedule.planned(key, metered, recorded)
        metered_marks += "m" if metered else "-"
        recorded_marks += "r" if recorded else "-"
    return metered_marks, recorded_marks


def test_planned_steps_record_every_block_one_in_meter_every_on_any_device() -> None:
    """Recording compares each block's tape with the one its steady-state calls run from: a
    bucket's first planned step and one in ``meter_every``, on accelerators too, where every
    planned step is metered."""
    for device in ("cpu", "cuda"):
        schedule = StepSchedule(TapeSACConfig(memory_limit=0.5, meter_every=3), device)
        assert _planned(schedule, (3,), 7)[1] == "r--r--r"
        assert _planned(schedule, (4,), 2)[1] == "r-"
        schedule.forget_plan((3,))
        assert _planned(schedule, (3,), 2)[1] == "r-"
    assert not any(schedule.records(m, (3,)) for m in (WARMUP, PROFILE, SAMPLE, CONTROL, FULL))


def test_planned_steps_are_metered_every_one_on_accelerators_one_in_meter_every_on_cpu() -> None:
    cpu = StepSchedule(TapeSACConfig(memory_limit=0.5, meter_every=3), "cpu")
    assert _meterings(cpu, (3,), 7) == "m--m--m"
    assert _meterings(cpu, (4,), 2) == "m-"  # each bucket's first planned step is metered
    cpu.forget_plans()  # new plans: their first steps are metered again
    assert _meterings(cpu, (3,), 2) == "m-"
    never = StepSchedule(TapeSACConfig(memory_limit=0.5, meter_every=0), "cpu")
    assert _meterings(never, (3,), 4) == "m---"
    cuda = StepSchedule(TapeSACConfig(memory_limit=0.5, meter_every=3), "cuda")
    assert _meterings(cuda, (3,), 4) == "mmmm"
    # Metering slows a CPU step: a metered planned step there is not timed.
    assert not cpu.timed(metered=True) and cpu.timed(metered=False) and cuda.timed(metered=True)


def test_must_only_steps_are_metered_when_they_sample_memory() -> None:
    schedule = StepSchedule(TapeSACConfig(memory_limit=0.5), "cuda")
    assert schedule.metered(PROFILE, (3,), profiled=0)  # the first profiling step
    assert not schedule.metered(PROFILE, (3,), profiled=1)
    assert schedule.metered(SAMPLE, (3,), profiled=1)
    assert not any(schedule.metered(m, (3,), profiled=0) for m in (WARMUP, CONTROL))
    # Full-checkpointing steps on accelerators, where metering costs nothing; on CPU it slows
    # the step whose time they measure.
    assert schedule.metered(FULL, (3,), profiled=0)
    cpu = StepSchedule(TapeSACConfig(memory_limit=0.5), "cpu")
    assert not cpu.metered(FULL, (3,), profiled=0)


def test_the_first_warmup_step_verifies_or_else_the_first_profile_step() -> None:
    warm = StepSchedule(TapeSACConfig(memory_limit=0.5, warmup_steps=2), "cpu")
    assert warm.verifies(WARMUP, step=0, profiled=0)
    assert not warm.verifies(WARMUP, step=1, profiled=0)
    assert not warm.verifies(PROFILE, step=2, profiled=0)
    cold = StepSchedule(TapeSACConfig(memory_limit=0.5, warmup_steps=0), "cpu")
    assert cold.verifies(PROFILE, step=0, profiled=0)
    assert not cold.verifies(PROFILE, step=1, profiled=1)
    assert not cold.verifies(PLANNED, step=5, profiled=0)


# ---------------------------------------------------------------------- RankAgreement


def test_without_a_process_group_every_rank_agrees_with_itself() -> None:
    ranks = RankAgreement(None, torch.device("cpu"))
    assert not ranks.distributed
    assert ranks.largest([3, 1]) == [3, 1] and ranks.smallest(-4) == -4
    plan = SimpleNamespace(name="solved")
    assert ranks.plan_of_rank_0(lambda: plan, "model") is plan


# ---------------------------------------------------------------------- MemoryModel


def test_memory_that_does_not_grow_with_tokens_stays_unscaled() -> None:
    from tapesac_core.plan.peak_timeline import Segment, Timeline
    from tapesac_core.plan.plan import Plan

    memory = MemoryModel()
    # Must-only peak = 10 MiB static + 6 MiB gathered parameters + 1 KiB per token.
    memory.add(MemorySample(tokens=2000, peak=16 * MiB + 2000 * 1024, static=10 * MiB))
    memory.add(MemorySample(tokens=2100, peak=16 * MiB + 2100 * 1024, static=10 * MiB))
    assert memory.fixed == 0  # one sample, or counts closer than 20%: not told apart
    memory.add(MemorySample(tokens=4000, peak=16 * MiB + 4000 * 1024, static=10 * MiB))
    assert abs(memory.fixed - 6 * MiB) <= 1
    memory.add_timeline(
        Timeline(
            tokens=2000,
            static=10 * MiB,
            segments=(Segment(peak=16 * MiB + 2000 * 1024, first=1, last=0),),
            blocks=(),
        )
    )
    assert memory.timeline(2000).static == 16 * MiB  # the fixed part is not scaled
    plan = Plan(
        model=("m",),
        regions={},
        capacity=0,
        base=memory.base(4000),
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
        predicted_peak=memory.base(4000) + 1000 * 1024,  # saves 1 KiB per 4 tokens
        static=memory.timeline(4000).static,
    )
    # At half the tokens only what grows with them halves: 16 MiB + 2000 KiB + 500 KiB.
    assert plan.peak_at_tokens(memory.base(2000), 0.5) == 16 * MiB + 2500 * 1024
