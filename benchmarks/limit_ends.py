"""TapeSAC at the ends of the frontier and in between, on the Hugging Face Qwen3 stack (issue 32).

For each ``--hidden``: a fresh Controller (``--margin``, 0 by default; no control steps; the
near-limit rule at its default; a bucket's first planned step metered) at

- no checkpointing's measured step peak: its steps against no checkpointing's;
- torch checkpoint's measured step peak (every block under ``checkpoint_wrapper``): its steps
  against torch checkpoint's;
- must-only's peak plus ``--share`` of the gap up to no checkpointing's: how much of the headroom
  above must-only its first planned step uses, and how far its predicted peak sits above the
  metered one.

Peaks are a step's rise in live tensor bytes over what was live as it began (``LiveTensorMeter``,
as the Controller meters on CPU); a Controller's absolute limit is the bytes live before its
first step plus the reference's rise, so every model alive in this process counts alike.
Times are CPU seconds of a step on this thread, the two methods interleaved (order alternating)
for ``--rounds`` rounds of ``--reps`` steps each; reported as the median per-round ratio of
medians, with its IQR and the round count.

Run: python -m benchmarks.limit_ends [--hidden 128,256] [--rounds 15] [--reps 3] [--share 0.1]
[--margin 0.0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import tapesac_core
from benchmarks.baselines import wrap_torch
from benchmarks.common import quartiles
from benchmarks.measure import live_bytes
from benchmarks.plan_stability import _fresh, _step, plan_entries
from benchmarks.steady_state import hf_stack
from tapesac_core.control.controller import PLANNED
from tapesac_core.measure.memory import LiveTensorMeter
from tapesac_core.plan.plan import Plan

MiB = 2**20


@dataclass(frozen=True)
class Planned:
    """A Controller trained to its first planned step and a few more."""

    run: Callable[[], None]  # one more controller step
    plan: Plan
    metered: int  # the first planned step's metered rise, bytes
    predicted: int  # its predicted rise, bytes


def rise(run: Callable[[], None]) -> int:
    """The most bytes ``run`` holds above what was live as it began."""
    with LiveTensorMeter() as meter:
        start = meter.reading().current
        run()
    return meter.reading().peak - start


def planned(
    hidden: int, ids: torch.Tensor, allowed: int, margin: float = 0.0, after: int = 3
) -> Planned:
    """A Controller whose limit lets its steps rise ``allowed`` bytes over what is live now."""
    model = _fresh(hidden, checkpointed=True)
    static = live_bytes(torch.device("cpu"))
    controller = tapesac_core.Controller(
        model,
        static + allowed,
        margin=margin,
        control_steps=0,
        control_every=0,
        meter_every=0,
    )

    def run() -> tapesac_core.StepReport:
        with controller.step(tokens=ids.numel()) as report:
            _step(model, ids)
        return report

    first = run()
    while first.mode != PLANNED:
        first = run()
    for _ in range(after):  # past the first planned step: steady blocks, no metering
        run()
    assert first.plan is not None and first.peak is not None

    def again() -> None:
        run()

    return Planned(
        run=again,
        plan=first.plan,
        metered=first.peak - static,
        predicted=(first.predicted_peak or static) - static,
    )


def seconds(run: Callable[[], None]) -> float:
    start = time.thread_time()
    run()
    return time.thread_time() - start


def ratio(ours: Callable[[], None], theirs: Callable[[], None], rounds: int, reps: int) -> str:
    """Median over rounds of (our median step / their median step), its IQR and the count."""
    ratios = []
    for r in range(rounds):
        pair = [ours, theirs] if r % 2 == 0 else [theirs, ours]
        medians = {id(f): statistics.median(seconds(f) for _ in range(reps)) for f in pair}
        ratios.append(medians[id(ours)] / medians[id(theirs)])
    lo, mid, hi = quartiles(ratios)
    return f"{mid:.3f}x (IQR {lo:.3f}-{hi:.3f}, {rounds} rounds)"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.limit_ends", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hidden", default="128,256")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--margin", type=float, default=0.0, help="the Controllers' margin")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; peaks in MiB above the bytes live before a step")
    print("| hidden | limit | plan | metered / predicted peak | step time |")
    print("|---|---|---|---|---|")
    for hidden in (int(h) for h in args.hidden.split(",")):
        _, block, seq, batch = hf_stack(hidden)
        ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
        none = _fresh(hidden, checkpointed=False)
        full = wrap_torch(_fresh(hidden, checkpointed=False), block, early_stop=True)
        must = _fresh(hidden, checkpointed=True)
        for model in (none, full, must):
            _step(model, ids)  # a first step (which records, for TapeSAC blocks)
        peaks = {
            name: rise(lambda m=m: _step(m, ids))
            for name, m in (("none", none), ("full", full), ("must-only", must))
        }
        ends = (("none", none), ("full", full))
        for name, reference in ends:
            p = planned(hidden, ids, peaks[name], args.margin)
            against = ratio(p.run, lambda r=reference: _step(r, ids), args.rounds, args.reps)
            print(
                f"| {hidden} | {name}'s peak, {peaks[name] / MiB:.2f} | {plan_entries(p.plan)} | "
                f"{p.metered / MiB:.2f} / {p.predicted / MiB:.2f} | {against} vs {name} |"
            )
        low, high = peaks["must-only"], peaks["none"]
        limit = round(low + args.share * (high - low))
        p = planned(hidden, ids, limit, args.margin)
        used = (p.metered - low) / (limit - low)
        above = (p.predicted - p.metered) / p.metered
        print(
            f"| {hidden} | must-only + {args.share:.0%} of the gap, {limit / MiB:.2f} "
            f"(must-only {low / MiB:.2f}, none {high / MiB:.2f}) | {plan_entries(p.plan)} | "
            f"{p.metered / MiB:.2f} / {p.predicted / MiB:.2f}: headroom used {used:.1%}, "
            f"predicted {above:+.2%} | |"
        )


if __name__ == "__main__":
    main()
