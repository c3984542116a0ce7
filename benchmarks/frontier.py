"""The memory-time frontier: TapeSAC against every baseline, at equal memory, in one process.

Methods (every decoder layer is one block; all copies share the initial weights and batch):

* ``none``                      no activation checkpointing
* ``full``, ``full_no_stop``    torch.utils.checkpoint(use_reentrant=False), early_stop True
                                (default) / False (torchtitan's setting)
* ``tt_torch``, ``tt_tapesac``  torchtitan's op-level policy (save mm, SDPA, max; recompute every
                                second mm of a block) under torch's SAC / the same saved set as
                                TapeSAC coordinates (``use_plan``), replayed
* ``attn_torch``, ``attn_tapesac``  "save the attention output" likewise
* ``compile@b``                 torch.compile per block under
                                ``torch._functorch.config.activation_memory_budget = b``
* ``tapesac_must``              TapeSAC saving only S0
* ``tapesac@f``, ``tapesac=X``  TapeSAC planned by its Controller at a limit of must-only plus
                                ``f`` of everything worth saving, and at each baseline X's
                                measured peak (equal memory)
* ``tapesac@fig9=x``            ... at ``full``'s peak plus ``x`` of the gap to ``none``'s
                                (Figure 9's extra-memory share)

Per method: exact step peak (torch profiler on CPU, allocator on accelerators; bytes above those
live before the step), recomputed FLOPs (FlopCounterMode around backward minus ``none``'s, plus
attention FLOPs from shapes for SDPA kernels FlopCounterMode does not count), median step time
(forward + backward) with IQR over interleaved rounds (every method once per round, rotated
order), and the paper's Figure 9 normalisation against ``full``.

``--grow 3`` runs the batch-growth comparison instead: the hand-written policies, full
checkpointing and TapeSAC's Controller at one fixed limit with the batch grown 3x (which exceed
the limit, by how much; TapeSAC's re-planned speedup).

Run: python -m benchmarks.frontier [--size tiny|example|small|1b] [--model dense|moe|qwen3]
     [--steps 10] [--warmup 2] [--compile-backend inductor] [--out-dir benchmarks/results]
     [--markdown benchmarks/RESULTS.md] [--grow 3]   (or: tapesac bench ...)
Writes benchmarks/results/frontier_<model>_<size>.json (and _growth_), two PNG plots, and its
section of the markdown file.

This file is the command line and the run's order; the parts are beside it: workload.py (model,
block class, batch), method.py, baselines.py, tapesac_plans.py, measure.py, rows.py (Figure 9
shares), report.py (JSON, figures, RESULTS.md), figures.py (the comparison figures) and
growth.py (``--grow``).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines import baseline_methods, policy_replay_methods
from benchmarks.common import git_commit, machine
from benchmarks.growth import run_growth
from benchmarks.measure import count_flops, interleaved_rounds, measure_peaks, warm_up
from benchmarks.report import comparisons, table, update_markdown, write_growth, write_outputs
from benchmarks.rows import rows
from benchmarks.tapesac_plans import (
    limit_targets,
    must_only_method,
    plan_tapesac,
    planned_methods,
    tapesac_copy,
)
from benchmarks.workload import SIZES, load_workload

ROOT = Path(__file__).resolve().parents[1]

BUDGETS = (0.0, 0.1, 0.3, 0.5, 0.8)
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
FAMILIES = ("none", "full", "torch_sac", "tapesac_policy", "compile", "tapesac")
# update_markdown is re-exported: the harness's way to (re)write one section of RESULTS.md.
__all__ = ["main", "parser", "run", "update_markdown"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every method of ``args.families``: peaks, FLOPs and interleaved step times; the result
    (what the JSON holds)."""
    started = time.perf_counter()
    w = load_workload(args)
    families = set(args.families.split(",")) if args.families else set(FAMILIES)
    ids = w.ids(w.batch, seed=0)
    params = sum(p.numel() for p in w.model.parameters())
    print(
        f"[frontier] {args.model} {args.size}: {params / 1e6:.2f}M parameters, batch {w.batch} x "
        f"seq {w.seq}, {w.device} {args.dtype}",
        file=sys.stderr,
        flush=True,
    )

    methods = baseline_methods(w.model, w.block, args.budgets, args.compile_backend, families)
    tapesac_model, tape = tapesac_copy(w.model, w.block, ids)
    if "tapesac_policy" in families:
        methods += policy_replay_methods(tape, tapesac_model, w.block.__name__)
    if "tapesac" in families:
        methods.append(must_only_method(tapesac_model))
    warm_up(methods, ids)
    measure_peaks(methods, ids, w.device)

    # TapeSAC planned: a sweep of limits, and each baseline's measured peak (equal memory).
    plan_info: dict[str, Any] = {}
    if "tapesac" in families:
        targets = partial(limit_targets, methods, args.fractions, args.fig9_shares)
        plans, plan_info = plan_tapesac(
            copy.deepcopy(tapesac_model),
            ids,
            targets,
            args.max_set_size,
            args.torch_checkpoint_blocks,
            args.torch_checkpoint_steps,
        )
        methods += planned_methods(plans, tapesac_model, ids, w.device)
    count_flops(methods, ids)
    rounds = interleaved_rounds(methods, ids, w.device, args.warmup, args.steps)
    return {
        "command": args.command,
        "machine": machine(w.device),
        "commit": git_commit(),
        "model": args.model,
        "size": args.size,
        "max_set_size": args.max_set_size,
        "parameters": params,
        "seq": w.seq,
        "batch": w.batch,
        "dtype": args.dtype,
        "dropout": args.dropout,
        "device": str(w.device),
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "compile_backend": args.compile_backend,
        "compile_interleaved": True,
        "tapesac_planning": plan_info,
        "rows": rows(methods, rounds, plan_info.get("static_bytes_at_planning", 0)),
        "wall_s": time.perf_counter() - started,
    }


def parser(prog: str = "python -m benchmarks.frontier") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("dense", "moe", "qwen3"), default="dense")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
    p.add_argument("--batch", type=int, default=None, help="override the size's batch size")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10, help="measured interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds (not measured)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--budgets", type=lambda s: [float(x) for x in s.split(",")], default=list(BUDGETS)
    )
    p.add_argument(
        "--fractions", type=lambda s: [float(x) for x in s.split(",")], default=list(FRACTIONS)
    )
    p.add_argument(
        "--fig9-shares",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.05, 0.1],
        help="also plan at full's peak plus these shares of the gap to none's (Figure 9)",
    )
    p.add_argument(
        "--max-set-size",
        type=int,
        default=12,
        help="TapeSAC's max_set_size: candidates one block's save set may hold",
    )
    p.add_argument(
        "--torch-checkpoint-blocks",
        action="store_true",
        help="TapeSAC's plans may run blocks under torch.utils.checkpoint where measured faster",
    )
    p.add_argument(
        "--torch-checkpoint-steps",
        type=int,
        default=3,
        help="with --torch-checkpoint-blocks: must-only and full-checkpointing steps the probe "
        "measures, of each, alternating (TapeSACConfig.torch_checkpoint_steps)",
    )
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--families", default="", help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument(
        "--grow",
        type=int,
        default=0,
        help="instead of the frontier: batch grown this many times at a fixed limit",
    )
    p.add_argument(
        "--grow-limit",
        type=float,
        default=0.5,
        help="with --grow: the limit, from must-only's (0) to torchtitan policy's (1) "
        "measured peak at the grown batch",
    )
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the results section (table, comparisons, plots) to this file",
    )
    return p


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.frontier"
) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    args.command = " ".join([prog, *map(shlex.quote, argv)])
    if args.grow:
        g = run_growth(args)
        print(write_growth(g, args.out_dir, args.markdown))
        return g
    result = run(args)
    paths = write_outputs(result, args.out_dir, args.markdown)
    print(table(result))
    print("\n".join(comparisons(result)))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
