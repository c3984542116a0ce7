"""The controller's step protocol for drivers (begin_step, end_step): the same steps as
``with controller.step(tokens):``, a discarded step kept out as after an exception."""

import time
from collections.abc import Callable

import pytest
from support import FakeMeter, VirtualClock, setup_controller, token_ids

from tapesac_core import StepReport, TapeSACError
from tapesac_core.blocks.trace_scope import traced_blocks
from tapesac_core.control.controller import Controller
from tapesac_core.units import MiB

SEQS = [32, 32, 32, 32, 31, 40]
MODES = ["warmup", "profile", "control", "planned", "planned", "sample"]  # the last a new bucket


def _with_block(controller: Controller, tokens: int, work: Callable[[], None]) -> StepReport:
    with controller.step(tokens=tokens) as report:
        work()
    return report


def _begin_end(controller: Controller, tokens: int, work: Callable[[], None]) -> StepReport:
    report = controller.begin_step(tokens)
    work()
    assert controller.end_step() is report
    return report


def _run(monkeypatch, drive, seqs=SEQS, discard_at: int | None = None) -> tuple[Controller, list]:
    """Steps of ``seqs`` driven by ``drive`` on a virtual clock (times the same each run); the
    step at ``discard_at`` fails after its backward. The controller's report after each step."""
    clock = VirtualClock({}, default=1e-5, reference_tokens=64)
    monkeypatch.setattr(time, "perf_counter", clock.read)
    model, meter, c = setup_controller(64 * MiB + 2 * MiB, FakeMeter())
    reports = []
    for i, seq in enumerate(seqs):
        ids = token_ids(seq, 2, seq)
        meter.tokens = clock.tokens = ids.numel()
        clock.now = 0.0  # each step's times rounded alike, whatever ran before

        def work() -> None:
            model.loss(ids).backward()
            if i == discard_at:
                raise RuntimeError("the micro-batch failed")

        with clock:
            try:
                drive(c, ids.numel(), work)
            except RuntimeError:
                assert i == discard_at
        model.zero_grad(set_to_none=True)
        reports.append(c.report)
    return c, reports


def test_begin_and_end_step_give_the_reports_of_the_context_manager(monkeypatch) -> None:
    c, by_protocol = _run(monkeypatch, _begin_end)
    _, by_block = _run(monkeypatch, _with_block)
    assert [r.mode for r in by_protocol] == MODES
    assert by_protocol == by_block
    assert traced_blocks() is None  # every step's trace closed


def _fail_with_end_step(controller: Controller, tokens: int, work: Callable[[], None]) -> None:
    controller.begin_step(tokens)
    try:
        work()
    except RuntimeError as error:
        assert controller.end_step(error) is None
        raise
    controller.end_step()


@pytest.mark.parametrize("drive", [_fail_with_end_step, _with_block])
@pytest.mark.parametrize("at", [2, 3])  # a control step, a planned step
def test_a_failed_step_is_kept_out_as_if_it_never_ran(monkeypatch, at, drive) -> None:
    c, reports = _run(monkeypatch, drive, discard_at=at)
    without, expected = _run(monkeypatch, _begin_end, SEQS[:at] + SEQS[at + 1 :])
    assert reports[at] == reports[at - 1]  # it left no report
    assert reports[:at] + reports[at + 1 :] == expected
    assert c.steps == len(SEQS) - 1
    assert c.state_dict() == without.state_dict()  # nothing it measured kept
    assert traced_blocks() is None


def test_end_step_needs_begin_step_and_begin_step_needs_the_last_step_ended() -> None:
    _, _, c = setup_controller(64 * MiB + 2 * MiB)
    with pytest.raises(TapeSACError, match=r"end_step: no step is open. Fix: call begin_step"):
        c.end_step()
    c.begin_step(64)
    with pytest.raises(TapeSACError, match=r"step 0 is still open. Fix: end it with end_step"):
        c.begin_step(64)
    with pytest.raises(TapeSACError, match="step 0 is still open"):
        with c.step(tokens=64):
            pass
    assert c.end_step(RuntimeError("discarded")) is None
    with pytest.raises(TapeSACError, match="no step is open"):
        c.end_step()
    assert c.steps == 0 and c.report is None and traced_blocks() is None
