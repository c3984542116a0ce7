"""The checks of benchmarks/gpu_check.sh, one stage per call; each prints one JSON line and
writes it to ``--out``; exit status 1 when the check fails.

Stages (``--device cuda`` on a GPU, ``cpu`` to test the script here):

* ``versions``     Python, torch, transformers, lightning, accelerate, matplotlib, the device;
                   fails on anything missing, or on a device that is not there.
* ``correctness``  bitwise replay with dropout (the device's generators): loss and every gradient
                   of a TapeSAC step (must-only, and a plan saving attention) equal those without
                   checkpointing.
* ``timing``       per-op node times (CUDA events on GPU) against the wall time of the same
                   blocks' forward: their sum lies within the wall time and is not negligible.
* ``limit``        TapeSAC's Controller under an absolute limit between the must-only peak and
                   no checkpointing: planned steps' metered peaks (allocator on GPU) stay under it.
* ``mixed``        a plan mixing plain, torch-checkpoint, attention-saving and must-only blocks (~1B)
                   (bf16): bitwise, and timed against no checkpointing and torch's checkpoint.
* ``offload``      the ~1B model (bf16) at a limit ``--fraction`` (0.7) of the way from the
                   memory a step starts with to must-only's peak: the Controller's plan (offloading over the link it
                   measured) timed, interleaved, against full checkpointing under
                   ``save_on_cpu(pin_memory=True)``; planned steps' metered peaks against the
                   limit, the measured bandwidths, and the share of copy time the plan models as
                   hidden. On CPU (no host link) a link is set by hand, so the stage runs.
* ``host``         host time per op of the ~1B model's forward (bf16) without checkpointing,
                   under torch's checkpoint, TapeSAC recorded and TapeSAC in steady state, beside
                   the blocks' kernel time per op (CUDA events): where host time per op exceeds
                   kernel time per op, the step is host-bound.

Run: python -m benchmarks.gpu_stages STAGE --device cuda --size small --out FILE
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        seq=128,
        batch=4,
    ),
    "small": dict(
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
        seq=1024,
        batch=4,
    ),
}


def versions(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    missing = []
    for name in (
        "torch",
        "transformers",
        "lightning",
        "accelerate",
        "matplotlib",
        "tapesac_core",
        "tapesac_lightning",
        "examples.models",
    ):
        try:
            module = importlib.import_module(name)
            out[name] = getattr(module, "__version__", str(Path(module.__file__).parent))
        except Exception as e:  # noqa: BLE001
            missing.append(f"{name}: {type(e).__name__}: {e}")
    import torch

    out["device"] = args.device
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            missing.append("CUDA device requested but torch.cuda.is_available() is False")
        else:
            out["gpu"] = torch.cuda.get_device_name()
            out["cuda"] = torch.version.cuda
    out["ok"] = not missing
    out["missing"] = missing
    return out


def _model(args: argparse.Namespace, dropout: float) -> tuple[Any, Any]:
    import torch

    from examples.models import DecoderLM, ModelConfig

    shape = dict(SIZES[args.size])
    seq, batch = shape.pop("seq"), shape.pop("batch")
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(dropout=dropout, **shape)).to(args.device)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1)).to(
        args.device
    )
    return model, ids


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import torch

    import tapesac_core
    from examples.models import DecoderLayer

    plain, ids = _model(args, dropout=0.1)
    ours = copy.deepcopy(plain)
    tapesac_core.checkpoint_modules(ours, {DecoderLayer})
    with tapesac_core.trace() as blocks:
        ours.loss(ids)  # recorded only, to name the attention kernel's coordinate
    sdpa = [n for n in blocks[0].tape.nodes if "scaled_dot_product" in n.name]
    plans = {
        "must-only": {},
        "attention saved": {"DecoderLayer": {(sdpa[0].name, 0, 0), (sdpa[0].name, 0, 1)}}
        if sdpa
        else {},
    }

    def step(model: Any, plan: Any) -> tuple[Any, list]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        with tapesac_core.use_plan(plan):
            loss = model.loss(ids)
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = step(plain, {})
    out: dict[str, Any] = {"dropout": 0.1, "device": args.device}
    ok = True
    for name, plan in plans.items():
        with tapesac_core.trace() as blocks:
            loss, grads = step(ours, plan)
        equal = torch.equal(loss, ref_loss) and all(
            torch.equal(a, b) for a, b in zip(grads, ref_grads)
        )
        replayed = sum(len(b.replayed) for b in blocks)
        out[name] = {"bitwise_equal": equal, "replayed_nodes": replayed}
        ok = ok and equal and replayed > 0
    out["ok"] = ok
    return out


def _rope(model: Any, ids: Any) -> tuple[Any, Any]:
    from examples.models import rotary_cos_sin

    x = model.embed_tokens.weight
    return rotary_cos_sin(ids.shape[1], model.config.head_dim, model.config.rope_theta, x)


def timing(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tapesac_core
    from benchmarks.measure import synchronize
    from examples.models import DecoderLayer
    from tapesac_core.measure.timing import seconds

    model, ids = _model(args, dropout=0.0)
    tapesac_core.checkpoint_modules(model, {DecoderLayer})
    device = torch.device(args.device)
    hidden = model.embed_tokens(ids).detach()
    cos, sin = _rope(model, ids)
    for _ in range(2):  # warm-up (kernels, allocator)
        model.layers[0](hidden, cos, sin).sum().backward()
    rows = []
    for _ in range(3):
        with tapesac_core.trace(time_nodes=True) as blocks:
            synchronize(device)
            start = time.perf_counter()
            out = hidden
            for layer in model.layers:
                out = layer(out, cos, sin)
            synchronize(device)
            wall = time.perf_counter() - start
            out.sum().backward()
        forward = sum(seconds(s) for b in blocks for s in b.forward_times.values())
        replay = sum(seconds(s) for b in blocks for ss in b.node_times.values() for s in ss)
        rows.append(
            {
                "forward_wall_s": wall,
                "forward_node_sum_s": forward,
                "share": forward / wall,
                "replay_node_sum_s": replay,
                "replay_host_wall_s": sum(b.replay_seconds for b in blocks),
            }
        )
    best = min(rows, key=lambda r: r["forward_wall_s"])
    # Node times are each op alone; the wall adds recording (host) around them.
    out = {
        "runs": rows,
        "ok": all(0.02 < r["share"] <= 1.05 for r in rows) and best["replay_node_sum_s"] > 0,
    }
    return out


def limit(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import torch

    import tapesac_core
    from examples.models import DecoderLayer
    from tapesac_core.control.controller import PLANNED

    model, ids = _model(args, dropout=0.0)
    device = torch.device(args.device)
    plain = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(model, {DecoderLayer})

    def peak(m: Any) -> int:
        m.zero_grad(set_to_none=True)
        with tapesac_core.memory_meter(device) as meter:
            m.loss(ids).backward()
        m.zero_grad(set_to_none=True)
        return meter.reading().peak

    peak(plain)
    none_peak, must_peak = peak(plain), peak(model)
    del plain
    limit_bytes = int(must_peak + 0.5 * (none_peak - must_peak))
    controller = tapesac_core.Controller(
        model, limit_bytes, warmup_steps=1, profile_steps=2, control_steps=1, control_every=0
    )
    steps = []
    for _ in range(8):
        with controller.step(tokens=ids.numel()) as report:
            model.zero_grad(set_to_none=True)
            model.loss(ids).backward()
            model.zero_grad(set_to_none=True)
        with tapesac_core.use_plan(report.plan) if report.plan else contextlib.nullcontext():
            planned_peak = peak(model) if report.mode == PLANNED else None
        steps.append({"mode": report.mode, "metered_peak": report.peak, "peak": planned_peak})
    planned = [s for s in steps if s["mode"] == PLANNED]
    return {
        "limit_bytes": limit_bytes,
        "none_peak": none_peak,
        "must_only_peak": must_peak,
        "plan_saved_bytes": controller.plan.saved_bytes if controller.plan else None,
        "predicted_speedup": controller.predicted_speedup,
        "steps": steps,
        "ok": bool(planned) and all(s["peak"] <= limit_bytes for s in planned),
    }


def readiness(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU-readiness fixes on a real device: (1) forwards whose backward never runs leave no
    memory behind; (2) a custom op drawing its own dropout mask replays bitwise; (3) reserved
    memory left by a step near the limit raises the fragmentation estimate at most once; (8) the
    MoE example (index_put_ with accumulate) is bitwise under deterministic algorithms."""
    import copy
    import gc

    import torch

    import tapesac_core
    from examples.kernels import FusedDropout
    from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
    from tapesac_core.control.controller import PLANNED

    device = torch.device(args.device)
    out: dict[str, Any] = {}

    model, ids = _model(args, dropout=0.0)
    tapesac_core.checkpoint_modules(model, {DecoderLayer})
    saving = tapesac_core.use_plan({"DecoderLayer": {("aten.mm.default", k, 0) for k in range(7)}})
    with tapesac_core.memory_meter(device) as meter, saving:
        before = meter.reading().current
        for _ in range(3):
            model.loss(ids)  # grad on, backward never runs
        gc.collect()
        out["1_leak_bytes"] = meter.reading().current - before

    kernel = tapesac_core.register_kernel(
        "tapesac_gpu_check::fused_dropout",
        FusedDropout,
        schema="(Tensor x, float dropout_p) -> (Tensor, Tensor)",
        fake=lambda x, _: (x.new_empty(x.shape), x.new_empty(x.shape)),
    )
    linear = torch.nn.Linear(64, 64, device=device)
    x = torch.randn(32, 64, device=device)
    grads = []
    for fused, checkpointed in ((FusedDropout.apply, False), (kernel, True)):
        linear.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        block = lambda x, f=fused: (f(linear(x).sin(), 0.5) ** 2).tanh()  # noqa: E731
        (tapesac_core.checkpoint(block, x) if checkpointed else block(x)).sum().backward()
        grads.append([p.grad.clone() for p in linear.parameters()])
    out["2_random_custom_op_bitwise"] = all(torch.equal(a, b) for a, b in zip(*grads))

    with tapesac_core.memory_meter(device) as meter:  # the must-only step's peak
        model.loss(ids).backward()
    model.zero_grad(set_to_none=True)
    controller = tapesac_core.Controller(
        model,
        int(meter.reading().peak * 1.15),
        warmup_steps=1,
        profile_steps=1,
        control_steps=1,
        control_every=0,
    )
    estimates = []
    for _ in range(10):
        with controller.step(tokens=ids.numel()) as report:
            model.loss(ids).backward()
            model.zero_grad(set_to_none=True)
        if report.mode == PLANNED:
            estimates.append(controller.memory.extra_fragmentation)
    out["3_fragmentation_estimates"] = estimates

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        moe = DecoderLM(ModelConfig(moe=True, num_layers=2)).to(device)
        ours = copy.deepcopy(moe)
        tapesac_core.checkpoint_modules(ours, {MoEDecoderLayer})
        tokens = torch.randint(0, 256, (2, 64), device=device)
        results = []
        for m in (moe, ours):
            loss = m.loss(tokens)
            loss.backward()
            results.append([loss.detach(), *[p.grad for p in m.parameters()]])
        out["8_moe_bitwise_deterministic"] = all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    out["ok"] = (
        out["1_leak_bytes"] <= 0
        and out["2_random_custom_op_bitwise"]
        and len(set(estimates)) <= 2
        and out["8_moe_bitwise_deterministic"]
    )
    return out


def _grads(model: Any, ids: Any, plan: Any) -> tuple[Any, list]:
    """Loss and gradients of one step with dropout from a fixed seed, under ``plan``."""
    import torch

    import tapesac_core

    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with tapesac_core.use_plan(plan):
        loss = model.loss(ids)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _largest_difference(a: tuple[Any, list], b: tuple[Any, list]) -> float:
    return max(
        (x.float() - y.float()).abs().max().item() for x, y in zip([a[0], *a[1]], [b[0], *b[1]])
    )


def _frontier_model(args: argparse.Namespace, dropout: float) -> tuple[Any, type, Any]:
    """The frontier's ~1B dense model on ``args.device`` in bf16 (its tiny size on CPU, fp32),
    its block class, and a batch of token ids."""
    import torch

    from benchmarks.workload import build_model

    device = torch.device(args.device)
    base, block, seq, batch = build_model(
        "dense", "1b" if args.size == "small" else "tiny", dropout
    )
    base = base.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    ids = torch.randint(
        0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
    ).to(device)
    return base, block, ids


def mixed(args: argparse.Namespace) -> dict[str, Any]:
    """A mixed plan (plain and torch-checkpoint blocks between blocks saving attention and
    must-only blocks; the tiny model's two blocks: plain, attention) on the
    frontier's Qwen3-style ~1B model in bf16 (its tiny size on CPU, fp32), dropout 0.1: loss and
    gradients bitwise those without checkpointing, and its step timed, interleaved, against no
    checkpointing and torch's checkpoint on every block (medians and quartiles of per-round
    ratios)."""
    import copy

    import torch

    import tapesac_core
    from benchmarks.baselines import wrap_torch
    from benchmarks.common import quartiles
    from benchmarks.measure import interleaved_rounds
    from benchmarks.method import Method

    device = torch.device(args.device)
    base, block, ids = _frontier_model(args, dropout=0.1)
    ours = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(ours, {block})
    with tapesac_core.trace() as blocks:
        ours.loss(ids)  # recorded only, to name the attention kernel's outputs
    region = blocks[0].tape.region
    sdpa = next(n.name for n in blocks[0].tape.nodes if "scaled_dot_product" in n.name)
    unrecorded = (tapesac_core.PLAIN, tapesac_core.TORCH_CHECKPOINT)
    pattern = [unrecorded[0], {(sdpa, 0, 0), (sdpa, 0, 1)}, unrecorded[1], set()]
    plan = {region: [pattern[i % len(pattern)] for i in range(len(blocks))]}
    del blocks

    # Bitwise needs a repeatable reference: deterministic kernels where the device has them.
    torch.use_deterministic_algorithms(True, warn_only=True)
    reference, again = _grads(base, ids, {}), _grads(base, ids, {})
    with tapesac_core.trace() as blocks:
        result = _grads(ours, ids, plan)
    recorded = len(blocks)
    del blocks
    torch.use_deterministic_algorithms(False)
    noise = _largest_difference(reference, again)
    difference = _largest_difference(reference, result)
    out: dict[str, Any] = {
        "device": args.device,
        "plan": [(e.value if e in unrecorded else len(e)) for e in plan[region]],
        "recorded_blocks": recorded,
        "reference_repeatable": noise == 0,
        "bitwise_equal": difference == 0,
        "largest_difference": difference,
        "reference_noise": noise,
    }
    del reference, again, result

    methods = [
        Method("none", "none", base),
        Method("full", "full", wrap_torch(copy.deepcopy(base), block, early_stop=True)),
        Method("mixed", "tapesac", ours, context=lambda: tapesac_core.use_plan(plan)),
    ]
    rounds = interleaved_rounds(
        methods, ids, device, warmup=2, steps=10 if device.type == "cuda" else 5
    )
    for other in ("none", "full"):
        q1, median, q3 = quartiles([r["mixed"] / r[other] for r in rounds])
        out[f"time_vs_{other}"] = {"median": median, "q1": q1, "q3": q3, "rounds": len(rounds)}
    out["errors"] = {m.name: m.error for m in methods if m.error}
    # Without a repeatable reference, within its own run-to-run noise is what can be asked.
    exact = out["bitwise_equal"] or (not out["reference_repeatable"] and difference <= noise)
    planned = sum(e not in unrecorded for e in plan[region])
    out["ok"] = exact and recorded == planned and not out["errors"]
    return out


def host(args: argparse.Namespace) -> dict[str, Any]:
    """Host (the calling thread's CPU) time per aten op of a forward, by method, and the recorded
    blocks' kernel time per op (node times: CUDA events on GPU, each op alone on CPU); medians of
    interleaved rounds. The frontier's ~1B dense model in bf16 at its sequence length (its tiny
    size on CPU, fp32). A launch queue that fills spins the host, which thread time counts: where
    the GPU is the bottleneck, host time per op reads high, towards kernel time per op."""
    import copy
    import statistics

    import torch

    import tapesac_core
    from benchmarks.baselines import wrap_torch
    from benchmarks.common import rotated
    from benchmarks.host_overhead import count_ops
    from benchmarks.measure import synchronize
    from tapesac_core.measure.timing import seconds

    device = torch.device(args.device)
    base, block, ids = _frontier_model(args, dropout=0.0)
    ours = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(ours, {block})
    recorded = copy.deepcopy(ours)
    methods = {
        "none": (base, contextlib.nullcontext),
        "torch_checkpoint": (
            wrap_torch(copy.deepcopy(base), block, early_stop=True),
            contextlib.nullcontext,
        ),
        "tapesac_recorded": (recorded, lambda: tapesac_core.trace(record=True)),
        "tapesac_steady": (ours, tapesac_core.trace),
    }
    ops = count_ops(lambda: base.loss(ids))
    host_s: dict[str, list[float]] = {name: [] for name in methods}
    paths: dict[str, set[bool]] = {"tapesac_recorded": set(), "tapesac_steady": set()}
    rounds = 10 if device.type == "cuda" else 5
    for r in range(2 + rounds):
        for name in rotated(methods, r):
            model, context = methods[name]
            synchronize(device)
            with context() as blocks:
                start = time.thread_time()
                loss = model.loss(ids)
                spent = time.thread_time() - start
                loss.backward()
            synchronize(device)
            model.zero_grad(set_to_none=True)
            if r >= 2:  # after two warm-up rounds: the steady calls' tapes are cached
                host_s[name].append(spent)
                if name in paths and blocks is not None:
                    paths[name].update(b.steady for b in blocks)
    with tapesac_core.trace(time_nodes=True) as timed:
        copy.deepcopy(recorded).loss(ids).backward()
    node_s = [seconds(t) for b in timed for t in b.forward_times.values()]
    out: dict[str, Any] = {
        "device": args.device,
        "ops_per_forward": ops,
        "block_ops_timed": len(node_s),
        "kernel_us_per_op": 1e6 * sum(node_s) / max(len(node_s), 1),
        "host_us_per_op": {n: 1e6 * statistics.median(t) / ops for n, t in host_s.items()},
        "rounds": rounds,
        "steady_calls_steady": paths["tapesac_steady"] == {True},
        "recorded_calls_recorded": paths["tapesac_recorded"] == {False},
    }
    out["steady_host_bound"] = out["host_us_per_op"]["tapesac_steady"] > out["kernel_us_per_op"]
    out["ok"] = out["steady_calls_steady"] and out["recorded_calls_recorded"] and node_s != []
    return out


def offload(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import torch

    import tapesac_core
    from benchmarks.baselines import wrap_torch
    from benchmarks.common import quartiles
    from benchmarks.measure import interleaved_rounds, live_bytes
    from benchmarks.method import Method
    from tapesac_core.control.controller import PLANNED
    from tapesac_core.plan.offload_choice import Link

    device = torch.device(args.device)
    base, block, ids = _frontier_model(args, dropout=0.0)
    if device.type == "cpu":  # the tiny model's batch alone stays under the 1 MiB a limit needs
        ids = ids.repeat(4, 8)
    ours = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(ours, {block})
    tokens = ids.numel()
    static = live_bytes(device)  # both models' weights: what every step starts with
    with tapesac_core.memory_meter(device) as meter:
        ours.loss(ids).backward()
    ours.zero_grad(set_to_none=True)
    must_only = meter.reading().peak
    limit = int(static + args.fraction * (must_only - static))
    # Every planned step metered (on accelerators they all are: allocator statistics are free).
    metering = {"meter_every": 1} if device.type == "cpu" else {}
    controller = tapesac_core.Controller(
        ours, limit, warmup_steps=1, profile_steps=1, control_steps=1, control_every=0,
        near_limit=1.0, margin=0.0, **metering,
    )  # fmt: skip
    if device.type == "cpu":  # no separate host memory: a link set by hand runs the stage
        controller.solver.link = Link(to_host=1e12, to_device=1e12)
    reports = []
    for _ in range(6):
        with controller.step(tokens=tokens) as report:
            ours.loss(ids).backward()
        ours.zero_grad(set_to_none=True)
        reports.append(report)
    planned = [r for r in reports if r.mode == PLANNED]
    plan = controller.plan
    link = controller.solver.link
    copies = (
        plan.offloaded_bytes / link.to_host + plan.offloaded_bytes / link.to_device
        if plan is not None and link is not None
        else 0.0
    )
    out: dict[str, Any] = {
        "device": args.device,
        "static_bytes": static,
        "must_only_peak": must_only,
        "limit_bytes": limit,
        "link_bytes_per_s": None
        if link is None
        else {
            "to_host": link.to_host,
            "to_device": link.to_device,
            "set_by_hand": device.type == "cpu",
        },
        "offloaded_bytes": plan.offloaded_bytes if plan is not None else None,
        "blocks_offloaded": sum(sum(f) for f in plan.offloading().values()) if plan else None,
        "copy_time_s": plan.copy_time if plan is not None else None,
        "hidden_share_modelled": 1 - plan.copy_time / copies
        if plan is not None and copies
        else None,
        "planned_peaks": [r.peak for r in planned],
        "predicted_peaks": [r.predicted_peak for r in planned],
    }
    pinned = device.type != "cpu"

    def save_on_cpu() -> Any:
        return torch.autograd.graph.save_on_cpu(pin_memory=pinned)

    methods = [
        Method("full_save_on_cpu", "full", wrap_torch(copy.deepcopy(base), block, early_stop=True),
               context=save_on_cpu),
        Method("tapesac", "tapesac", ours, context=lambda: controller.step(tokens=tokens)),
    ]  # fmt: skip
    rounds = interleaved_rounds(methods, ids, device, warmup=1, steps=8 if pinned else 3)
    q1, median, q3 = quartiles([r["full_save_on_cpu"] / r["tapesac"] for r in rounds])
    out["speedup_vs_full_save_on_cpu"] = {
        "median": median,
        "q1": q1,
        "q3": q3,
        "rounds": len(rounds),
    }
    out["errors"] = {m.name: m.error for m in methods if m.error}
    out["ok"] = (
        bool(planned)
        and all(r.peak is not None and r.peak <= limit for r in planned)
        and not out["errors"]
    )
    return out


STAGES = {
    "versions": versions,
    "offload": offload,
    "correctness": correctness,
    "timing": timing,
    "limit": limit,
    "readiness": readiness,
    "mixed": mixed,
    "host": host,
}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_stages", description=__doc__.split("\n")[0]
    )
    p.add_argument("stage", choices=sorted(STAGES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--fraction",
        type=float,
        default=0.7,
        help="offload: the limit, this share of the way from a step's start to must-only's peak",
    )
    args = p.parse_args()
    try:
        result = STAGES[args.stage](args)
    except Exception as e:  # noqa: BLE001
        import traceback

        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
    line = json.dumps({"stage": args.stage, **result}, default=str)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"stage": args.stage, **result}, indent=1, default=str) + "\n"
        )
    sys.exit(0 if result.get("ok") else 1)


if __name__ == "__main__":
    main()
