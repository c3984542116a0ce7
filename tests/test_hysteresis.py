"""A bucket solved again keeps its previous plan's choices unless a change gains clearly more than
the noise in the profiles (``tapesac_core.plan.hysteresis``)."""

import dataclasses
import random

import pytest
import torch
from support import SHORT_SCHEDULE, WIDE, checkpointed_lm, token_ids

from benchmarks.limit_ends import rise
from benchmarks.measure import live_bytes
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.control.profile import _spread
from tapesac_core.plan.hysteresis import favour_previous
from tapesac_core.plan.peak import Option, predict
from tapesac_core.plan.peak_dp import solve_peak
from tapesac_core.plan.peak_timeline import Segment, Timeline, TimelineBlock


def _one_block_timeline() -> Timeline:
    return Timeline(
        tokens=1,
        static=0,
        segments=(Segment(peak=100, first=0, last=0, phase="forward"),),
        blocks=(TimelineBlock(region="r", index=0, sequence="s"),),
    )


def test_the_previous_option_stays_unless_another_gains_more_than_the_spread() -> None:
    t = _one_block_timeline()
    menu = [
        Option(bytes=0, gain=0.0, point=0),
        Option(bytes=10, gain=1.00, point=1),  # the previous plan's choice
        Option(bytes=10, gain=1.04, point=2),  # 4% better by this solve's estimates
    ]
    assert solve_peak(t, [menu], 200) == (2,)
    # Estimates that disagreed by 10%: 4% is noise, the previous choice stays.
    assert solve_peak(t, favour_previous([menu], [(1, False)], [0.10]), 200) == (1,)
    # By 1%: 4% is a gain, the plan changes.
    assert solve_peak(t, favour_previous([menu], [(1, False)], [0.01]), 200) == (2,)
    # No previous choice on the menu (the frontier moved): nothing is favoured.
    assert favour_previous([menu], [None], [0.10]) == [menu]
    # Only the choice is biased: the options' own gains and peaks are unchanged.
    assert (
        predict(t, [menu[1]]).peak
        == predict(t, favour_previous([menu], [(1, False)], [0.1])[0][1:2]).peak
    )


def test_the_previous_option_is_favoured_kept_or_offloaded_as_it_was() -> None:
    kept = Option(bytes=10, gain=1.0, point=1)
    offloaded = dataclasses.replace(kept, offload=True, held=4, gain=0.99)
    menu = [Option(bytes=0, gain=0.0, point=0), kept, offloaded]
    favoured = favour_previous([menu], [(1, True)], [0.1])[0]
    assert [o.gain for o in favoured] == [0.0, 1.0, pytest.approx(1.09)]
    favoured = favour_previous([menu], [(1, False)], [0.1])[0]
    assert [o.gain for o in favoured] == [0.0, pytest.approx(1.1), 0.99]


def test_the_spread_is_how_far_the_blocks_disagree_on_replay_time() -> None:
    # Totals 2.0, 2.2, 2.2 and 4.0 (one disturbed block): deviations 0.2, 0, 0, 1.8 from 2.2.
    samples = [{0: 1.0, 1: 1.0}, {0: 1.1, 1: 1.1}, {0: 1.2, 1: 1.0}, {0: 2.0, 1: 2.0}]
    assert _spread(samples) == pytest.approx(0.1 / 2.2)
    assert _spread([{0: 1.0, 1: 3.0}, {0: 1.0}]) == 0.0  # only the nodes both timed count
    assert _spread([{0: 1.0}]) == 0.0  # one block: no second estimate


def test_noise_within_the_spread_leaves_a_re_solved_plan_as_it_was() -> None:
    """Profiles perturbed by up to 4% per node until a fresh solve picks another plan (most do:
    the wide decoder's blocks have many near-equal save sets); solved again with the bucket's
    previous plan and a spread of 20%, the plan is the previous one."""
    torch.manual_seed(0)
    ids = token_ids(0, 4, 256)
    model = checkpointed_lm(**WIDE)

    def step() -> None:
        model.loss(ids).backward()
        model.zero_grad(set_to_none=True)

    step()
    must = rise(step)
    static = live_bytes(torch.device("cpu"))
    controller = Controller(model, static + must * 13 // 10, margin=0.0, **SHORT_SCHEDULE)
    report = None
    while report is None or report.mode != PLANNED:
        with controller.step(tokens=ids.numel()) as report:
            step()
    (key,) = controller.plans
    before = controller.plans[key]
    assert not before.empty and before.memory_model == "peak"
    solver, edges = controller.solver, controller.buckets.edges(key)
    profiles = dict(controller.profiling.profiles)
    rng = random.Random(0)
    for _ in range(40):
        controller.profiling.profiles = {
            r: dataclasses.replace(
                p,
                node_time={i: t * (1 + rng.uniform(-0.04, 0.04)) for i, t in p.node_time.items()},
                replay_spread=0.0,
            )
            for r, p in profiles.items()
        }
        fresh = solver.plan(key, edges, controller.memory, controller.budget)
        if fresh.coordinates() != before.coordinates():
            break
    else:
        raise AssertionError("no perturbation moved the plan: the test cannot show hysteresis")
    controller.profiling.profiles = {
        r: dataclasses.replace(p, replay_spread=0.2)
        for r, p in controller.profiling.profiles.items()
    }
    kept = solver.plan(key, edges, controller.memory, controller.budget, previous=before)
    assert kept.coordinates() == before.coordinates()
    assert kept.predicted_peak <= controller.budget.capacity(controller.memory)
