"""Figure-9-style curve: recomputation eliminated against extra memory, Eq. 8 against the
peak-aware memory model, on the example dense and MoE models (CPU, live tensor bytes).

Both axes are shares of what disabling checkpointing uses or removes, over TapeSAC's must-only
step (its full checkpointing): extra memory = (peak - must-only peak) / (plain peak - must-only
peak); recomputation eliminated = (must-only backward FLOPs - planned backward FLOPs) /
(must-only backward FLOPs - plain backward FLOPs), FLOPs counted by FlopCounterMode. Beside it,
the share of must-only replay time the plan is predicted to remove (profiled node times; wall
times on a shared 2-core CPU are too noisy for a measured one). Limits are placed at must-only +
f x (plain - must-only) over 0.98 (the margin); each run trains a few steps on one batch whose
token count is its bucket's upper edge, and the first planned step is measured.
Writes benchmarks/results/peak_curve_{dense,moe}.json.

Run: python -m benchmarks.peak_curve [--moe] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

import tapesac_core
from benchmarks.common import pct
from benchmarks.workload import EXAMPLE_SHAPE
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
from examples.training import train_step
from tapesac_core.control.controller import CONTROL, PLANNED, Controller
from tapesac_core.measure.memory import LiveTensorMeter
from tapesac_core.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

FRACTIONS = (0.0, 0.025, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0)
SEQ = 434  # 2 x 434 = 868 tokens, the upper edge of its bucket


def measured(model, optimizer, ids, controller=None):
    with LiveTensorMeter() as meter:
        report, _ = train_step(model, optimizer, ids, controller)
    return meter.reading().peak, report


def run(base, ids, limit, memory_model):
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        warmup_steps=1,
        profile_steps=1,
        control_steps=1,
        control_every=0,
        memory_model=memory_model,
        peak_correction=False,
    )
    must_only = peak = report = None
    for _ in range(6):
        if report is not None and report.mode == PLANNED:
            report, flops = train_step(model, optimizer, ids, controller, True)
            break
        p, report = measured(model, optimizer, ids, controller)
        if report.mode == CONTROL:
            must_only = p
        elif report.mode == PLANNED:
            peak, predicted = p, report.predicted_peak
    plan = report.plan
    removed = plan.step_time - plan.step_time / plan.predicted_speedup
    return {
        "limit": limit,
        "capacity": plan.capacity,
        "peak": peak,
        "predicted_peak": predicted,
        "peak_at": plan.peak_at,
        "must_only_peak": must_only,
        "saved_bytes": plan.saved_bytes,
        "flops": flops,
        "replay_removed": removed / plan.replay_time if plan.replay_time else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peak_curve", description=__doc__)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(moe=args.moe, dropout=0.1, **EXAMPLE_SHAPE)
    base = DecoderLM(config)
    plain = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(base, {DecoderLayer, MoEDecoderLayer})
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    measured(plain, optimizer, ids)  # the optimizer's state exists from here on, as in the runs
    plain_peak, _ = measured(plain, optimizer, ids)
    plain_flops = train_step(plain, optimizer, ids, None, True)[1]
    probe = run(base, ids, "4GiB", "peak")
    must_only, must_flops = probe["must_only_peak"], run(base, ids, 1 << 20, "peak")["flops"]
    gap = plain_peak - must_only
    rows = []
    for memory_model in ("sum", "peak"):
        for f in FRACTIONS:
            r = run(base, ids, int((must_only + f * gap) / 0.98) + 1, memory_model)
            r.update(
                memory_model=memory_model,
                fraction=f,
                extra_memory=(r["peak"] - r["must_only_peak"]) / gap,
                flops_eliminated=(must_flops - r["flops"]) / (must_flops - plain_flops),
                capacity_used=(r["peak"] - r["must_only_peak"])
                / (r["capacity"] - r["must_only_peak"])
                if r["capacity"] - r["must_only_peak"] > 0.005 * r["capacity"]
                else None,
                prediction_error=(r["predicted_peak"] - r["peak"]) / r["peak"],
            )
            rows.append(r)
    print(
        f"plain peak {format_bytes(plain_peak)}, must-only peak {format_bytes(must_only)}; "
        f"backward GFLOP plain {plain_flops / 1e9:.3f}, must-only {must_flops / 1e9:.3f}"
    )
    print(
        "| model | f | limit | measured peak | predicted (err) | capacity used | extra memory "
        "| FLOPs eliminated | replay time removed (pred.) | peak at |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['memory_model']} | {r['fraction']:.3f} | {format_bytes(r['limit'])} "
            f"| {format_bytes(r['peak'])} | {format_bytes(r['predicted_peak'])} "
            f"({r['prediction_error']:+.1%}) | {pct(r['capacity_used'])} | {r['extra_memory']:.1%} "
            f"| {r['flops_eliminated']:.1%} | {r['replay_removed']:.1%} | {r['peak_at']} |"
        )
    out = ROOT / "benchmarks" / "results" / f"peak_curve_{'moe' if args.moe else 'dense'}.json"
    out.write_text(
        json.dumps(
            {
                "plain_peak": plain_peak,
                "must_only_peak": must_only,
                "plain_flops": plain_flops,
                "must_only_flops": must_flops,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
