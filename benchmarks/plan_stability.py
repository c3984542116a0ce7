"""How much a plan moves between fresh runs: the Controller run afresh ``--runs`` times at each
limit, on the same model and batch, and the share of must-only's recomputation its first plan
eliminates.

Model: a Hugging Face ``Qwen3ForCausalLM`` stack (``--hidden``, 4 layers, 4 x 256 tokens). Limits
sit at must-only's step peak plus a share of the gap up to no checkpointing's (``--shares``),
both measured here (live tensor bytes of one step). Per run: the controller trains until its
first planned step; that step's recomputed FLOPs (``FlopCounterMode``) against must-only's and no
checkpointing's give the share eliminated, (must-only − plan) / (must-only − none). Reported per
limit: each run's share, their range, and how many distinct plans the runs chose. A plan that
moves with timing noise shows as a wide range; a frontier that is not monotonic in the limit,
as a larger limit eliminating less.

Run: python -m benchmarks.plan_stability [--hidden 256] [--runs 6] [--shares 0.004,0.1,0.23]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

import tapesac_core
from benchmarks.steady_state import hf_stack
from tapesac_core.control.controller import PLANNED
from tapesac_core.measure.memory import LiveTensorMeter
from tapesac_core.plan.plan import Plan


def _step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.loss(ids).backward()
    model.zero_grad(set_to_none=True)


def _peak(run: Callable[[], None]) -> int:
    with LiveTensorMeter() as meter:
        run()
    return meter.reading().peak


def _flops(run: Callable[[], None]) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def _measured(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """A step's peak and FLOPs, after a first step (which records, for TapeSAC blocks)."""
    _step(model, ids)
    return _peak(lambda: _step(model, ids)), _flops(lambda: _step(model, ids))


def _fresh(hidden: int, checkpointed: bool) -> torch.nn.Module:
    model, block, _, _ = hf_stack(hidden)
    if checkpointed:
        tapesac_core.checkpoint_modules(model, {block})
    return model


def first_plan(hidden: int, ids: torch.Tensor, limit: int) -> tuple[int, str, float]:
    """A fresh model and Controller at ``limit`` bytes, trained to the first planned step: that
    step's FLOPs, its plan (one entry per block: values saved, or P for plain) and its predicted
    speedup over must-only."""
    model = _fresh(hidden, checkpointed=True)
    controller = tapesac_core.Controller(model, limit)
    while True:
        with controller.step(tokens=ids.numel()) as report:
            _step(model, ids)
        if report.mode == PLANNED:
            break
    plan = report.plan
    assert plan is not None
    with controller.step(tokens=ids.numel()), FlopCounterMode(display=False) as counter:
        _step(model, ids)
    return counter.get_total_flops(), plan_entries(plan), plan.predicted_speedup


def plan_entries(plan: Plan) -> str:
    """One entry per block, in brackets: values saved, or P for plain, T for torch checkpoint."""
    names = {"plain": "P", "torch checkpoint": "T"}
    blocks = [names.get(str(e), str(e)) for r in plan.regions.values() for e in r.block_entries()]
    return "[" + ",".join(blocks) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_stability", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--shares", default="0.004,0.1,0.23")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, _, seq, batch = hf_stack(args.hidden)
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    none_peak, none_flops = _measured(_fresh(args.hidden, checkpointed=False), ids)
    must_peak, must_flops = _measured(_fresh(args.hidden, checkpointed=True), ids)
    print(
        f"HF Qwen3ForCausalLM, 4 layers, hidden {args.hidden}, {batch}x{seq} tokens; "
        f"torch {torch.__version__}, 1 thread; step peak none {none_peak / 2**20:.2f} MiB, "
        f"must-only {must_peak / 2**20:.2f} MiB; recomputed GFLOP "
        f"{(must_flops - none_flops) / 1e9:.3f}"
    )
    print(
        "| limit (share of gap) | eliminated per run | range | distinct plans | predicted speedup |"
    )
    print("|---|---|---|---|---|")
    for share in (float(s) for s in args.shares.split(",")):
        limit = round(must_peak + share * (none_peak - must_peak))
        runs = [first_plan(args.hidden, ids, limit) for _ in range(args.runs)]
        shares = [(must_flops - f) / (must_flops - none_flops) for f, _, _ in runs]
        speedups = [s for _, _, s in runs]
        print(
            f"| {limit / 2**20:.2f} MiB (+{share:.1%}) | "
            + " ".join(f"{s:.1%}" for s in shares)
            + f" | {min(shares):.1%}-{max(shares):.1%} | {len({p for _, p, _ in runs})} | "
            + f"{min(speedups):.3f}-{max(speedups):.3f}x |"
        )
        for plan in sorted({p for _, p, _ in runs}):
            print(f"|   plan {plan} | | | | |")


if __name__ == "__main__":
    main()
