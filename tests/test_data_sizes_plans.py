"""Blocks whose sizes follow their data under a plan that keeps values of their experts: calls
of the plan's own op sequence and of others (an expert left idle: the plan's values found by
anchored coordinates, ``Block._matching_anchors``) run in steady state, switch templates,
stay bitwise, and never keep more than the plan allows the block."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support import assert_bitwise, step
from test_data_sizes import EVERY, EXPERTS, ONE_IDLE, D, _batch, _path, _spread

import tapesac_core
from tapesac_core.plan.plan import Plan, RegionPlan
from tapesac_core.tape.steady import SteadyForward
from tapesac_core.tape.tape import Tape


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class Experts(torch.nn.Module):
    """``test_data_sizes.Routed`` with each expert a submodule (its values anchored there)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = x[:, :EXPERTS].argmax(-1)
        order = torch.sort(chosen, stable=True).indices
        counts = torch.bincount(chosen, minlength=EXPERTS).tolist()
        out, start = torch.zeros_like(x), 0
        for e, n in enumerate(counts):
            if n:
                idx = order[start : start + n]
                out = out.index_add(0, idx, self.experts[e](x[idx]))
                start += n
        return out + x


def _plan(tape: Tape, modules: tuple[str, ...], budget: int | None) -> tuple[Plan, int]:
    """A plan keeping the tanh output of each of ``modules``, by coordinate and anchored, with
    ``budget`` bytes for the block (None: their bytes in ``tape``); and that budget."""
    saved = {
        v
        for n in tape.nodes
        if n.module in modules and n.name == "aten.tanh.default"
        for v in n.outs
    }
    anchors = frozenset(tape.anchor(v) for v in saved)
    budget = tape.saved_bytes(saved) if budget is None else budget
    region = RegionPlan(
        sequence=tape.fingerprint,
        blocks=(frozenset(map(tape.coord, saved)),),
        tokens=16,
        block_bytes=(budget,),
        anchors=(anchors,),
        modules={m: tape.module_fingerprints[m] for m, *_ in anchors},
    )
    plan = Plan(
        model=("m",),
        capacity=0,
        base=0,
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
        regions={tape.region: region},
    )
    return plan, budget


def _planned_blocks(
    modules: tuple[str, ...], budget: int | None = None
) -> tuple[Experts, Experts, Plan, int]:
    """A reference, a checkpointed copy, and the plan and budget ``_plan`` makes from a call at
    4 tokens per expert."""
    torch.manual_seed(0)
    reference = Experts()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    with tapesac_core.trace() as traces:
        block(_batch(dict.fromkeys(range(EXPERTS), 4), 99)).sum().backward()
    return reference, block, *_plan(traces[0].tape, modules, budget)


def _run(block: Experts, reference: Experts, x: torch.Tensor, plan: Plan) -> str:
    ref = step(reference, lambda: reference(x).pow(2).sum())
    with tapesac_core.trace() as blocks, tapesac_core.use_plan(plan):
        got = step(block, lambda: block(x).pow(2).sum())
    assert_bitwise(ref, got)
    return _path(blocks[0])


@pytest.mark.parametrize("experts", [EVERY, ONE_IDLE], ids=["plan_sequence", "other_sequence"])
def test_a_steady_state_call_keeps_no_more_than_the_plan_allows_the_block(
    experts: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan keeps expert 0's tanh output, within the bytes it takes at 4 tokens. Calls that
    route 1 to 4 tokens to expert 0 make a template and run from it; a call that routes 12
    there would keep 3x the block's bytes: it diverges (its backward runs its forward again,
    bitwise) and keeps nothing, as a recorded call keeps what fits."""
    reference, block, plan, budget = _planned_blocks(("experts.0",))
    kept: list[int] = []
    finish = SteadyForward.finish

    def finished(forward: SteadyForward, *args: object) -> str | None:
        diverged = finish(forward, *args)
        tape = forward.entry.tape
        kept.append(0 if diverged else tape.saved_bytes(tape.planned))
        return diverged

    monkeypatch.setattr(SteadyForward, "finish", finished)
    rest = tuple(e for e in experts if e != 0)
    rng = random.Random(1)
    counts = [rng.choice([1, 2, 3, 4]) for _ in range(16)] + [12] * 3
    paths = [
        _run(block, reference, _batch({0: n, **_spread(rest, rng, 16 - n)}, i), plan)
        for i, n in enumerate(counts)
    ]
    assert "steady" in paths[:16] and paths[-3] == "diverged", paths
    assert kept and max(kept) <= budget, (budget, kept)


@pytest.mark.parametrize("keep", [("experts.0",), ("experts.3",), ("experts.0", "experts.3")])
def test_calls_of_other_sets_switch_templates_under_a_plan_bitwise(keep: tuple[str, ...]) -> None:
    """Sets of experts in turn, some leaving an expert idle (another op sequence than the
    plan's), under a plan keeping experts' values: every call bitwise, and calls of both the
    plan's sequence and others run in steady state."""
    reference, block, plan, _ = _planned_blocks(keep, budget=2**30)
    rng = random.Random(0)
    sets = [EVERY] * 3 + [ONE_IDLE] * 4 + [(EVERY, ONE_IDLE, (0, 3))[i % 3] for i in range(24)]
    paths = [_run(block, reference, _batch(_spread(s, rng), i), plan) for i, s in enumerate(sets)]
    steady_sets = {s for s, p in zip(sets[7:], paths[7:]) if p == "steady"}
    assert {EVERY, ONE_IDLE} <= steady_sets, paths
