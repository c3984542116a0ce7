"""The batch-growth comparison (``frontier.py --grow N``): the hand-written policies, full
checkpointing and TapeSAC's Controller at one fixed limit with the batch grown N times."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from benchmarks.baselines import baseline_methods, policy_replay_methods
from benchmarks.common import git_commit, machine, quartiles
from benchmarks.measure import interleaved_rounds, live_bytes, measure_peak
from benchmarks.method import Method
from benchmarks.tapesac_plans import (
    must_only_method,
    planned_method,
    quick_controller,
    steps_until_planned,
    tapesac_copy,
)
from benchmarks.workload import load_workload
from tapesac_core.control.controller import PLANNED
from tapesac_core.units import MiB


def run_growth(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-written policies, full checkpointing and TapeSAC at one fixed limit, the batch
    grown ``args.grow`` times: the limit lies between TapeSAC must-only's and torchtitan policy's
    measured peaks at the grown batch (``--grow-limit`` of the way; every method fits at the base
    batch when the limit is above its peak there): each method's peak against the limit, at both
    batches, and TapeSAC's Controller, which profiles again when tokens grow past its reprofile
    factor and plans again under the same limit; its re-planned step against must-only
    (interleaved rounds)."""
    started = time.perf_counter()
    w = load_workload(args)
    small = w.ids(w.batch, seed=w.batch)  # each batch size seeds its own ids
    grown = w.ids(w.batch * args.grow, seed=w.batch * args.grow)
    methods = baseline_methods(w.model, w.block, (), args.compile_backend, {"full", "torch_sac"})
    tapesac_model, tape = tapesac_copy(w.model, w.block, small)
    methods += policy_replay_methods(tape, tapesac_model, w.block.__name__)
    methods.append(must_only_method(tapesac_model))
    at_base = peaks_after_warm_up(methods, small, w.device)
    at_grown = peaks_after_warm_up(methods, grown, w.device)
    low, high = at_grown["tapesac_must"], at_grown["tt_torch"]
    limit = int(low + args.grow_limit * (high - low))

    history, plans = controller_through(copy.deepcopy(tapesac_model), limit, small, grown, w.device)
    grown_plan, base_plan = plans.get("grown"), plans.get("base")
    if grown_plan is not None:
        note = "the Controller's plan after the batch grew (profiled again)"
        methods.append(planned_method("tapesac_replanned", tapesac_model, grown_plan, note))
    if base_plan is not None:
        note = "the base batch's plan kept (values over a block's bytes are replayed)"
        methods.append(planned_method("tapesac_base_plan", tapesac_model, base_plan, note))
    for m in methods:
        if m.name in at_grown:
            m.peak = at_grown[m.name]
        else:
            m.warm(grown)
            m.peak = measure_peak(m, grown, w.device)
    rounds = interleaved_rounds(methods, grown, w.device, args.warmup, args.steps)
    out: dict[str, Any] = {
        "command": args.command,
        "machine": machine(w.device),
        "commit": git_commit(),
        "model": args.model,
        "size": args.size,
        "seq": w.seq,
        "batch": w.batch,
        "grow": args.grow,
        "limit_bytes": limit,
        "limit_from": f"TapeSAC must-only's measured peak at the grown batch + {args.grow_limit:g} x "
        "(torchtitan policy's - must-only's) there",
        "controller_history": history,
        "rows": [growth_row(m, at_base, limit) for m in methods],
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "device": str(w.device),
    }
    if grown_plan is not None:
        out["replanned_speedup"] = replanned_speedup(rounds, grown_plan)
    out["wall_s"] = time.perf_counter() - started
    return out


def peaks_after_warm_up(
    methods: list[Method], ids: torch.Tensor, device: torch.device
) -> dict[str, int]:
    """Each method's measured peak on ``ids``, every method warmed up on them first."""
    for m in methods:
        m.warm(ids)
    return {m.name: measure_peak(m, ids, device) for m in methods}


def controller_through(
    model: torch.nn.Module,
    limit: int,
    small: torch.Tensor,
    grown: torch.Tensor,
    device: torch.device,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One Controller at a fixed limit (above the bytes live now), through the base batch until
    it plans, then the grown one until it plans again: each step's mode, and the plans."""
    controller = quick_controller(model, max(live_bytes(device) + limit, MiB))
    history = []
    plans = {}
    for label, ids in (("base", small), ("grown", grown)):
        for report in steps_until_planned(controller, model, ids, 12):
            history.append({"batch": label, "mode": report.mode, "tokens": ids.numel()})
            if report.mode == PLANNED:
                plans[label] = report.plan
    return history, plans


def growth_row(m: Method, at_base: dict[str, int], limit: int) -> dict[str, Any]:
    q1, med, q3 = quartiles(m.times)
    return {
        "method": m.name,
        "family": m.family,
        "note": m.note,
        "peak_base_bytes": at_base.get(m.name),
        "peak_grown_bytes": m.peak,
        "over_limit_bytes": max(0, m.peak - limit),
        "median_s": med,
        "q1_s": q1,
        "q3_s": q3,
        "plan_saved_bytes": getattr(m.plan, "saved_bytes", None),
        "plan_predicted_speedup": getattr(m.plan, "predicted_speedup", None),
    }


def replanned_speedup(rounds: list[dict[str, float]], plan: Any) -> dict[str, float]:
    """The re-planned step against must-only, per round and as a ratio of medians."""
    must = [r["tapesac_must"] for r in rounds]
    replanned = [r["tapesac_replanned"] for r in rounds]
    q1, med, q3 = quartiles([a / b for a, b in zip(must, replanned)])
    return {
        "median_of_ratios": med,
        "q1": q1,
        "q3": q3,
        "ratio_of_medians": statistics.median(must) / statistics.median(replanned),
        "predicted": plan.predicted_speedup,
    }
