"""Figures are matplotlib figures with titled axes and units, carrying predicted and measured points."""

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
from support import sample_plan

from tapesac_core.control.measured_times import BucketTimes
from tapesac_core.control.step_frontier import StepFrontier
from tapesac_core.control.step_report import StepMode, StepReport
from tapesac_core.report.figures import MeasuredPoint, frontier_figure, image_array
from tapesac_core.report.report import LoggedPlan, read_run
from tapesac_core.units import MiB
from tapesac_lightning.tracking import Publisher

FRONTIER = StepFrontier(
    curves={"DecoderLayer": [(10 * MiB, 0.100), (12 * MiB, 0.095), (15 * MiB, 0.090)]},
    must_only=(10 * MiB, 0.100),
    full=(10 * MiB, 0.104),
    chosen=(15 * MiB, 0.090),
    peak_at="",
    capacity=16 * MiB,
)


def test_measured_point_is_the_median_with_quartiles_and_count() -> None:
    point = MeasuredPoint.of("planned", [0.4, 0.1, 0.3, 0.2, 0.5], peak=7)
    assert (point.seconds, point.q1, point.q3, point.count, point.peak) == (0.3, 0.2, 0.4, 5, 7)
    single = MeasuredPoint.of("must-only", [0.25])
    assert (single.seconds, single.q1, single.q3, single.count) == (0.25, 0.25, 0.25, 1)


def test_frontier_figure_has_titled_axes_with_units_and_every_point() -> None:
    measured = [
        MeasuredPoint.of("must-only", [0.10, 0.11, 0.098], peak=10 * MiB + MiB // 2),
        MeasuredPoint.of("planned", [0.09, 0.092, 0.091]),
    ]
    figure = frontier_figure(
        FRONTIER, measured, title="TapeSAC plan for up to 512 (DecoderLayer) tokens"
    )
    (axes,) = figure.axes
    assert axes.get_xlabel() == "step peak memory (MiB)"
    assert axes.get_ylabel() == "step time (ms)"
    assert axes.get_title() == "TapeSAC plan for up to 512 (DecoderLayer) tokens"
    labels = [t.get_text() for t in axes.get_legend().get_texts()]
    assert labels == [
        "frontier (DecoderLayer)",
        "full recomputation (predicted)",
        "must-only (predicted)",
        "chosen plan (predicted)",
        "capacity (limit after margins)",
        "must-only measured (median, IQR, n=3)",
        "planned measured (median, IQR, n=3)",
    ]
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines["capacity (limit after margins)"].get_xdata()) == [16.0, 16.0]
    assert list(lines["frontier (DecoderLayer)"].get_ydata()) == [100.0, 95.0, 90.0]
    # A measured point sits at its metered peak, or at its mode's predicted peak when unmetered.
    points = [
        (line.get_xdata()[0], line.get_ydata()[0])
        for line in axes.get_lines()
        if line.get_marker() == "D"
    ]
    assert points == [(10.5, 100.0), (15.0, 91.0)]
    pixels = image_array(figure)
    assert pixels.shape == (570, 700, 3) and pixels.dtype == np.uint8
    # The legend lies below the axes, within the figure: it covers no point.
    legend, frame = axes.get_legend().get_window_extent(), axes.get_window_extent()
    assert 0 <= legend.y0 and legend.y1 < frame.y0, (legend, frame)


def test_where_plans_may_offload_the_figure_draws_both_frontiers() -> None:
    frontier = dataclasses.replace(
        FRONTIER,
        kept_only=[(12 * MiB, 0.095), (15 * MiB, 0.090)],
        with_offload=[(9 * MiB, 0.097), (12 * MiB, 0.092), (15 * MiB, 0.089)],
    )
    (axes,) = frontier_figure(frontier).axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    kept = lines["best plan, values kept on the device (predicted)"]
    offloaded = lines["best plan, with offload to host memory (predicted)"]
    assert list(kept.get_xdata()) == [12.0, 15.0] and list(kept.get_ydata()) == [95.0, 90.0]
    assert list(offloaded.get_xdata()) == [9.0, 12.0, 15.0]
    # Without offload (CPU) neither is drawn.
    (axes,) = frontier_figure(FRONTIER).axes
    assert not any("best plan" in line.get_label() for line in axes.get_lines())


class Writer:
    def __init__(self) -> None:
        self.texts, self.images = [], []

    def add_text(self, tag, text, step) -> None:
        self.texts.append((tag, step))

    def add_image(self, tag, image, step, dataformats) -> None:
        self.images.append((tag, step, image.shape, dataformats))


def _controller(plan: Any) -> SimpleNamespace:
    """What the publisher reads of a controller whose bucket (5,) has ``plan``."""
    return SimpleNamespace(
        plans={(5,): plan},
        times=SimpleNamespace(
            of=lambda key: BucketTimes(must_only=(0.1, 0.11), full=(), planned=(0.09,))
        ),
        bucket_tokens=lambda key: {"DecoderLayer": 512},
        step_frontier=lambda key: FRONTIER,
    )


def test_publisher_logs_scalars_every_step_and_each_new_plan_once() -> None:
    plan = SimpleNamespace(to_json=lambda: "plan-1", explain=lambda measured=None: "table")
    controller = _controller(plan)
    scalars, writer, publisher = [], Writer(), Publisher()
    for step, mode in enumerate(["control", "planned", "planned"]):
        report = StepReport(
            step=step,
            mode=StepMode(mode),
            tokens={"DecoderLayer": 500},
            bucket=(5,),
            plan=plan if mode == "planned" else None,
            time=0.1,
            limit=MiB,
            peak=2 * MiB if step < 2 else None,
            predicted_speedup=1.1 if mode == "planned" else None,
        )
        publisher.publish(
            controller, report, step, lambda m, s: scalars.append((s, sorted(m))), writer
        )
    publisher.finish(controller, 3, writer)
    assert [s for s, _ in scalars] == [0, 1, 2]
    assert (
        "tapesac/peak_memory_bytes" in scalars[0][1]
        and "tapesac/peak_memory_bytes" not in scalars[2][1]
    )
    assert writer.texts == [("tapesac/plan", 1), ("tapesac/plan_json", 1)]
    assert writer.images == [
        ("tapesac/frontier", 1, (570, 700, 3), "HWC"),
        ("tapesac/frontier", 3, (570, 700, 3), "HWC"),
    ]


def test_the_run_report_reads_the_logged_plans_back_equal(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    first = sample_plan()
    second = dataclasses.replace(first, predicted_speedup=1.0123456789, notes=("a ```fence```",))
    writer, publisher = SummaryWriter(str(tmp_path)), Publisher()
    for step, (plan, measured) in enumerate([(None, None), (first, None), (second, 1.07)]):
        report = StepReport(
            step=step,
            mode=StepMode.PLANNED if plan else StepMode.CONTROL,
            tokens={"DecoderLayer": 4096},
            bucket=(5,),
            plan=plan,
            time=0.1,
            limit=MiB,
            measured_speedup=measured,
        )
        publisher.publish(
            _controller(plan),
            report,
            step,
            lambda metrics, at: [writer.add_scalar(k, v, at) for k, v in metrics.items()],
            writer,
        )
    writer.close()
    run = read_run(tmp_path)
    assert run.plans_logged == [
        (1, LoggedPlan(plan=first)),
        (2, LoggedPlan(plan=second, measured_speedup=1.07)),
    ]
    assert run.plans_logged[1][1].plan == second  # every field, floats to the bit
    assert f"plan logged at step 2:\n{second.explain(1.07)}" in run.text()
    assert [p["plan"] for p in run.to_json()["plans_logged"]] == [
        first.to_json(),
        second.to_json(),
    ]
