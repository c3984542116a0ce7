"""The mixture-of-experts families transformers ships, both experts implementations: a loop over
the experts hit (``eager``, sizes that follow the routing) and one grouped GEMM (``grouped_mm``).

Each tiny model trains beside a copy without checkpointing, batch for batch and SGD step for
SGD step: loss and every gradient bitwise at every step, must-only and under a Controller's
plans. Must-only, its blocks reach steady state after warm-up (``data_sizes.py``: the eager
loop records until a template binds its sizes). Under a Controller at a limit halfway between
the must-only step's metered peak and no checkpointing's, the first planned step meters within
its prediction and under the limit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from moe_families import EXPERTS, FAMILIES, VOCAB, moe_model
from support import SHORT_SCHEDULE, token_ids

import tapesac_core
from tapesac_core.control.controller import PLANNED, PROFILE, Controller
from tapesac_core.tape.steady import Recorded

pytest.importorskip("transformers")

STEPS = 8
WARMUP = 4  # recorded calls of the eager loop before its template is trusted (data_sizes.py)
BATCH, SEQ = 2, 24


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _lockstep(reference: torch.nn.Module, model: torch.nn.Module) -> Callable[..., None]:
    """One SGD step of both models on one batch, from one RNG state, compared bit for bit."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]

    def step(ids: torch.Tensor, seed: int) -> None:
        torch.manual_seed(seed)
        expected = _loss(reference, ids)
        expected.backward()
        torch.manual_seed(seed)
        got = _loss(model, ids)
        got.backward()
        assert torch.equal(expected, got), (expected.item(), got.item())
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(a.grad, b.grad), name
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def _must_only_reaches_steady_state(family: str, experts: str) -> None:
    reference, layer = moe_model(family, experts)
    model = copy.deepcopy(reference)
    tapesac_core.checkpoint_modules(model, {layer})
    step = _lockstep(reference, model)
    reasons = set()
    for i in range(STEPS):
        with tapesac_core.trace() as blocks:
            step(token_ids(i, batch=BATCH, seq=SEQ, vocab=VOCAB), i)
        assert not any(b.diverged for b in blocks), (i, [b.diverged for b in blocks])
        if i >= WARMUP:
            assert all(b.steady for b in blocks), (i, [b.recorded_because for b in blocks])
        reasons |= {b.recorded_because for b in blocks if not b.steady}
    # The eager loop's sizes follow the routing: its warm-up records until a template binds them.
    if experts == "eager":
        assert str(Recorded.DATA_SIZES) in reasons, reasons
    assert reasons <= {str(Recorded.FIRST_CALL), str(Recorded.DATA_SIZES)}, reasons


def _planned(base: torch.nn.Module, layer: type, limit: int | str) -> tuple[int, int, int]:
    """Steps under a Controller at ``limit``, bitwise against the model without checkpointing:
    the must-only profile step's metered peak, and the first planned step's metered and
    predicted peaks. Every step sees the same batch (its sample's)."""
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {layer})
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        margin=0.0,
        near_limit=1.0,
        meter_every=1,
        peak_correction=False,
    )
    step = _lockstep(reference, model)
    ids = token_ids(0, batch=BATCH, seq=SEQ, vocab=VOCAB)
    must_only = first = None
    for i in range(5):
        with controller.step(tokens=ids.numel()) as report:
            step(ids, i)
        if report.mode == PROFILE:
            must_only = report.peak
        elif report.mode == PLANNED and first is None:
            first = (report.peak, report.predicted_peak)
    assert must_only is not None and first is not None and None not in first
    return must_only, *first


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_must_only_is_bitwise_and_reaches_steady_state(family: str, experts: str) -> None:
    _must_only_reaches_steady_state(family, experts)


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_planned_steps_are_bitwise_within_their_prediction_and_the_limit(
    family: str, experts: str
) -> None:
    base, layer = moe_model(family, experts)
    # Every block plain at 1 GiB: no checkpointing's peak, and what the model predicts for it.
    # (On Qwen3.5-MoE's linear attention the must-only step peaks higher than no checkpointing,
    # and the model prices its plain blocks 32% above their metered peak: halfway between
    # must-only and the prediction is a limit the planner can meet.)
    must_only, everything, predicted_everything = _planned(base, layer, "1GiB")
    limit = (must_only + max(everything, predicted_everything)) // 2
    _, metered, predicted = _planned(base, layer, limit)
    assert metered <= predicted <= limit, (family, experts, limit, predicted, metered)


def test_planned_eager_experts_run_in_steady_state_whichever_experts_they_hit() -> None:
    """Qwen3-MoE's eager experts under a Controller's plan, batches of 8 tokens over 4 experts
    (some calls leave an expert idle, and then run another op sequence than the plan's
    reference block): after warm-up, planned steps run their blocks from cached templates
    (switching between the sets of experts hit, ``structure_switch.py``), bitwise at every
    step. Blocks whose op sequence differed from the plan's recorded every call before."""
    base, layer = moe_model("qwen3_moe", "eager")
    base.config.use_cache = False  # as in training: a forward run again sees the same cache
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {layer})
    controller = Controller(model, 0.0, **SHORT_SCHEDULE)  # the lowest-peak plan
    step = _lockstep(reference, model)
    steady = blocks = 0
    for i in range(72):
        with controller.step(tokens=8) as report:
            step(token_ids(i, batch=1, seq=8, vocab=VOCAB), i)
        if report.mode == PLANNED and i >= 40:
            steady, blocks = steady + report.steady_blocks, blocks + report.blocks
    # 9% where a block whose op sequence differed from the plan's recorded every call (d1d8fb5).
    assert blocks and steady >= 0.85 * blocks, (steady, blocks)
