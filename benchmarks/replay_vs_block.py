"""TapeSAC must-only replay vs torch.utils.checkpoint block recomputation, on the example models.

For the dense and the MoE example decoder, four configurations of the same weights and batches:

* ``none``          no activation checkpointing
* ``torch``         torch.utils.checkpoint, non-reentrant, early_stop=True (the default), applied to
                    every decoder layer with ``checkpoint_wrapper(CheckpointImpl.NO_REENTRANT)``
* ``torch_no_stop`` the same with early_stop=False (torchtitan's setting)
* ``tapesac``       ``checkpoint_modules(model, {layer class})``, no plan (saves only S0)

Measured: step time (A/B interleaved rounds, rotating order), peak and forward-end live bytes
(torch profiler, exact), FLOPs and aten ops recomputed in backward, TapeSAC replayed nodes, and
the host cost of recording per op on a loop of tiny ops (with a cProfile of it).

Run: python -m benchmarks.replay_vs_block [--steps 12] [--size small|medium] [--threads 1]
     [--cprofile]
Writes benchmarks/results/replay_vs_block.json.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.flop_counter import FlopCounterMode

import tapesac_core
from benchmarks.common import (
    BareNoOpMode,
    NoOpMode,
    OpCounter,
    git_commit,
    median_seconds,
    mib,
    quartiles,
    rotated,
)
from examples.data import batches
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
from tapesac_core.measure.memory import profile_memory

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ("none", "torch", "torch_no_stop", "tapesac")
SIZES = {
    # hidden, heads, kv heads, head_dim, dense MLP width, expert width, seq, batch
    "small": dict(
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=512,
        moe_intermediate_size=256,
        seq=128,
        batch=4,
    ),
    "medium": dict(
        hidden_size=384,
        num_heads=12,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=1024,
        moe_intermediate_size=384,
        seq=256,
        batch=4,
    ),
}


# ---------------------------------------------------------------------- models


def model_config(size: str, moe: bool) -> tuple[ModelConfig, int, int]:
    shape = dict(SIZES[size])
    seq, batch = shape.pop("seq"), shape.pop("batch")
    config = ModelConfig(num_layers=4, dropout=0.1, moe=moe, num_experts=4, top_k=2, **shape)
    return config, seq, batch


def variants(config: ModelConfig) -> dict[str, DecoderLM]:
    """One deep copy of the same initial model per configuration, checkpointed its way."""
    torch.manual_seed(0)
    base = DecoderLM(config)
    layer = MoEDecoderLayer if config.moe else DecoderLayer
    models = {name: copy.deepcopy(base) for name in CONFIGS}
    for name, early_stop in (("torch", True), ("torch_no_stop", False)):
        wrap = partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, early_stop=early_stop
        )
        apply_activation_checkpointing(
            models[name], checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer)
        )
    tapesac_core.checkpoint_modules(models["tapesac"], {layer})
    return models


def step(model: DecoderLM, ids: torch.Tensor) -> None:
    """One training step without the optimizer: forward, loss, backward."""
    model.loss(ids).backward()


def timed_step(model: DecoderLM, ids: torch.Tensor) -> tuple[float, float]:
    """Seconds of forward (with loss) and of backward of one step."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model.loss(ids)
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


# ---------------------------------------------------------------------- measurements


def interleaved_times(
    models: dict[str, DecoderLM], data: Any, rounds: int, warmup: int
) -> dict[str, Any]:
    """Each round: one step of every configuration on the same batch, order rotated per round."""
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    forward: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(warmup + rounds):
        ids = next(data)
        for name in rotated(CONFIGS, r):
            fwd, bwd = timed_step(models[name], ids)
            if r >= warmup:
                times[name].append(fwd + bwd)
                forward[name].append(fwd)
    ratios = [a / b for a, b in zip(times["tapesac"], times["torch"])]
    ratios_no_stop = [a / b for a, b in zip(times["tapesac"], times["torch_no_stop"])]
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "median_ms": {name: 1e3 * m for name, m in median.items()},
        "min_ms": {name: 1e3 * min(ts) for name, ts in times.items()},
        "median_forward_ms": {name: 1e3 * statistics.median(ts) for name, ts in forward.items()},
        "median_backward_ms": {
            name: 1e3 * statistics.median([t - f for t, f in zip(ts, forward[name])])
            for name, ts in times.items()
        },
        "ratio_tapesac_torch": median["tapesac"] / median["torch"],
        "ratio_tapesac_torch_no_stop": median["tapesac"] / median["torch_no_stop"],
        "per_round_ratio_tapesac_torch": ratio_spread(ratios),
        "per_round_ratio_tapesac_torch_no_stop": ratio_spread(ratios_no_stop),
        "rounds": rounds,
    }


def ratio_spread(xs: list[float]) -> dict[str, Any]:
    q1, _, q3 = quartiles(xs)
    return {"min": min(xs), "max": max(xs), "iqr": (q1, q3)}


def memory(model: DecoderLM, ids: torch.Tensor) -> dict[str, int]:
    """Exact live-byte deltas: peak and residual of a full step; live bytes at forward end."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    _, full = profile_memory(lambda: step(model, ids))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss, fwd = profile_memory(lambda: model.loss(ids))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"step_peak": full.peak, "step_end": full.end, "forward_end": fwd.end}


# Not counted: torch's recompute detaches every tensor it saves, autograd detaches unpacked ones;
# neither computes anything.
IDENTITY_OPS = frozenset({"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"})


def backward_work(model: DecoderLM, ids: torch.Tensor) -> dict[str, Any]:
    """FLOPs and aten ops in backward (and FLOPs of forward); TapeSAC's replay counts."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with tapesac_core.trace() as blocks:
        with FlopCounterMode(display=False) as fwd_flops:
            loss = model.loss(ids)
        with FlopCounterMode(display=False) as bwd_flops, OpCounter(IDENTITY_OPS) as ops:
            loss.backward()
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {
        "forward_flops": fwd_flops.get_total_flops(),
        "backward_flops": bwd_flops.get_total_flops(),
        "backward_ops": ops.count,
    }
    if blocks:
        out["tape_nodes"] = sum(len(b.tape.nodes) for b in blocks)
        out["replayed_nodes"] = sum(len(b.replayed) for b in blocks)
        out["block_nodes_model"] = sum(len(b.tape.block_nodes()) for b in blocks)
        out["saved_bytes"] = sum(b.saved_bytes for b in blocks)
    return out


def measure_model(
    config: ModelConfig, seq: int, batch: int, rounds: int, warmup: int
) -> dict[str, Any]:
    models = variants(config)
    data = batches(batch, seq, seed=0, min_len=seq)
    ids = next(data)
    result: dict[str, Any] = {"memory": {}, "work": {}}
    for name, model in models.items():
        result["memory"][name] = memory(model, ids)
        result["work"][name] = backward_work(model, ids)
    base = result["work"]["none"]
    for name in CONFIGS:
        work = result["work"][name]
        work["recomputed_flops"] = work["backward_flops"] - base["backward_flops"]
        work["recomputed_ops"] = work["backward_ops"] - base["backward_ops"]
    result["time"] = interleaved_times(models, data, rounds, warmup)
    return result


# ---------------------------------------------------------------------- recording overhead


def tiny_loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(100):
        x = (x * w).sin() + 1.0
    return x


def _noop_hooks(mode_cls: type) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def run(x: torch.Tensor, w: torch.Tensor) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), mode_cls():
            return tiny_loop(x, w)

    return run


def recording_overhead(reps: int) -> dict[str, Any]:
    """Forward host time of the tiny loop under each wrapper, per recorded op."""
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    n_ops = len(tapesac_core.record(tiny_loop, x, w).nodes)
    runs = {
        "plain": lambda: tiny_loop(x, w),
        "noop_mode_and_hooks": lambda: _noop_hooks(NoOpMode)(x, w),
        "noop_mode_no_dynamo_guard_and_hooks": lambda: _noop_hooks(BareNoOpMode)(x, w),
        "torch_checkpoint": lambda: torch.utils.checkpoint.checkpoint(
            tiny_loop, x, w, use_reentrant=False
        ),
        "tapesac": lambda: tapesac_core.checkpoint(tiny_loop, x, w),
    }
    for fn in runs.values():  # warm-up
        for _ in range(5):
            fn()
    # Interleave in chunks so drift on the shared machine hits every variant alike.
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(10):
        for name, fn in runs.items():
            samples[name].append(1e6 * median_seconds(fn, max(1, reps // 10))[0])
    median = {name: statistics.median(s) for name, s in samples.items()}
    per_op = {name: (median[name] - median["plain"]) / n_ops for name in runs if name != "plain"}
    return {
        "recorded_ops": n_ops,
        "forward_us": median,
        "overhead_us_per_op": per_op,
        "top_functions": top_functions(
            lambda: tapesac_core.checkpoint(tiny_loop, x, w), reps=50, per=50 * n_ops
        ),
    }


def top_functions(fn: Callable[[], Any], reps: int, per: int, top: int = 10) -> list[dict]:
    """cProfile of ``fn`` run ``reps`` times: functions by own time, in µs per ``per`` units."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ...)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls_per_unit": nc / per,
            "tottime_us_per_unit": 1e6 * tt / per,
            "cumtime_us_per_unit": 1e6 * ct / per,
        }
        for (file, line, name), (_, nc, tt, ct, _) in rows
    ]


def profile_step(config: ModelConfig, seq: int, batch: int, name: str) -> list[dict]:
    """cProfile of one training step of one configuration (after a warm-up step)."""
    model = variants(config)[name]
    ids = next(batches(batch, seq, seed=0, min_len=seq))
    timed_step(model, ids)
    model.zero_grad(set_to_none=True)
    return top_functions(lambda: step(model, ids), reps=1, per=1, top=15)


# ---------------------------------------------------------------------- report


def model_table(label: str, r: dict[str, Any]) -> str:
    t, mem, work = r["time"], r["memory"], r["work"]
    none_ms = t["median_ms"]["none"]
    lines = [
        f"### {label}",
        "",
        "| config | median step ms | fwd ms | bwd ms | min step ms | vs none "
        "| step peak MiB | forward-end MiB "
        "| step-end MiB | recomputed GFLOP | recomputed % of fwd FLOPs "
        "| recomputed aten ops (no detach) "
        "| TapeSAC replayed / block-model / tape nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        w = work[name]
        nodes = (
            f"{w['replayed_nodes']} / {w['block_nodes_model']} / {w['tape_nodes']}"
            if "replayed_nodes" in w
            else ""
        )
        lines.append(
            f"| {name} | {t['median_ms'][name]:.1f} | {t['median_forward_ms'][name]:.1f} "
            f"| {t['median_backward_ms'][name]:.1f} | {t['min_ms'][name]:.1f} "
            f"| {t['median_ms'][name] / none_ms:.3f} | {mib(mem[name]['step_peak'])} "
            f"| {mib(mem[name]['forward_end'])} | {mib(mem[name]['step_end'])} "
            f"| {w['recomputed_flops'] / 1e9:.3f} "
            f"| {100 * w['recomputed_flops'] / w['forward_flops']:.1f} "
            f"| {w['recomputed_ops']} | {nodes} |"
        )
    for other, key in (("torch", "tapesac_torch"), ("torch_no_stop", "tapesac_torch_no_stop")):
        spread = t[f"per_round_ratio_{key}"]
        lines.append("")
        lines.append(
            f"TapeSAC / {other} (ratio of medians): **{t[f'ratio_{key}']:.3f}**; "
            f"per-round ratios over {t['rounds']} rounds: min {spread['min']:.3f}, "
            f"IQR {spread['iqr'][0]:.3f}-{spread['iqr'][1]:.3f}, "
            f"max {spread['max']:.3f}"
        )
    lines.append(
        "\nMemory columns are live-byte deltas from torch's profiler with the garbage "
        "collector off: step-end is what a step leaves allocated (the grads, plus anything "
        "kept until the next gc). Recomputed FLOPs are backward FLOPs minus those of `none` "
        "(FlopCounterMode counts matmuls and attention, not elementwise ops); recomputed "
        "aten ops likewise, detach/alias excluded."
    )
    lines.append(
        f"\nTapeSAC saved bytes (S0 beyond leaves, all blocks): {work['tapesac']['saved_bytes']} B"
    )
    return "\n".join(lines)


def overhead_table(o: dict[str, Any]) -> str:
    lines = [
        f"### Recording overhead (tiny loop, {o['recorded_ops']} recorded ops, forward only)",
        "",
        "| variant | forward µs | overhead µs / recorded op |",
        "|---|---|---|",
    ]
    for name, us in o["forward_us"].items():
        per = o["overhead_us_per_op"].get(name)
        lines.append(f"| {name} | {us:.0f} | {'' if per is None else f'{per:.2f}'} |")
    lines += [
        "",
        "Top functions of TapeSAC's forward by own time (cProfile, so inflated; per recorded op):",
        "",
        "| function | calls / op | own µs / op | cum µs / op |",
        "|---|---|---|---|",
    ]
    for f in o["top_functions"]:
        lines.append(
            f"| `{f['function']}` | {f['calls_per_unit']:.2f} "
            f"| {f['tottime_us_per_unit']:.2f} | {f['cumtime_us_per_unit']:.2f} |"
        )
    return "\n".join(lines)


def profile_table(what: str, rows: list[dict]) -> str:
    lines = [
        f"### cProfile of one training step: {what} (top 15 by own time)",
        "",
        "| function | calls | own ms | cum ms |",
        "|---|---|---|---|",
    ]
    for f in rows:
        lines.append(
            f"| `{f['function']}` | {f['calls_per_unit']:.0f} "
            f"| {1e-3 * f['tottime_us_per_unit']:.1f} | {1e-3 * f['cumtime_us_per_unit']:.1f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay_vs_block", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=12, help="measured interleaved rounds")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds (not measured)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: steadier on a shared CPU)",
    )
    parser.add_argument("--reps", type=int, default=300, help="repetitions of the tiny loop")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="also cProfile one TapeSAC training step of each model",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/replay_vs_block.json"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "commit": git_commit(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "size": args.size,
        "rounds": args.steps,
        "warmup_rounds": args.warmup,
        "baseline": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper("
        "checkpoint_impl=NO_REENTRANT, early_stop=True|False) on each decoder layer "
        "via apply_activation_checkpointing; preserve_rng_state=True (default)",
        "models": {},
    }
    report = [
        f"## TapeSAC must-only replay vs torch.utils.checkpoint "
        f"(commit {results['commit']}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), size {args.size})"
    ]
    for label, moe in (("dense", False), ("moe", True)):
        config, seq, batch = model_config(args.size, moe)
        fields = {
            k: v
            for k, v in vars(config).items()
            if k
            in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate_size",
                "dropout",
                "moe",
                "num_experts",
                "top_k",
                "moe_intermediate_size",
                "shared_expert",
                "vocab_size",
            )
        }
        print(f"[{label}] config {fields} seq={seq} batch={batch}", file=sys.stderr, flush=True)
        r = measure_model(config, seq, batch, args.steps, args.warmup)
        r["config"] = fields | {"seq": seq, "batch": batch}
        if args.cprofile:
            r["cprofile_tapesac_step"] = profile_step(config, seq, batch, "tapesac")
            r["cprofile_torch_step"] = profile_step(config, seq, batch, "torch")
        results["models"][label] = r
        report.append(f"\nConfig: {r['config']}\n")
        report.append(model_table(label, r))
        if args.cprofile:
            report.append("\n" + profile_table(f"{label}, tapesac", r["cprofile_tapesac_step"]))
            report.append("\n" + profile_table(f"{label}, torch", r["cprofile_torch_step"]))
        gc.collect()
    print("[overhead] tiny-op loop", file=sys.stderr, flush=True)
    results["recording_overhead"] = recording_overhead(args.reps)
    report.append("\n" + overhead_table(results["recording_overhead"]))
    results["wall_s"] = time.perf_counter() - started
    report.append(f"\n(total benchmark wall time {results['wall_s']:.0f} s)")

    print("\n".join(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
