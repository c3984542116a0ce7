"""Planning under real measured memory on CPU: a sweep of absolute limits on the example model,
under Eq. 8 (``memory_model="sum"``; the peak-aware model's sweep is tests/test_peak_sweep.py)."""

import copy

import pytest
import torch
from support import SHORT_SCHEDULE, checkpointed_lm, token_ids

from examples.training import train_step
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.control.solve import solve_plan
from tapesac_core.measure.memory import LiveTensorMeter

# Six-step runs of the example model at five limits, measured (about 2 minutes): the second tier.
pytestmark = pytest.mark.slow


def _peak_of_step(model, optimizer, ids, controller=None):
    with LiveTensorMeter() as meter:
        report, _ = train_step(model, optimizer, ids, controller)
    return meter.reading().peak, report


def _run(base, limit, steps=6, seq=64):
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        **(SHORT_SCHEDULE | dict(profile_steps=2)),
        memory_model="sum",
    )
    peaks = []
    for step in range(steps):
        peak, report = _peak_of_step(
            model, optimizer, token_ids(step, batch=4, seq=seq), controller
        )
        if report.mode == PLANNED:
            peaks.append(peak)
    assert report.mode == PLANNED
    return report, peaks, controller


@pytest.fixture(scope="module")
def sweep():
    base = checkpointed_lm(dropout=0.1)
    # Must-only peak (no plan) and the bytes the largest useful plan would add.
    report, _, controller = _run(base, "1GiB")
    must_only, full = report.plan.base, report.plan.saved_bytes
    limits = [int((must_only + f * full) / (1 - 0.02)) for f in (0.15, 0.35, 0.6, 0.9)]
    return must_only, full, [(limit, *_run(base, limit)) for limit in limits]


def test_plans_are_distinct_use_their_capacity_and_never_exceed_the_limit(sweep) -> None:
    must_only, full, runs = sweep
    saved = [report.plan.saved_bytes for _, report, _, _ in runs]
    assert all(s > 0 for s in saved)
    assert len(
        {
            frozenset(map(frozenset, report.plan.coordinates()["DecoderLayer"]))
            for _, report, _, _ in runs
        }
    ) == len(runs)
    for limit, report, peaks, _ in runs:
        budget = report.plan.capacity - report.plan.base
        assert report.plan.saved_bytes <= budget
        assert report.plan.saved_bytes >= 0.5 * budget  # most of the capacity is used
        assert max(peaks) <= limit, (peaks, limit)


def test_more_memory_never_predicts_a_slower_step(sweep) -> None:
    must_only, full, runs = sweep
    _, report, _, controller = runs[0]
    edges = {"DecoderLayer": report.plan.regions["DecoderLayer"].tokens}
    predicted = [
        solve_plan(
            controller.profiles,
            edges,
            model=("m",),
            capacity=must_only + extra,
            base=must_only,
            must_only_step_time=1.0,
            config=controller.config,
        ).predicted_speedup
        for extra in range(0, full + full // 8, full // 64)
    ]
    assert predicted == sorted(predicted) and predicted[0] == 1.0 < predicted[-1]


def test_a_longer_sequence_mid_run_replans_and_stays_under_the_limit(sweep) -> None:
    must_only, full, runs = sweep
    limit = int((must_only + 0.9 * full) / (1 - 0.02))
    model = copy.deepcopy(checkpointed_lm(dropout=0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        memory_model="sum",
    )
    for step in range(4):
        _, report = _peak_of_step(model, optimizer, token_ids(step, batch=4, seq=64), controller)
    old = report.plan
    assert report.mode == PLANNED and not old.empty
    peaks, modes = [], []
    for step in range(4, 10):
        peak, report = _peak_of_step(model, optimizer, token_ids(step, batch=4, seq=96), controller)
        peaks.append(peak)
        modes.append(report.mode)
    new = report.plan
    assert modes[0] == "sample" and modes[-1] == PLANNED  # 1.5x tokens: memory sampled again
    assert new.coordinates() != old.coordinates()
    # Eq. 8: the new plan fits at the new token count; the old one would not have. (How many
    # bytes the new plan saves depends on measured op times, so it is not compared.)
    assert new.base + new.saved_bytes <= new.capacity
    new_tokens = new.regions["DecoderLayer"].tokens
    old_tokens = old.regions["DecoderLayer"].tokens
    assert new.base + old.saved_bytes * new_tokens / old_tokens > new.capacity
    assert max(peaks) <= limit
