"""The closing summary is computed from the run's own steps: medians, spreads, counts; a logged
plan is read back as data."""

import pytest
from support import sample_plan

from tapesac_core.report.report import LoggedPlan, measured_speedup, run_summary
from tapesac_core.units import MiB


def _steps() -> list[dict]:
    a, b = [1], [2]
    return [
        dict(mode="warmup", bucket=a, time=9.0, peak=None),  # first step: left out
        dict(mode="warmup", bucket=a, time=1.0, peak=None),
        dict(mode="profile", bucket=a, time=3.0, peak=10 * MiB),
        dict(mode="control", bucket=a, time=1.2, peak=None),
        dict(mode="full", bucket=a, time=1.5, peak=None),
        dict(mode="planned", bucket=a, time=0.8, peak=12 * MiB, predicted=1.2),  # metered: left out
        dict(mode="planned", bucket=a, time=1.0, peak=None, predicted=1.2),
        dict(mode="planned", bucket=a, time=0.5, peak=None, predicted=1.2),
        dict(mode="planned", bucket=b, time=2.0, peak=None, predicted=1.1),  # no control in b
        dict(mode="control", bucket=b, time=2.2, peak=None),
        dict(mode="planned", bucket=b, time=1.1, peak=None, predicted=1.1),
    ]


def test_measured_speedup_pairs_planned_steps_with_controls_of_their_bucket() -> None:
    must = measured_speedup(_steps(), ("control", "warmup"))
    # Bucket a: controls 1.0 and 1.2 (median 1.1) over 1.0, 0.5; bucket b: 2.2 over 2.0, 1.1.
    ratios = sorted([1.1 / 1.0, 1.1 / 0.5, 2.2 / 2.0, 2.2 / 1.1])
    assert must.count == 4 and must.controls == 3
    assert must.median == pytest.approx((ratios[1] + ratios[2]) / 2)
    assert must.q1 == pytest.approx(ratios[0] + 0.75 * (ratios[1] - ratios[0]))
    full = measured_speedup(_steps(), ("full",))
    assert (full.count, full.controls) == (2, 1)
    assert full.median == pytest.approx((1.5 / 1.0 + 1.5 / 0.5) / 2)
    assert measured_speedup(_steps()[:5], ("control",)) is None


def test_run_summary_states_counts_speedups_peak_and_headroom() -> None:
    text = run_summary(_steps(), limit=20 * MiB, plan=None, headroom=(10 * MiB, 30 * MiB))
    lines = text.splitlines()
    assert lines[0] == (
        "TapeSAC: 11 steps: 5 planned, 2 must-only control, 1 full-checkpointing "
        "control, 3 warm-up/profiling/sampling"
    )
    assert lines[1].startswith(
        "measured speedup vs must-only: 1.550x median over 4 planned steps (IQR 1.100-2.050)"
    )
    assert lines[1].endswith("against 3 interleaved control steps of their buckets")
    assert lines[2].startswith(
        "measured speedup vs full checkpointing (torch.utils.checkpoint): "
        "2.250x median over 2 planned steps"
    )
    assert lines[3] == "predicted speedup vs must-only: 1.200x median over 5 planned steps"
    assert lines[4].startswith(
        "peak memory 12.00 MiB (max over 2 metered steps) against the limit 20.00 MiB"
    )
    assert lines[5].startswith(
        "the limit sits 50% of the way from the must-only peak 10.00 MiB "
        "to the peak with everything useful saved 30.00 MiB"
    )
    # Outside the range the line says so in words, not as a share above 100% or below 0%.
    above = run_summary(_steps(), limit=40 * MiB, plan=None, headroom=(10 * MiB, 30 * MiB))
    assert above.splitlines()[5] == (
        "the limit is above everything useful: it sits over both the must-only peak 10.00 MiB "
        "and the peak with everything useful saved 30.00 MiB (predicted, final plan's bucket)"
    )
    below = run_summary(_steps(), limit=8 * MiB, plan=None, headroom=(10 * MiB, 30 * MiB))
    assert below.splitlines()[5].startswith(
        "the limit is at or below the must-only step: it sits under both the must-only peak"
    )


@pytest.mark.parametrize("measured", [None, 1.0625, 1 / 3])
def test_a_logged_plan_round_trips_equal_with_its_table(measured) -> None:
    logged = LoggedPlan(plan=sample_plan(), measured_speedup=measured)
    read = LoggedPlan.from_json(logged.to_json())
    assert read == logged and read.plan == sample_plan()
    assert read.text() == sample_plan().explain(measured)
