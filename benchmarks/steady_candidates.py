"""What restricting plans to values a steady-state call can hold costs on the planner's frontier.

A block run in steady state holds only values on storages autograd saves or a submodule returns
(``tapesac_core.tape.steady.savable_values``), so the planner offers only those. For each model, the
region's frontier (beam search, the Controller's defaults) is solved with and without that
restriction from the same profile, and the replay time each removes within 10%, 25%, 50%, 75%
and 100% of the larger frontier's biggest save set is printed.

Run: python -m benchmarks.steady_candidates [--size small] [--models dense qwen3 moe]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import tapesac_core
from benchmarks.workload import build_model
from tapesac_core.control.profile import RegionProfile
from tapesac_core.plan import Point, solve_frontier


def profiles(kind: str, size: str) -> dict[str, RegionProfile]:
    """The model's region profiles after a Controller's warm-up and two profiling steps."""
    model, block, seq, batch = build_model(kind, size, 0.0)
    tapesac_core.checkpoint_modules(model, {block})
    controller = tapesac_core.Controller(model, 0.0, warmup_steps=1, profile_steps=2)
    vocab = getattr(model, "vocab_size", None) or model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        with controller.step(tokens=ids.numel()):
            model.loss(ids).backward()
        model.zero_grad(set_to_none=True)
    return controller.profiles


def removed_within(points: tuple[Point, ...], budget: float) -> float:
    """Replay seconds the frontier removes with a save set of at most ``budget`` bytes."""
    return max((points[0].time - p.time for p in points if p.bytes <= budget), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.steady_candidates", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size", default="small")
    parser.add_argument("--models", nargs="+", default=["dense", "qwen3", "moe"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for kind in args.models:
        for region, profile in profiles(kind, args.size).items():
            graph = profile.graph
            restricted = solve_frontier(graph, beam_width=24, max_set_size=12).points
            free = solve_frontier(
                dataclasses.replace(graph, savable=None), beam_width=24, max_set_size=12
            ).points
            ops = sum(v.kind == "op" for v in profile.tape.values)
            offered = "every" if graph.savable is None else len(graph.savable)
            print(
                f"{kind} {args.size} {region}: {offered} of {ops} op values offered; "
                f"must-only replay {1e3 * restricted[0].time:.2f} ms"
            )
            top = max(restricted[-1].bytes, free[-1].bytes)
            for share in (0.1, 0.25, 0.5, 0.75, 1.0):
                a, b = removed_within(restricted, share * top), removed_within(free, share * top)
                print(
                    f"  within {share * top / 2**20:6.2f} MiB: restricted removes {1e3 * a:6.2f} "
                    f"ms, unrestricted {1e3 * b:6.2f} ms ({a / b if b else 1.0:.3f})"
                )


if __name__ == "__main__":
    main()
