"""Metric names and the checkpoint state key are defined once, in ``tapesac_core.metric_names``:
what the integrations log is what the run report and its figures read back."""

from pathlib import Path

from tapesac_core import metric_names as names
from tapesac_core.control.step_report import StepMode, StepReport
from tapesac_core.report.figures import timeline_figure
from tapesac_core.report.report import RunReport
from tapesac_core.units import MiB
from tapesac_lightning.tracking import step_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_is_distinct_and_under_the_prefix() -> None:
    logged = (*names.SCALARS, names.PLAN_TEXT, names.PLAN_JSON, names.FRONTIER_IMAGE)
    assert len(set(logged)) == len(logged)
    assert all(name.startswith(names.PREFIX) for name in logged)


def test_a_step_logs_the_defined_scalars_those_it_knows() -> None:
    planned = StepReport(
        step=3,
        mode=StepMode.PLANNED,
        tokens={"DecoderLayer": 64},
        bucket=(43,),
        time=0.25,
        peak=12 * MiB,
        limit=20 * MiB,
        predicted_speedup=1.2,
        measured_speedup=1.1,
        measured_speedup_vs_full=1.3,
        predicted_peak=13 * MiB,
    )
    assert list(step_metrics(planned)) == list(names.SCALARS)
    warmup = StepReport(step=0, mode=StepMode.WARMUP, tokens={"DecoderLayer": 64}, bucket=(43,))
    unknown = {
        names.PEAK_MEMORY_BYTES,
        names.PREDICTED_SPEEDUP,
        names.MEASURED_SPEEDUP,
        names.MEASURED_SPEEDUP_VS_FULL,
        names.PREDICTED_PEAK_BYTES,
    }
    assert set(step_metrics(warmup)) == set(names.SCALARS) - unknown


def test_the_run_report_and_its_timeline_read_the_names_logged() -> None:
    scalars = {name: [(0, 1.25), (1, 1.5)] for name in names.SCALARS}
    scalars[names.PEAK_MEMORY_BYTES] = [(0, 12.0 * MiB)]
    scalars[names.MEMORY_LIMIT_BYTES] = [(0, 20.0 * MiB)]
    text = RunReport(source="run", kind="tensorboard", scalars=scalars).text()
    for line in (
        "predicted speedup vs must-only, as logged each step: median 1.375x",
        "measured speedup vs must-only, as logged each step",
        "measured speedup vs full checkpointing, as logged each step",
        "peak memory: max 12.00 MiB over 1 metered steps against the limit 20.00 MiB",
    ):
        assert line in text
    figure = timeline_figure(scalars)
    drawn = {line.get_label() for axes in figure.axes for line in axes.get_lines()}
    assert {
        "predicted",
        "measured (medians over recent steps)",
        "measured step peak",
        "memory limit",
    } <= drawn


def test_no_other_module_spells_a_metric_name_or_the_state_key() -> None:
    for package in ("tapesac_core", "tapesac_lightning"):
        for path in (ROOT / package).rglob("*.py"):
            if path != ROOT / "tapesac_core" / "metric_names.py":
                source = path.read_text()
                assert '"tapesac/' not in source and '"TapeSAC"' not in source, path
