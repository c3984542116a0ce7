"""TapeSAC's methods: must-only, and plans by its Controller at limits (a sweep, each baseline's
measured peak, Figure 9's extra-memory shares), through its public ``replan`` and
``plan_for``."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

import tapesac_core
from benchmarks.measure import measure_peak
from benchmarks.method import Method, loss_backward
from tapesac_core import StepReport
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.units import MiB


def tapesac_copy(
    base: torch.nn.Module, block: type, ids: torch.Tensor
) -> tuple[torch.nn.Module, Any]:
    """A copy of ``base`` with TapeSAC on ``block``, and the tape of its first block on ``ids``
    (what the hand-written policies name their saved values on)."""
    model = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {block})
    with tapesac_core.trace() as traced:
        model.loss(ids).backward()
    model.zero_grad(set_to_none=True)
    return model, traced[0].tape


def must_only_method(model: torch.nn.Module) -> Method:
    return Method("tapesac_must", "tapesac", model, note="TapeSAC, S0 only")


def planned_method(
    name: str,
    model: torch.nn.Module,
    plan: Any,
    note: str,
    limit: int | None = None,
    predicted_peak: int | None = None,
) -> Method:
    return Method(
        name,
        "tapesac",
        model,
        context=partial(tapesac_core.use_plan, plan),
        limit=limit,
        plan=plan,
        predicted_peak=predicted_peak,
        note=note,
    )


# ---------------------------------------------------------------------- the Controller


def quick_controller(model: torch.nn.Module, limit: int | str, **settings: Any) -> Controller:
    """A Controller that plans after one warm-up and two profiling steps and takes no must-only
    control steps once planned; margin 0, so the limit is used as given (its fragmentation and
    near-limit checks stay)."""
    return Controller(
        model,
        limit,
        **{
            "warmup_steps": 1,
            "profile_steps": 2,
            "control_steps": 1,
            "control_every": 0,
            "margin": 0.0,
            **settings,
        },
    )


def steps_until_planned(
    controller: Controller, model: torch.nn.Module, ids: torch.Tensor, most: int
) -> Iterator[StepReport]:
    """Each step's report, up to the first planned one or ``most`` steps."""
    for _ in range(most):
        with controller.step(tokens=ids.numel()) as report:
            loss_backward(model, ids)
        yield report
        if report.mode == PLANNED:
            return


def plan_tapesac(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: Callable[[int], dict[str, int]],
    max_set_size: int = 12,
    torch_checkpoint_blocks: bool = False,
    torch_checkpoint_steps: int = 3,
) -> tuple[dict[str, tuple[int, Any, int]], dict[str, Any]]:
    """Plans by TapeSAC's Controller: a probe controller with no effective limit profiles the
    model (warm-up, profiling, one planned step: its plan saves everything worth saving), then
    the same controller solves the bucket again under each limit of ``targets(everything)``, a
    name -> bytes above those live at the step's start; the controller's limit is that plus the
    live bytes it measured at the step's start. Margin 0, so the limit is the baseline's measured
    peak itself. Each plan comes with its limit and the step peak the controller predicts for it
    at this batch, both above the bytes live at the step's start. With
    ``torch_checkpoint_blocks`` the plans may run blocks under torch.utils.checkpoint: must-only
    and full-checkpointing steps, alternating (``torch_checkpoint_steps`` of each), measure which
    is faster."""
    controller = quick_controller(
        model,
        "1TiB",
        max_set_size=max_set_size,
        torch_checkpoint_blocks=torch_checkpoint_blocks,
        torch_checkpoint_steps=torch_checkpoint_steps,
    )
    *_, report = steps_until_planned(controller, model, ids, 16 + 2 * torch_checkpoint_steps)
    if report.mode != PLANNED:
        raise RuntimeError("the probe controller never planned")
    static = controller.memory.samples[-1].static
    everything = report.plan.saved_bytes
    info = {
        "must_only_peak_model": report.plan.base - static,
        "everything_worth_saving": everything,
        "static_bytes_at_planning": static,
        "torch_checkpoint_blocks": torch_checkpoint_blocks,
    }
    if torch_checkpoint_blocks:
        times = controller.times.of(report.bucket)
        info["must_only_steps_s"], info["full_steps_s"] = list(times.must_only), list(times.full)
    plans = {}
    for name, limit in targets(everything).items():
        controller.replan(memory_limit=max(limit + static, MiB))
        plan = controller.plan_for(report.tokens)
        plans[name] = (limit, plan, controller.predicted_peak(plan, report.local_tokens) - static)
    return plans, info


# ---------------------------------------------------------------------- limits


def limit_targets(
    methods: list[Method], fractions: Sequence[float], shares: Sequence[float], everything: int
) -> dict[str, int]:
    """The limits to plan at, by row name: must-only's measured peak plus each fraction of
    ``everything`` worth saving, Figure 9's shares, and every other method's measured peak."""
    must = next(m for m in methods if m.name == "tapesac_must")
    named = {f"tapesac@{f:g}": int(must.peak + f * everything) for f in fractions}
    named |= figure9_targets(methods, shares)
    # Every other method's peak, below TapeSAC's must-only one too: the peak-aware model can plan
    # below it (saving removes replay temporaries), else the row says must-only.
    return named | {
        f"tapesac={m.name}": m.peak for m in methods if m.family != "tapesac" and m.peak is not None
    }


def figure9_targets(methods: list[Method], shares: Sequence[float]) -> dict[str, int]:
    """Limits at Figure 9's extra-memory shares: ``full``'s measured peak plus ``x`` of the gap to
    ``none``'s, named ``tapesac@fig9=x`` (the paper reads its curve at 10%)."""
    peak = {m.name: m.peak for m in methods}
    if peak.get("full") is None or peak.get("none") is None:
        return {}
    return {
        f"tapesac@fig9={x:g}": int(peak["full"] + x * (peak["none"] - peak["full"])) for x in shares
    }


# ---------------------------------------------------------------------- planned rows


def coords_key(plan: Any) -> str:
    """What a plan runs: per region and block, its coordinates and kind."""
    kinds = plan.block_kinds()
    return json.dumps(
        {
            r: [sorted(map(list, b)) for b in blocks] + [k.value for k in kinds.get(r, ())]
            for r, blocks in sorted(plan.coordinates().items())
        }
    )


def planned_methods(
    plans: dict[str, tuple[int, Any, int]],
    model: torch.nn.Module,
    ids: torch.Tensor,
    device: torch.device,
) -> list[Method]:
    """One method per distinct plan, by rising limit, its peak measured; a plan identical to an
    earlier one is a note on that one's row."""
    seen: dict[str, Method] = {}
    for name, (limit, plan, predicted_peak) in sorted(plans.items(), key=lambda kv: kv[1][0]):
        key = coords_key(plan)
        if key in seen:
            seen[key].note += f"; also the plan at {name}"
            continue
        m = planned_method(
            name,
            # Its own copy: its own steady-state tapes (see policy_replay_methods in baselines.py).
            copy.deepcopy(model),
            plan,
            f"Controller plan: saves {plan.saved_bytes} B beyond S0, predicted "
            f"{plan.predicted_speedup:.3f}x vs must-only; per block: "
            + "; ".join(
                f"{r} {', '.join(map(str, p.block_entries()))}"
                for r, p in sorted(plan.regions.items())
            ),
            limit,
            predicted_peak,
        )
        m.peak = measure_peak(m, ids, device)
        seen[key] = m
    return list(seen.values())
