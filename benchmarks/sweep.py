"""Sweep of absolute memory limits on the example model, trained on CPU under the controller.

For each limit between the must-only peak and the must-only peak plus everything worth saving:
the plan's saved bytes and capacity use, the measured step peak (live tensor bytes), predicted and
measured speedup against must-only, recomputed FLOPs in backward, and median step time. On CPU
the limit bounds the live tensor bytes of the whole process, so the limits run one after the
other, each alone in memory; within a run, must-only control steps are interleaved with planned
ones (every 5th step) so the measured speedup compares steps taken at the same time.
Writes benchmarks/results/sweep_{dense,moe}.json.

Run: python -m benchmarks.sweep [--moe] [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch

import tapesac_core
from benchmarks.common import iqr
from benchmarks.workload import EXAMPLE_SHAPE
from examples.data import batches
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
from examples.training import train_step
from tapesac_core.control.controller import PLANNED, Controller
from tapesac_core.measure.memory import LiveTensorMeter
from tapesac_core.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

FRACTIONS = (0.0, 0.15, 0.35, 0.6, 1.0)


class Run:
    """One limit: its own copy of the model (TapeSAC on its decoder layers), optimizer and
    controller."""

    def __init__(self, base: DecoderLM, limit: int | str) -> None:
        self.model = copy.deepcopy(base)
        tapesac_core.checkpoint_modules(self.model, {DecoderLayer, MoEDecoderLayer})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.controller = Controller(
            self.model, limit, warmup_steps=2, profile_steps=2, control_steps=2, control_every=5
        )
        self.limit = self.controller.limit_bytes()
        self.peaks: list[int] = []
        self.planned: list[float] = []
        self.flops: list[int] = []
        self.report = None

    def step(self, ids: torch.Tensor, measure: str | None) -> None:
        if measure == "peak":
            with LiveTensorMeter() as meter:
                report, _ = train_step(self.model, self.optimizer, ids, self.controller)
            self.peaks.append(meter.reading().peak)
        elif measure == "flops":
            report, flops = train_step(self.model, self.optimizer, ids, self.controller, True)
            self.flops.append(flops)
        else:
            report, _ = train_step(self.model, self.optimizer, ids, self.controller)
            if report.mode == PLANNED:
                self.planned.append(report.time)
        self.report = report


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(moe=args.moe, dropout=0.1, **EXAMPLE_SHAPE)
    base = DecoderLM(config)  # without checkpointing: each run checkpoints its own copy
    data = [next(batches(batch_size=8, max_len=128, min_len=128, seed=s)) for s in range(8)]

    probe = Run(base, "4GiB")
    for i in range(8):
        probe.step(data[i % len(data)], None)
    must_only, everything = probe.report.plan.base, probe.report.plan.saved_bytes
    plain = copy.deepcopy(base)
    plain_flops = train_step(plain, torch.optim.AdamW(plain.parameters()), data[0], None, True)[1]

    del probe, plain
    rows = []
    for fraction in FRACTIONS:
        run = Run(base, int((must_only + fraction * everything) / 0.98) + 1)
        for i in range(args.steps):
            left = args.steps - i
            run.step(data[i % len(data)], "peak" if left <= 2 else "flops" if left <= 4 else None)
        plan = run.report.plan or run.controller.plans.get(run.report.bucket)
        rows.append(
            {
                "limit": run.limit,
                "peak": max(run.peaks),
                "saved": plan.saved_bytes,
                "predicted_peak": plan.predicted_peak,
                "predicted_speedup": plan.predicted_speedup,
                "measured_speedup": run.report.measured_speedup,
                "recomputed_gflop": (statistics.median(run.flops) - plain_flops) / 1e9,
                "planned_step_ms": 1e3 * statistics.median(run.planned),
                "planned_step_iqr_ms": 1e3 * iqr(run.planned),
            }
        )
        del run
    print(
        f"must-only peak {format_bytes(must_only)}, everything worth saving adds "
        f"{format_bytes(everything)}; {args.steps} rounds, {args.threads} thread(s)"
    )
    print(
        "| limit | measured peak (predicted) | saved | predicted speedup | measured speedup "
        "| measured / predicted | recomputed GFLOP | planned step ms (IQR) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = f"{r['measured_speedup']:.3f}" if r["measured_speedup"] else "-"
        ratio = (
            f"{r['measured_speedup'] / r['predicted_speedup']:.3f}"
            if r["measured_speedup"]
            else "-"
        )
        print(
            f"| {format_bytes(r['limit'])} | {format_bytes(r['peak'])} ({format_bytes(r['predicted_peak'])}) "
            f"| {format_bytes(r['saved'])} | {r['predicted_speedup']:.3f} | {measured} | {ratio} "
            f"| {r['recomputed_gflop']:.3f} | {r['planned_step_ms']:.1f} ({r['planned_step_iqr_ms']:.1f}) |"
        )
    out = ROOT / "benchmarks" / "results" / f"sweep_{'moe' if args.moe else 'dense'}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"must_only": must_only, "everything": everything, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
