"""Blocks a plan runs under torch.utils.checkpoint: chosen where measured full-checkpointing steps
beat must-only, priced by the peak model (nothing kept from forward, the whole forward again at
the block's first unpack), metered under the limit and bitwise."""

import copy
import dataclasses
import statistics

import pytest
import torch
from support import SHORT_SCHEDULE, WIDE, assert_bitwise, reference_and_copy, step, token_ids
from torch.utils._pytree import tree_flatten

import tapesac_core
from benchmarks.host_overhead import SIZE, TinyOps
from examples.models import DecoderLM
from tapesac_core import TORCH_CHECKPOINT
from tapesac_core.control.solve import (
    full_faster_notes,
    torch_checkpoint_gains,
    torch_checkpoint_peak,
)
from tapesac_core.plan.plan import BlockKind
from tapesac_core.units import KiB

# Every planned step metered, the limit used as given.
# Margin 0 lets a plan, solved for exactly the step's tokens, peak at the limit itself: the
# near-limit watch (a fragmentation guard at 99% of the limit) would shrink it, so it is off too.
SETTINGS = SHORT_SCHEDULE | dict(
    meter_every=1, margin=0.0, near_limit=1.0, torch_checkpoint_blocks=True
)


def _models(moe: bool) -> tuple[DecoderLM, DecoderLM, torch.Tensor]:
    reference, model = reference_and_copy(**WIDE, moe=moe)
    return reference, model, token_ids(1, batch=2, seq=256)


def _step(controller, model, ids, seed: int):
    with controller.step(tokens=ids.numel()) as report:
        torch.manual_seed(seed)
        got = step(model, lambda: model.loss(ids))
    return report, got


def _full_checkpoint_peak(controller, key) -> int:
    edges = controller.bucket_tokens(key)
    primary = controller.buckets.primary(edges)
    return torch_checkpoint_peak(
        controller.profiles,
        edges,
        controller.memory.timeline(primary),
        controller.memory.base(primary),
        controller.config,
    )


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_torch_checkpoint_blocks_run_where_measured_faster_under_the_limit(moe, caplog) -> None:
    reference, model, ids = _models(moe)
    controller = tapesac_core.Controller(model, "1GiB", **SETTINGS)
    reports = [_step(controller, model, ids, seed)[0] for seed in range(9)]
    modes = [str(r.mode) for r in reports]
    # Before the bucket's first plan, must-only and full checkpointing alternate, three each.
    assert modes == ["warmup", "profile", *["control", "full"] * 3, "planned"], modes
    assert [r.torch_checkpointed for r in reports if str(r.mode) == "full"] == [4] * 3
    key = reports[-1].bucket
    must_only = statistics.median(controller.times.of(key).must_only)
    full_peak = _full_checkpoint_peak(controller, key)
    assert full_peak >= reports[-1].plan.base  # its recompute at least what must-only replays
    region = "MoEDecoderLayer" if moe else "DecoderLayer"

    # Measured faster: at a limit just above the full-checkpointing step's predicted peak (all
    # plain does not fit), blocks run under torch checkpoint; the metered step is within 3% of
    # its prediction and under the limit, and bitwise.
    controller.times.full[key] = [0.5 * must_only] * 3
    limit = full_peak + 64 * KiB
    controller.replan(memory_limit=limit)
    report, got = _step(controller, model, ids, 10)
    kinds = report.plan.regions[region].kinds
    assert BlockKind.TORCH_CHECKPOINT in kinds, report.plan.explain()
    assert report.torch_checkpointed == kinds.count(BlockKind.TORCH_CHECKPOINT)
    explained = report.plan.explain()
    assert "torch checkpoint" in explained
    assert "torch_checkpoint_blocks=True" not in explained  # it is on
    # What it was priced from, in the user's units.
    assert (
        f"full-checkpointing steps measured {0.5 * must_only * 1e3:.1f} ms (median of 3) against "
        f"must-only's {must_only * 1e3:.1f} ms (median of 3), faster" in explained
    ), explained
    assert report.peak <= limit, (report.peak, limit)
    assert abs(report.peak / report.predicted_peak - 1) < 0.03, (report.peak, report.predicted_peak)
    torch.manual_seed(10)
    assert_bitwise(step(reference, lambda: reference.loss(ids)), got)
    # A run resumed with the option off solves that plan again, and says why.
    off = tapesac_core.Controller(model, limit, **(SETTINGS | dict(torch_checkpoint_blocks=False)))
    with caplog.at_level("INFO", logger="tapesac_core"):
        off.load_state_dict(controller.state_dict())
    assert key not in off.plans and "torch_checkpoint_blocks" in caplog.text

    # With room for every block plain, plain beats it, however much faster torch's checkpoint
    # measured: a plain block does all a torch-checkpoint block does but its forward again. A
    # new limit is solved afresh, however noisy the profiles (a busy host): the plan at the old
    # limit is not favoured (its torch-checkpoint blocks stayed at a spread of 0.8).
    for region_name, profile in list(controller.profiles.items()):
        controller.profiling.profiles[region_name] = dataclasses.replace(profile, replay_spread=2.0)
    controller.replan(memory_limit="1GiB")
    report, got = _step(controller, model, ids, 12)
    assert report.plan.regions[region].kinds == (BlockKind.PLAIN,) * 4, report.plan.explain()
    torch.manual_seed(12)
    assert_bitwise(step(reference, lambda: reference.loss(ids)), got)

    # Measured slower: never chosen.
    controller.times.full[key] = [2.0 * must_only] * 3
    controller.replan()
    report, _ = _step(controller, model, ids, 11)
    assert BlockKind.TORCH_CHECKPOINT not in report.plan.regions[region].kinds
    assert report.torch_checkpointed == 0
    assert "not faster: no block runs under it" in report.plan.explain()


def test_full_checkpointing_is_not_measured_where_it_is_predicted_over_the_limit() -> None:
    _, model, ids = _models(moe=False)
    probe = tapesac_core.Controller(model, "1GiB", **SETTINGS)
    reports = [_step(probe, model, ids, seed)[0] for seed in range(9)]
    key = reports[-1].bucket
    # Just below it (and so below must-only's here: the recompute peaks where must-only's replay
    # does), the steps go on without it.
    full_peak = _full_checkpoint_peak(probe, key)
    controller = tapesac_core.Controller(model, full_peak - 256 * KiB, **SETTINGS)
    reports = [_step(controller, model, ids, seed)[0] for seed in range(4)]
    assert [str(r.mode) for r in reports] == ["warmup", "profile", "control", "planned"]
    explained = reports[-1].plan.explain()
    assert (
        "torch.utils.checkpoint was not measured for this bucket: a full-checkpointing step is predicted at"
        in explained
    ), explained


def test_full_checkpointing_steps_are_metered_against_their_prediction_on_accelerators() -> None:
    _, model, ids = _models(moe=False)
    controller = tapesac_core.Controller(model, "1GiB", **SETTINGS)
    controller.schedule.on_cpu = False  # as on an accelerator, where metering costs nothing
    reports = [_step(controller, model, ids, seed)[0] for seed in range(8)]
    full = [r for r in reports if str(r.mode) == "full"]
    assert len(full) == 3
    for r in full:
        assert r.peak is not None and r.predicted_peak, (r.peak, r.predicted_peak)
        assert r.peak <= r.predicted_peak <= 1.03 * r.peak, (r.peak, r.predicted_peak)
    assert controller.memory.model_error == 0  # within the margin: nothing to correct


class _Keyworded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, *, hidden: torch.Tensor, p: float) -> torch.Tensor:
        return torch.nn.functional.dropout(self.linear(hidden), p)


def test_a_block_under_torch_checkpoint_shows_torch_its_tensors_given_as_keywords(
    monkeypatch,
) -> None:
    # torch's checkpoint keeps the random states of the devices of the tensors among its
    # positional arguments: a block's tensors given as keywords must be among them (on an
    # accelerator it would otherwise draw other dropout masks in backward).
    seen: list[torch.Tensor] = []
    infer = torch.utils.checkpoint._infer_device_type

    def spy(*args):
        seen.extend(t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))
        return infer(*args)

    monkeypatch.setattr(torch.utils.checkpoint, "_infer_device_type", spy)
    reference = _Keyworded()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, 8, requires_grad=True)
    with tapesac_core.use_plan({"_Keyworded": [TORCH_CHECKPOINT]}):
        torch.manual_seed(0)
        got = step(block, lambda: block(hidden=x, p=0.5).sum())
    assert any(t is x for t in seen)
    torch.manual_seed(0)
    assert_bitwise(step(reference, lambda: reference(hidden=x, p=0.5).sum()), got)


def test_a_blocks_gain_is_the_measured_saving_shared_by_full_recompute_time() -> None:
    _, model, ids = _models(moe=False)
    controller = tapesac_core.Controller(model, "1GiB", **SHORT_SCHEDULE)
    for seed in range(3):
        _step(controller, model, ids, seed)
    profiles = controller.profiles
    (region,) = profiles
    tokens = {region: profiles[region].tokens}
    # A full step 10% faster than must-only's 2 s, of a must-only step modelled at 1.5 s: 0.15 s
    # saved, over 4 blocks of one region.
    gains = torch_checkpoint_gains(profiles, tokens, 2.0, 1.8, 1.5)
    assert gains == {region: pytest.approx(0.15 / 4)}
    assert torch_checkpoint_gains(profiles, tokens, 2.0, 2.2, 1.5) == {}


@pytest.mark.slow
def test_a_plan_is_solved_again_once_twice_the_full_checkpointing_steps_are_measured(
    caplog,
) -> None:
    reference, model, ids = _models(moe=False)
    controller = tapesac_core.Controller(model, "1GiB", **SETTINGS, full_control_every=1)
    reports = [_step(controller, model, ids, seed)[0] for seed in range(8)]
    key = reports[-1].bucket
    must_only = statistics.median(controller.times.of(key).must_only)
    # Priced from three steps that measured full checkpointing slower: not chosen.
    limit = _full_checkpoint_peak(controller, key) + 64 * KiB
    controller.replan(memory_limit=limit)
    controller.times.full[key] = [2.0 * must_only] * 3
    report = _step(controller, model, ids, 8)[0]
    first = controller.plans[key]
    assert str(report.mode) == "planned"
    assert BlockKind.TORCH_CHECKPOINT not in first.regions["DecoderLayer"].kinds
    # A full-checkpointing control step per planned step: the plan stands at 4 and 5 measured.
    modes = [str(_step(controller, model, ids, seed)[0].mode) for seed in range(9, 13)]
    assert modes == ["full", "planned", "full", "planned"], modes
    assert controller.plans[key] is first
    # The sixth, twice the three it was priced from, and the six say faster: solved again, with
    # blocks under torch's checkpoint, metered under the limit and bitwise.
    controller.times.full[key] = [0.5 * must_only] * 5
    with caplog.at_level("INFO", logger="tapesac_core"):
        assert str(_step(controller, model, ids, 13)[0].mode) == "full"
    assert key not in controller.plans
    assert "6 full-checkpointing steps measured, its plan priced torch's checkpoint from 3" in (
        caplog.text
    )
    report = _step(controller, model, ids, 14)[0]
    assert str(report.mode) == "planned"
    assert BlockKind.TORCH_CHECKPOINT in report.plan.regions["DecoderLayer"].kinds
    assert report.peak <= limit, (report.peak, limit)
    second = report.plan
    # Not again before twelve.
    for seed in range(15, 20):
        _step(controller, model, ids, seed)
    report, got = _step(controller, model, ids, 20)
    assert str(report.mode) == "planned" and len(controller.times.of(key).full) == 9
    assert report.plan is controller.plans[key] is second
    torch.manual_seed(20)
    assert_bitwise(step(reference, lambda: reference.loss(ids)), got)


def test_explain_says_where_full_recomputation_is_predicted_faster_and_the_option_is_off() -> None:
    """Beyond the band predictions are trusted within, explain() names the option that lets
    plans run blocks under torch's checkpoint, with its risk; not within it, nor when it is on."""
    config = tapesac_core.TapeSACConfig(memory_limit=0.9, speedup_band=0.15)
    (note,) = full_faster_notes(0.7, config)
    assert "predicted 1.43x faster than this plan" in note
    assert "torch_checkpoint_blocks=True" in note and "side effects" in note
    assert full_faster_notes(0.86, config) == ()
    on = dataclasses.replace(config, torch_checkpoint_blocks=True)
    assert full_faster_notes(0.7, on) == ()


def test_a_host_bound_stack_at_must_only_says_full_recomputation_is_predicted_faster() -> None:
    """Blocks of 200 ops on 16 elements: the host's work per op is all there is, and checking
    each steady-state call costs more of it than torch's checkpoint spends (the option is off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(TinyOps() for _ in range(4)))
    tapesac_core.checkpoint_modules(model, {TinyOps})
    x = torch.randn(SIZE, requires_grad=True)
    controller = tapesac_core.Controller(model, 0.0, **SHORT_SCHEDULE)
    report = None
    while report is None or report.mode != "planned":
        with controller.step(tokens=SIZE) as report:
            model(x).sum().backward()
    plan = report.plan
    assert plan is not None and plan.predicted_speedup_vs_full < 0.85, plan.explain()
    assert "torch_checkpoint_blocks=True lets plans run blocks under it" in plan.explain()
