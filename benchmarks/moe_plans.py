"""MoE and dropout blocks: TapeSAC must-only and under a plan against torch's full checkpoint,
on batches whose routing changes every step, interleaved in one process.

Models (Hugging Face, 4 layers; ``--hidden``): ``Qwen3MoeForCausalLM`` with 16 experts top-2 at
4 x 128 tokens, its experts a loop over the experts hit (``eager``: sizes that follow the
routing) or one grouped GEMM (``grouped_mm``), and ``GPT2LMHeadModel`` with dropout 0.1 at 4 x
256 tokens. For each, four ways of running the same training step on copies of one model:

* ``none``             no checkpointing (the FLOPs every other method's are counted over)
* ``full``             every layer under ``torch.utils.checkpoint(use_reentrant=False)``
* ``tapesac_steady``   TapeSAC must-only (no Controller)
* ``tapesac_planned``  TapeSAC under a Controller with its default settings at ``full``'s
                       measured step peak (measured as the timed rounds run: each copy's
                       weights alive, gradients freed after each step)

Step ``k`` of every method takes batch ``k`` of a pool of ``--batches`` random batches, so the
experts hit change from step to step. Each round runs ``--reps`` steps of every method in an
order rotated per round; a round's value is the median of its steps (the calling thread's CPU
time, one torch thread). Reported per method: median step and IQR over rounds, the per-round
ratio against ``full`` (median, IQR, rounds), the share of TapeSAC's layer calls that ran in
steady state in the timed rounds (``tapesac_planned``: its verification steps, which record by
design, count against it), recomputed FLOPs (``FlopCounterMode``, one step over ``none``'s) and
the step's exact peak (torch's profiler, ``profile_memory=True``).

Run: python -m benchmarks.moe_plans [--models qwen3_moe_eager,qwen3_moe_grouped_mm,gpt2]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import tapesac_core
from benchmarks.common import rotated
from benchmarks.steady_state import flops, hf_gpt2, hf_qwen3_moe, methods, planned, report, step

MODELS = ("qwen3_moe_eager", "qwen3_moe_grouped_mm", "gpt2")
Run = tuple[torch.nn.Module, Callable[[], Any]]


def build(name: str, hidden: int) -> tuple[torch.nn.Module, type, int, int, str]:
    """The model, its layer class, sequence length, batch and a title."""
    if name == "gpt2":
        base, layer, seq, batch = hf_gpt2(hidden, dropout=0.1)
        return base, layer, seq, batch, f"HF GPT2LMHeadModel, dropout 0.1, hidden {hidden}"
    experts = name.removeprefix("qwen3_moe_")
    base, layer, seq, batch = hf_qwen3_moe(hidden, experts=experts)
    title = f"HF Qwen3MoeForCausalLM, {experts} experts 16 top-2, hidden {hidden}"
    return base, layer, seq, batch, title


class Share:
    """How many of a method's TapeSAC layer calls ran in steady state, while ``on``."""

    def __init__(self) -> None:
        self.steady = self.blocks = 0
        self.on = False

    def add(self, steady: int, blocks: int) -> None:
        if self.on:
            self.steady, self.blocks = self.steady + steady, self.blocks + blocks

    def __str__(self) -> str:
        return f"{self.steady / self.blocks:.1%} of {self.blocks}" if self.blocks else "-"


def must_only(context: Callable[[], Any], share: Share) -> Callable[[], Any]:
    """A must-only model's step ``context``, counting its steady-state layer calls."""

    @contextmanager
    def run() -> Iterator[None]:
        with context(), tapesac_core.trace() as blocks:
            yield
        share.add(sum(b.steady for b in blocks), len(blocks))

    return run


def under_plan(controller: tapesac_core.Controller, tokens: int, share: Share) -> Callable[[], Any]:
    """A Controller's step, counting the steady-state layer calls of its planned steps."""

    @contextmanager
    def run() -> Iterator[None]:
        with controller.step(tokens=tokens):
            yield
        report = controller.report
        if report is not None and report.mode == tapesac_core.StepMode.PLANNED:
            share.add(report.steady_blocks, report.blocks)

    return run


def measure(
    runs: dict[str, Run], pool: list[torch.Tensor], rounds: int, reps: int
) -> dict[str, list[float]]:
    """Per method, each round's median step seconds; each method's ``k``-th step on batch ``k``
    of ``pool``."""
    batches = {name: itertools.cycle(pool) for name in runs}
    out: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(rounds):
        for name in rotated(list(runs), r):
            model, context = runs[name]
            times = [step(model, context, next(batches[name])) for _ in range(reps)]
            out[name].append(statistics.median(times))
    return out


def compare(name: str, hidden: int, rounds: int, reps: int, warmup: int, batches: int) -> str:
    """One model's table: times, steady-state shares, recomputed FLOPs, peaks."""
    base, layer, seq, batch, title = build(name, hidden)
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, base.vocab_size, (batch, seq), generator=g) for _ in range(batches)]
    every = methods(base, layer)
    runs: dict[str, Run] = {k: every[k] for k in ("none", "full", "tapesac_steady")}
    model, controller = planned(runs, pool[0])
    shares = {"tapesac_steady": Share(), "tapesac_planned": Share()}
    runs["tapesac_steady"] = (
        runs["tapesac_steady"][0],
        must_only(runs["tapesac_steady"][1], shares["tapesac_steady"]),
    )
    runs["tapesac_planned"] = (
        model,
        under_plan(controller, pool[0].numel(), shares["tapesac_planned"]),
    )
    measure(runs, pool, warmup, 1)  # tapes and templates, uncounted
    for share in shares.values():
        share.on = True
    times = measure(runs, pool, rounds, reps)
    for share in shares.values():
        share.on = False
    flop = {n: flops(m, c, pool[0]) for n, (m, c) in runs.items()}
    peaks = {
        n: tapesac_core.profile_memory(functools.partial(step, m, c, pool[0]))[1].peak
        for n, (m, c) in runs.items()
    }
    heading = f"{title}, {batch}x{seq} tokens, a pool of {batches} batches"
    lines = [report(heading, times, flop, peaks)]
    lines += [f"{n} layer calls in steady state, timed rounds: {s}" for n, s in shares.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.moe_plans", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {MODELS}")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=12, help="uncounted steps per method")
    parser.add_argument("--batches", type=int, default=8, help="batches the steps cycle over")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not one of {MODELS}")
        print(compare(name, args.hidden, args.rounds, args.reps, args.warmup, args.batches))
        print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds x {args.reps} steps\n")


if __name__ == "__main__":
    main()
