"""The step's scalars agree with the plan: what plain blocks keep counts in ``saved_bytes``, and
how many blocks ran plain, under torch's checkpoint or in steady state is logged."""

from __future__ import annotations

from types import SimpleNamespace

from support import SHORT_SCHEDULE, SMALL, checkpointed_lm, run_step, setup_controller

from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.units import GiB
from tapesac_lightning.tracking import step_metrics

NO_METER = SimpleNamespace()  # run_step sets its tokens; the controller meters for itself


def test_an_all_plain_plan_reports_the_bytes_its_plain_blocks_keep() -> None:
    model = checkpointed_lm(**SMALL)
    controller = Controller(model, GiB, **SHORT_SCHEDULE)  # live tensor bytes: the peak model
    reports = [run_step(model, NO_METER, controller, seq=32) for _ in range(5)]
    report = reports[-1]
    plan = report.plan
    assert report.mode == PLANNED and plan is not None
    assert report.plain_blocks == 3 and report.blocks == 0  # every block plain
    edges = controller.bucket_tokens(report.bucket)
    assert plan.plain_bytes(edges) == plan.saved_bytes > 0  # what explain() says it saves
    assert report.saved_bytes == plan.plain_bytes(report.local_tokens) > 0
    metrics = step_metrics(report)
    assert metrics["tapesac/saved_bytes"] == report.saved_bytes
    assert metrics["tapesac/plain_blocks"] == 3
    assert metrics["tapesac/torch_checkpoint_blocks"] == 0


def test_steady_state_blocks_are_counted_in_the_scalars() -> None:
    model, meter, controller = setup_controller(0.0, **(SHORT_SCHEDULE | dict(meter_every=0)))
    reports = [run_step(model, meter, controller, seq=32) for _ in range(6)]
    assert [step_metrics(r)["tapesac/steady_blocks"] for r in reports] == [0, 0, 3, 0, 3, 3]
    assert [str(r.mode) for r in reports] == [
        "warmup",
        "profile",
        "control",
        "planned",
        "planned",
        "planned",
    ]
    assert all(r.saved_bytes == 0 for r in reports)  # must-only: nothing beyond S0
