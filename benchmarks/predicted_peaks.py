"""Metered against predicted peaks of planned steps, batch lengths varying, every step metered.

The examples' model (dense or ``--moe``, dropout 0.1, batch 4 x 64-256 tokens drawn per step,
SGD), one process, TapeSAC's Controller with plain blocks at ``--memory-limit`` and
``meter_every=1``. Per metered planned step: its tokens, its bucket's upper edge, the plan
(values saved per block, ``P`` for plain, ``T`` for torch checkpoint), where the model puts the peak, and metered /
predicted. Then the largest and smallest ratio. Writes nothing.

Run: python -m benchmarks.predicted_peaks [--moe] [--memory-limit 45MiB] [--steps 70]
"""

from __future__ import annotations

import argparse

import torch

import tapesac_core
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
from tapesac_core.control.controller import PLANNED


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.predicted_peaks", description=__doc__.splitlines()[0]
    )
    p.add_argument("--moe", action="store_true")
    p.add_argument("--memory-limit", default="45MiB")
    p.add_argument("--steps", type=int, default=70)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    model = DecoderLM(ModelConfig(moe=args.moe, dropout=0.1, **shape))
    tapesac_core.checkpoint_modules(model, {DecoderLayer, MoEDecoderLayer})
    controller = tapesac_core.Controller(model, args.memory_limit, meter_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lengths = torch.Generator().manual_seed(0)
    ratios = []
    print("step tokens edge metered/predicted metered_MiB plan peak_at")
    for i in range(args.steps):
        length = int(torch.randint(64, 257, (1,), generator=lengths))
        ids = torch.randint(0, 256, (4, length), generator=lengths)
        with controller.step(tokens=ids.numel()) as report:
            model.loss(ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if report.mode != PLANNED or not (report.peak and report.predicted_peak):
            continue
        region = next(iter(report.plan.regions.values()))
        sizes = [
            {"plain": "P", "torch checkpoint": "T"}.get(e, str(e)) for e in region.block_entries()
        ]
        ratio = report.peak / report.predicted_peak
        ratios.append(ratio)
        print(
            f"{i} {ids.numel()} {region.tokens} {ratio:.4f} {report.peak / 2**20:.2f} "
            f"[{','.join(sizes)}] {report.plan.peak_at}"
        )
    if ratios:
        print(
            f"metered/predicted over {len(ratios)} steps: max {max(ratios):.4f}, min {min(ratios):.4f}"
        )


if __name__ == "__main__":
    main()
