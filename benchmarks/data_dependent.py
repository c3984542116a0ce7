"""A MoE that loops only over the experts that received tokens: anchored coordinates vs none.

The op sequence of such a block changes with routing, so a plan's (op, k, j) coordinates stop
naming the values it chose. With anchored coordinates, a block whose sequence changed keeps
the planned values of submodules whose own ops match the reference's; without them (the plan
with its anchors stripped) it keeps only its mandatory set. Same weights, same batches, A/B
interleaved; measured per step: blocks whose sequence changed, bytes kept beyond S0, nodes
replayed, backward FLOPs (FlopCounterMode) and step time (median, IQR).

Run: python -m benchmarks.data_dependent [--steps 20] [--threads 1]
Writes benchmarks/results/data_dependent.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import tapesac_core
from benchmarks.common import iqr
from benchmarks.workload import EXAMPLE_SHAPE
from examples.models import DecoderLM, ModelConfig, MoEDecoderLayer
from examples.training import train_step
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.plan.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def without_anchors(plan: Plan) -> Plan:
    regions = {r: dataclasses.replace(p, anchors=(), modules={}) for r, p in plan.regions.items()}
    return dataclasses.replace(plan, regions=regions)


def measure(model: DecoderLM, plan: Plan, ids: torch.Tensor) -> dict[str, float]:
    flops = FlopCounterMode(display=False)
    with tapesac_core.use_plan(plan), tapesac_core.trace() as traces:
        start = time.perf_counter()
        loss = model.loss(ids)
        with flops:
            loss.backward()
        seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {
        "changed": sum(b.sequence_changed for b in traces),
        "kept_bytes": sum(b.tape.saved_bytes(b.tape.planned) for b in traces),
        "replayed": sum(len(b.replayed) for b in traces),
        "backward_flops": flops.get_total_flops(),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.data_dependent", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(
        moe=True,
        skip_empty_experts=True,
        num_experts=8,
        top_k=2,
        **EXAMPLE_SHAPE,
    )
    model = DecoderLM(config)
    tapesac_core.checkpoint_modules(model, {MoEDecoderLayer})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # same weights for every step
    controller = Controller(model, "1GiB", warmup_steps=1, profile_steps=2, control_steps=1)
    g = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:  # 16 tokens routed to 2 of 8 experts each: some experts idle
        return torch.randint(0, 256, (2, 8), generator=g)

    while controller.report is None or controller.report.mode != PLANNED:
        train_step(model, optimizer, batch(), controller)
    plans = {"anchored": controller.plan, "not_anchored": without_anchors(controller.plan)}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    for step in range(args.steps):
        ids = batch()
        for name in sorted(plans, reverse=step % 2 == 1):
            rows[name].append(measure(model, plans[name], ids))
    summary = {}
    for name, steps in rows.items():
        times = [r["seconds"] * 1e3 for r in steps]
        summary[name] = {
            key: statistics.mean(r[key] for r in steps)
            for key in ("changed", "kept_bytes", "replayed", "backward_flops")
        }
        summary[name].update(step_ms=statistics.median(times), iqr_ms=iqr(times))
        print(
            f"{name:13s} blocks changed/step {summary[name]['changed']:.2f}  kept "
            f"{summary[name]['kept_bytes'] / 1024:.1f} KiB  replayed {summary[name]['replayed']:.1f}"
            f"  backward {summary[name]['backward_flops'] / 1e6:.2f} MFLOP  step "
            f"{summary[name]['step_ms']:.1f} ms (IQR {summary[name]['iqr_ms']:.1f})"
        )
    out = ROOT / "benchmarks" / "results" / "data_dependent.json"
    out.write_text(
        json.dumps({"steps": args.steps, "threads": args.threads, "summary": summary}, indent=2)
    )


if __name__ == "__main__":
    main()
