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

Run: python benchmarks/frontier.py [--size tiny|example|small|1b] [--model dense|moe|qwen3]
     [--steps 10] [--warmup 2] [--compile-backend inductor] [--out-dir benchmarks/results]
     [--markdown benchmarks/RESULTS.md] [--grow 3]   (or: tapesac bench ...)
Writes benchmarks/results/frontier_<model>_<size>.json (and _growth_), two PNG plots, and its
section of the markdown file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode, flop_registry

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tapesac_core  # noqa: E402
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer  # noqa: E402
from tapesac_core.controller import PLANNED, Controller  # noqa: E402
from tapesac_core.figures import method_frontier_figure, normalised_frontier_figure  # noqa: E402
from tapesac_core.memory import profile_memory  # noqa: E402
from tapesac_core.units import MiB  # noqa: E402

SIZES = {
    # model shape; seq; batch
    "tiny": (
        dict(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
        ),
        32,
        2,
    ),
    "small": (
        dict(
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            intermediate_size=768,
            moe_intermediate_size=256,
        ),
        256,
        2,
    ),
    # The examples' training jobs (examples/train_lightning.py): hidden 128, batch 4 x 256.
    "example": (
        dict(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=256,
            moe_intermediate_size=128,
        ),
        256,
        4,
    ),
    # Qwen3-style, about 1.0B parameters (16 layers of 54M, 32K vocabulary): for one GPU.
    "1b": (
        dict(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=1536,
            vocab_size=32768,
        ),
        2048,
        2,
    ),
}
BUDGETS = (0.0, 0.1, 0.3, 0.5, 0.8)
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
TITLE = (
    "# TapeSAC against every baseline: the memory-time frontier\n\n"
    "Sections between the `frontier` HTML comment markers are written by `benchmarks/frontier.py` "
    "(`tapesac bench`); the rest is written by hand.\n"
)
FAMILIES = ("none", "full", "torch_sac", "tapesac_policy", "compile", "tapesac")

# torchtitan's op-level SAC save list (torchtitan/distributed/activation_checkpoint.py), plus
# the SDPA kernels torch picks on CPU and with cuDNN, which the list names on its own devices.
_SDPA = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)
TORCHTITAN_SAVE = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.max.default,
        *_SDPA,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)
ATTENTION_SAVE = frozenset(_SDPA)


# ---------------------------------------------------------------------- policies


def torchtitan_policy(meta: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    """torchtitan's ``_custom_policy``: save the list, except every second mm of a block."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in TORCHTITAN_SAVE and not (
            func == torch.ops.aten.mm.default and meta[key] % 2 == 0
        )
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def attention_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the attention kernel's outputs; recompute everything else."""
    return (
        CheckpointPolicy.MUST_SAVE if func in ATTENTION_SAVE else CheckpointPolicy.PREFER_RECOMPUTE
    )


def policy_coordinates(tape: tapesac_core.Tape, which: str) -> frozenset:
    """The same saved set as TapeSAC coordinates: the policy run over the block's recorded ops."""
    mm = 0
    coords = set()
    for node in tape.nodes:
        if node.op == torch.ops.aten.mm.default:
            mm += 1
        if which == "tt":
            save = node.op in TORCHTITAN_SAVE and not (
                node.op == torch.ops.aten.mm.default and mm % 2 == 0
            )
        else:
            save = node.op in ATTENTION_SAVE
        if save:
            coords.update((node.name, node.k, j) for j in range(len(node.outs) - len(node.extra)))
    return frozenset(coords)


# ---------------------------------------------------------------------- models


def build_model(kind: str, size: str, dropout: float) -> tuple[torch.nn.Module, type, int, int]:
    """The model, its block class, sequence length and batch size."""
    shape, seq, batch = SIZES[size]
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        config = Qwen3Config(
            vocab_size=shape.get("vocab_size", 256),
            hidden_size=shape["hidden_size"],
            intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["num_layers"],
            num_attention_heads=shape["num_heads"],
            num_key_value_heads=shape["num_kv_heads"],
            head_dim=shape["head_dim"],
            max_position_embeddings=max(seq, 128),
            attention_dropout=dropout,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        return HFCausalLM(Qwen3ForCausalLM(config)), Qwen3DecoderLayer, seq, batch
    torch.manual_seed(0)
    config = ModelConfig(dropout=dropout, moe=kind == "moe", num_experts=4, top_k=2, **shape)
    return DecoderLM(config), (MoEDecoderLayer if config.moe else DecoderLayer), seq, batch


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM with the example models' ``loss(ids)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = model.config.vocab_size

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def blocks_of(
    model: torch.nn.Module, block: type
) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, block) for each block, so a wrapper can replace it."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, block):
                found.append((parent, name, child))
    return found


def wrap_torch(
    model: torch.nn.Module,
    block: type,
    early_stop: bool,
    context_fn: Callable[[], Any] | None = None,
) -> torch.nn.Module:
    """Each block in torch's non-reentrant checkpoint (with a SAC context when given)."""
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    for parent, name, child in blocks_of(model, block):
        setattr(
            parent,
            name,
            checkpoint_wrapper(
                child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, early_stop=early_stop, **kwargs
            ),
        )
    return model


def wrap_compile(
    model: torch.nn.Module, block: type, budget: float, backend: str
) -> torch.nn.Module:
    """Each block's forward through one torch.compile'd function of its own code object (the
    compile cache is per code object, so each budget compiles its own graphs)."""
    namespace: dict[str, Any] = {}
    source = "def run(block, *args, **kwargs):\n    return block._eager_forward(*args, **kwargs)\n"
    exec(compile(source, f"<frontier compile budget {budget}>", "exec"), namespace)
    compiled = torch.compile(namespace["run"], backend=backend)
    for _, _, child in blocks_of(model, block):
        child._eager_forward = child.forward
        child.forward = types.MethodType(lambda self, *a, **k: compiled(self, *a, **k), child)
    return model


# ---------------------------------------------------------------------- methods


@dataclasses.dataclass
class Method:
    name: str
    family: str
    model: torch.nn.Module
    context: Callable[[], Any] = nullcontext
    setup: Callable[[], Any] = nullcontext  # context for the first (warm-up) step: compile here
    note: str = ""
    error: str | None = None
    limit: int | None = None  # TapeSAC planned: the limit, in bytes above those live at step start
    plan: Any = None
    peak: int | None = None
    backward_flops: int | None = None
    forward_flops: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)

    def step(self, ids: torch.Tensor) -> None:
        self.model.zero_grad(set_to_none=True)
        with self.context():
            self.model.loss(ids).backward()
        self.model.zero_grad(set_to_none=True)


def baseline_methods(
    base: torch.nn.Module, block: type, budgets: Sequence[float], backend: str, families: set[str]
) -> list[Method]:
    methods = []
    add = lambda m: methods.append(m) if m.family in families else None  # noqa: E731
    add(Method("none", "none", copy.deepcopy(base)))
    add(
        Method(
            "full",
            "full",
            wrap_torch(copy.deepcopy(base), block, True),
            note="checkpoint(use_reentrant=False), early_stop=True (default)",
        )
    )
    add(
        Method(
            "full_no_stop",
            "full",
            wrap_torch(copy.deepcopy(base), block, False),
            note="checkpoint(use_reentrant=False, early_stop=False) (torchtitan's setting)",
        )
    )
    tt = lambda: create_selective_checkpoint_contexts(torchtitan_policy(defaultdict(int)))  # noqa: E731
    add(
        Method(
            "tt_torch",
            "torch_sac",
            wrap_torch(copy.deepcopy(base), block, False, tt),
            note="torchtitan op-level SAC under torch (early_stop=False, as torchtitan)",
        )
    )
    attn = partial(create_selective_checkpoint_contexts, attention_policy)
    add(
        Method(
            "attn_torch",
            "torch_sac",
            wrap_torch(copy.deepcopy(base), block, False, attn),
            note="save attention output under torch SAC (early_stop=False)",
        )
    )
    if "compile" in families:
        for b in budgets:
            note = f"torch.compile(backend={backend!r}) per block, activation_memory_budget={b:g}"
            try:
                model = wrap_compile(copy.deepcopy(base), block, b, backend)
            except Exception as e:  # noqa: BLE001  (an unknown backend fails here)
                methods.append(
                    Method(
                        f"compile@{b:g}",
                        "compile",
                        base,
                        note=note,
                        error=f"torch.compile: {type(e).__name__}: {e}"[:2000],
                    )
                )
                continue
            setup = partial(
                torch._functorch.config.patch,
                activation_memory_budget=b,
                enable_autograd_cache=False,
            )
            # Every step under the budget's patch: a recompilation keeps the budget.
            methods.append(
                Method(f"compile@{b:g}", "compile", model, context=setup, setup=setup, note=note)
            )
    return methods


# ---------------------------------------------------------------------- measurements


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_peak(method: Method, ids: torch.Tensor, device: torch.device) -> int:
    """Bytes above those live at the step's start, at the step's peak (exact)."""
    method.model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cpu":
        _, mem = profile_memory(lambda: method.step(ids))
        return mem.peak
    synchronize(device)
    start = torch.accelerator.memory_allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    method.step(ids)
    synchronize(device)
    return torch.accelerator.max_memory_allocated(device) - start


class AttentionFlops(TorchDispatchMode):
    """FLOPs of SDPA kernels FlopCounterMode has no formula for (on CPU), from shapes:
    forward 4·B·H·Sq·Sk·D (two matmuls), backward 2.5 times that (as FlopCounterMode's)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        name = func.__name__
        if "scaled_dot_product" in name and func._overloadpacket not in flop_registry:
            q, k = args[0], args[1]
            if "backward" in name:
                q, k = args[1], args[2]
            b, h, sq, d = q.shape
            forward = 4 * b * h * sq * k.shape[-2] * d
            self.flops += int(2.5 * forward) if "backward" in name else forward
        return func(*args, **(kwargs or {}))


def measure_flops(method: Method, ids: torch.Tensor) -> tuple[int, int]:
    """Forward and backward FLOPs of one step (attention added from shapes where uncounted);
    forward FLOPs are not counted for compiled models."""
    model = method.model
    model.zero_grad(set_to_none=True)
    with method.context():
        if method.family == "compile":
            # A dispatch mode around a compiled forward would make dynamo compile it again.
            loss, forward = model.loss(ids), None
        else:
            with FlopCounterMode(display=False) as fwd, AttentionFlops() as fwd_attn:
                loss = model.loss(ids)
            forward = fwd.get_total_flops() + fwd_attn.flops
        with FlopCounterMode(display=False) as bwd, AttentionFlops() as bwd_attn:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, bwd.get_total_flops() + bwd_attn.flops


def timed(method: Method, ids: torch.Tensor, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    method.step(ids)
    synchronize(device)
    return time.perf_counter() - start


def run_safely(method: Method, what: str, fn: Callable[[], Any]) -> Any:
    """A failure of torch.compile is a result row; of anything else, a crash."""
    if method.error is not None:
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        if method.family != "compile":
            raise
        method.error = f"{what}: {type(e).__name__}: {e}".strip()[:2000]
        print(f"[{method.name}] failed at {what}: {type(e).__name__}", file=sys.stderr, flush=True)
        return None


# ---------------------------------------------------------------------- TapeSAC plans


def plan_tapesac(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: Callable[[int], dict[str, int]],
    max_set_size: int = 12,
) -> tuple[dict[str, tuple[int, Any]], dict[str, Any]]:
    """Plans by TapeSAC's Controller: a probe controller with no effective limit profiles the
    model (warm-up, profiling, one planned step: its plan saves everything worth saving), then
    the same controller solves the bucket again under each limit of ``targets(everything)``, a
    name -> bytes above those live at the step's start; the controller's limit is that plus the
    live bytes it measured at the step's start. Margin 0, so the limit is the baseline's measured
    peak itself (the controller's fragmentation and near-limit checks stay)."""
    controller = Controller(
        model,
        "1TiB",
        warmup_steps=1,
        profile_steps=2,
        control_steps=1,
        control_every=0,
        margin=0.0,
        max_set_size=max_set_size,
    )
    for _ in range(8):
        with controller.step(tokens=ids.numel()) as report:
            model.zero_grad(set_to_none=True)
            model.loss(ids).backward()
            model.zero_grad(set_to_none=True)
        if report.mode == PLANNED:
            break
    if report.mode != PLANNED:
        raise RuntimeError("the probe controller never planned")
    tokens = report.tokens
    static = controller.memory.samples[-1].static
    everything = report.plan.saved_bytes
    info = {
        "must_only_peak_model": report.plan.base - static,
        "everything_worth_saving": everything,
        "static_bytes_at_planning": static,
        "must_only_base_at_batch": controller.memory.base(ids.numel()),
    }
    plans = {}
    for name, limit in targets(everything).items():
        controller.replan(memory_limit=max(limit + static, MiB))
        plans[name] = (limit, controller.plan_for(tokens))
    return plans, info


def figure9_targets(methods: list[Method], shares: Sequence[float]) -> dict[str, int]:
    """Limits at Figure 9's extra-memory shares: ``full``'s measured peak plus ``x`` of the gap to
    ``none``'s, named ``tapesac@fig9=x`` (the paper reads its curve at 10%)."""
    peak = {m.name: m.peak for m in methods}
    if peak.get("full") is None or peak.get("none") is None:
        return {}
    return {
        f"tapesac@fig9={x:g}": int(peak["full"] + x * (peak["none"] - peak["full"])) for x in shares
    }


def coords_key(plan: Any) -> str:
    return json.dumps(
        {
            r: [sorted(map(list, b)) for b in blocks]
            for r, blocks in sorted(plan.coordinates().items())
        }
    )


# ---------------------------------------------------------------------- the run


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def tapesac_copy(
    base: torch.nn.Module, block: type, ids: torch.Tensor
) -> tuple[torch.nn.Module, Any]:
    """A copy of ``base`` with TapeSAC on ``block``, and the tape of its first block on ``ids``
    (what the hand-written policies name their saved values on)."""
    model = copy.deepcopy(base)
    tapesac_core.checkpoint_modules(model, {block})
    with tapesac_core.trace() as traced:
        model.loss(ids).backward()
    model.zero_grad(set_to_none=True)
    return model, traced[0].tape


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    families = set(args.families.split(",")) if args.families else set(FAMILIES)
    started = time.perf_counter()
    base, block, seq, batch = build_model(args.model, args.size, args.dropout)
    seq, batch = args.seq or seq, args.batch or batch
    base = base.to(device=device, dtype=dtype)
    params = sum(p.numel() for p in base.parameters())
    vocab = getattr(base, "vocab_size", None) or base.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    print(
        f"[frontier] {args.model} {args.size}: {params / 1e6:.2f}M parameters, batch {batch} x "
        f"seq {seq}, {device} {args.dtype}",
        file=sys.stderr,
        flush=True,
    )

    methods = baseline_methods(base, block, args.budgets, args.compile_backend, families)
    tapesac_model, tape = tapesac_copy(base, block, ids)
    region = block.__name__
    ours: list[Method] = []
    if "tapesac_policy" in families:
        for which, label in (
            ("tt", "torchtitan op-level policy"),
            ("attn", "save attention output"),
        ):
            plan = {region: policy_coordinates(tape, which)}
            ours.append(
                Method(
                    f"{which}_tapesac",
                    "tapesac_policy",
                    tapesac_model,
                    context=partial(tapesac_core.use_plan, plan),
                    plan=plan,
                    note=f"{label}'s saved set as TapeSAC coordinates, replayed",
                )
            )
    if "tapesac" in families:
        ours.append(Method("tapesac_must", "tapesac", tapesac_model, note="TapeSAC, S0 only"))
    methods += ours

    # Warm-up (compiles here, under each budget's config patch) and exact peaks.
    for m in methods:
        print(f"[frontier] warm-up {m.name}", file=sys.stderr, flush=True)
        run_safely(m, "compile/warm-up", partial(_warm, m, ids))
    for m in methods:
        m.peak = run_safely(m, "peak", lambda: measure_peak(m, ids, device))

    # TapeSAC planned: a sweep of limits, and each baseline's measured peak (equal memory).
    plan_info: dict[str, Any] = {}
    if "tapesac" in families:
        must = next(m for m in methods if m.name == "tapesac_must")

        def targets(everything: int) -> dict[str, int]:
            named = {f"tapesac@{f:g}": int(must.peak + f * everything) for f in args.fractions}
            named |= figure9_targets(methods, args.fig9_shares)
            # Every other method's peak, below TapeSAC's must-only one too: the peak-aware model
            # can plan below it (saving removes replay temporaries), else the row says must-only.
            return named | {
                f"tapesac={m.name}": m.peak
                for m in methods
                if m.family != "tapesac" and m.peak is not None
            }

        plans, plan_info = plan_tapesac(
            copy.deepcopy(tapesac_model), ids, targets, args.max_set_size
        )
        seen: dict[str, Method] = {}
        for name, (limit, plan) in sorted(plans.items(), key=lambda kv: kv[1][0]):
            key = coords_key(plan)
            if key in seen:
                seen[key].note += f"; also the plan at {name}"
                continue
            m = Method(
                name,
                "tapesac",
                tapesac_model,
                context=partial(tapesac_core.use_plan, plan),
                limit=limit,
                plan=plan,
                note=f"Controller plan: saves {plan.saved_bytes} B beyond S0, predicted "
                f"{plan.predicted_speedup:.3f}x vs must-only",
            )
            seen[key] = m
            m.peak = measure_peak(m, ids, device)
            methods.append(m)

    for m in methods:
        flops = run_safely(m, "flops", lambda: measure_flops(m, ids))
        if flops is not None:
            m.forward_flops, m.backward_flops = flops

    # Interleaved timing: one step of every method per round, order rotated per round.
    live = [m for m in methods if m.error is None]
    rounds: list[dict[str, float]] = []
    for r in range(args.warmup + args.steps):
        order = live[r % len(live) :] + live[: r % len(live)]
        times = {}
        for m in order:
            t = run_safely(m, "timing", lambda: timed(m, ids, device))
            if t is not None:
                times[m.name] = t
        if r >= args.warmup:
            rounds.append(times)
            for name, t in times.items():
                next(m for m in methods if m.name == name).times.append(t)

    result = {
        "command": args.command,
        "machine": machine(device),
        "commit": git_commit(),
        "model": args.model,
        "size": args.size,
        "max_set_size": args.max_set_size,
        "parameters": params,
        "seq": seq,
        "batch": batch,
        "dtype": args.dtype,
        "dropout": args.dropout,
        "device": str(device),
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "compile_backend": args.compile_backend,
        "compile_interleaved": True,
        "tapesac_planning": plan_info,
        "rows": rows(
            methods,
            rounds,
            plan_info.get("static_bytes_at_planning", 0),
            plan_info.get("must_only_base_at_batch"),
        ),
        "wall_s": time.perf_counter() - started,
    }
    return result


def _warm(m: Method, ids: torch.Tensor) -> None:
    with m.setup():
        m.step(ids)
        m.step(ids)


def rows(
    methods: list[Method], rounds: list[dict[str, float]], static: int = 0, base: int | None = None
) -> list[dict[str, Any]]:
    """One row per method, with Figure 9 shares against full checkpointing (``full``); a planned
    row's predicted peak is the Controller's above ``static``, the bytes live at the step's start
    when it planned: its memory model's (scaled from the bucket's upper edge to this batch, whose
    must-only peak it models as ``base``), or Eq. 8's must-only peak + saved bytes."""
    by = {m.name: m for m in methods}
    none, full = by.get("none"), by.get("full")
    out = []
    for m in methods:
        row: dict[str, Any] = {
            "method": m.name,
            "family": m.family,
            "note": m.note,
            "error": m.error,
            "peak_bytes": m.peak,
            "limit_bytes": m.limit,
            "forward_flops": m.forward_flops,
            "backward_flops": m.backward_flops,
        }
        if m.plan is not None and hasattr(m.plan, "saved_bytes"):
            row["plan_saved_bytes"] = m.plan.saved_bytes
            row["plan_predicted_speedup"] = m.plan.predicted_speedup
            predicted = m.plan.peak_at_tokens(base) if m.plan.predicted_peak and base else 0
            row["plan_predicted_peak_bytes"] = (
                predicted or m.plan.base + m.plan.saved_bytes
            ) - static
        if m.times:
            q1, med, q3 = quartiles(m.times)
            row |= {
                "median_s": med,
                "q1_s": q1,
                "q3_s": q3,
                "min_s": min(m.times),
                "max_s": max(m.times),
                "n": len(m.times),
            }
        if none is not None and m.backward_flops is not None and none.backward_flops is not None:
            row["recomputed_flops"] = m.backward_flops - none.backward_flops
        if (
            none is not None
            and full is not None
            and None not in (m.peak, none.peak, full.peak)
            and m.error is None
        ):
            extra = none.peak - full.peak
            row["memory_share"] = (m.peak - full.peak) / extra if extra else None
            full_re = (full.backward_flops or 0) - (none.backward_flops or 0)
            if "recomputed_flops" in row and full_re > 0:
                row["flop_share"] = (full_re - row["recomputed_flops"]) / full_re
            per_round = [
                (r["full"] - r[m.name]) / (r["full"] - r["none"])
                for r in rounds
                if m.name in r and "full" in r and "none" in r and r["full"] != r["none"]
            ]
            if per_round:
                q1, med, q3 = quartiles(per_round)
                row |= {"time_share": med, "time_share_q1": q1, "time_share_q3": q3}
        out.append(row)
    return out


# ---------------------------------------------------------------------- batch growth


def live_bytes(device: torch.device) -> int:
    """Bytes live now: what a Controller's absolute limit counts besides the step's own."""
    if device.type != "cpu":
        synchronize(device)
        return torch.accelerator.memory_allocated(device)
    from tapesac_core.memory import LiveTensorMeter

    with LiveTensorMeter() as meter:
        pass
    return meter.reading().current


def run_growth(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-written policies, full checkpointing and TapeSAC at one fixed limit, the batch
    grown ``args.grow`` times: the limit lies between TapeSAC must-only's and torchtitan policy's
    measured peaks at the grown batch (``--grow-limit`` of the way; every method fits at the base
    batch when the limit is above its peak there): each method's peak against the limit, at both
    batches, and TapeSAC's Controller, which
    profiles again when tokens grow past its reprofile factor and plans again under the same
    limit; its re-planned step against must-only (interleaved rounds)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    started = time.perf_counter()
    base, block, seq, batch = build_model(args.model, args.size, args.dropout)
    seq, batch = args.seq or seq, args.batch or batch
    base = base.to(device=device, dtype=dtype)
    vocab = getattr(base, "vocab_size", None) or base.config.vocab_size

    def make(b: int) -> torch.Tensor:
        return torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(b)).to(
            device
        )

    small, grown = make(batch), make(batch * args.grow)
    methods = baseline_methods(base, block, (), args.compile_backend, {"full", "torch_sac"})
    tapesac_model, tape = tapesac_copy(base, block, small)
    region = block.__name__
    for which in ("tt", "attn"):
        plan = {region: policy_coordinates(tape, which)}
        methods.append(
            Method(
                f"{which}_tapesac",
                "tapesac_policy",
                tapesac_model,
                context=partial(tapesac_core.use_plan, plan),
                note=f"{which} policy's saved set, TapeSAC replay",
            )
        )
    methods.append(Method("tapesac_must", "tapesac", tapesac_model, note="TapeSAC, S0 only"))
    for m in methods:
        _warm(m, small)
    at_base = {m.name: measure_peak(m, small, device) for m in methods}
    for m in methods:
        _warm(m, grown)
    at_grown = {m.name: measure_peak(m, grown, device) for m in methods}
    low, high = at_grown["tapesac_must"], at_grown["tt_torch"]
    limit = int(low + args.grow_limit * (high - low))

    # One Controller, fixed limit, through the base batch and then the grown one.
    model = copy.deepcopy(tapesac_model)
    static = live_bytes(device)
    controller = Controller(
        model,
        max(static + limit, MiB),
        warmup_steps=1,
        profile_steps=2,
        control_steps=1,
        control_every=0,
        margin=0.0,
    )
    history = []
    plans = {}
    for label, ids in (("base", small), ("grown", grown)):
        for _ in range(12):
            with controller.step(tokens=ids.numel()) as report:
                model.zero_grad(set_to_none=True)
                model.loss(ids).backward()
                model.zero_grad(set_to_none=True)
            history.append({"batch": label, "mode": report.mode, "tokens": ids.numel()})
            if report.mode == PLANNED:
                plans[label] = report.plan
                break
    base_plan, grown_plan = plans.get("base"), plans.get("grown")
    if grown_plan is not None:
        methods.append(
            Method(
                "tapesac_replanned",
                "tapesac",
                tapesac_model,
                context=partial(tapesac_core.use_plan, grown_plan),
                plan=grown_plan,
                note="the Controller's plan after the batch grew (profiled again)",
            )
        )
    if base_plan is not None:
        methods.append(
            Method(
                "tapesac_base_plan",
                "tapesac",
                tapesac_model,
                context=partial(tapesac_core.use_plan, base_plan),
                plan=base_plan,
                note="the base batch's plan kept (values over a block's bytes are replayed)",
            )
        )
    for m in methods:
        if m.name in at_grown:
            m.peak = at_grown[m.name]
        else:
            _warm(m, grown)
            m.peak = measure_peak(m, grown, device)
    rounds = []
    for r in range(args.warmup + args.steps):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        times = {m.name: timed(m, grown, device) for m in order}
        if r >= args.warmup:
            rounds.append(times)
            for m in methods:
                m.times.append(times[m.name])
    rows_ = []
    for m in methods:
        q1, med, q3 = quartiles(m.times)
        rows_.append(
            {
                "method": m.name,
                "family": m.family,
                "note": m.note,
                "peak_base_bytes": at_base.get(m.name),
                "peak_grown_bytes": m.peak,
                "over_limit_bytes": max(0, m.peak - limit),
                "median_s": med,
                "q1_s": q1,
                "q3_s": q3,
                "plan_saved_bytes": getattr(m.plan, "saved_bytes", None),
                "plan_predicted_speedup": getattr(m.plan, "predicted_speedup", None),
            }
        )
    must = [r["tapesac_must"] for r in rounds]
    out: dict[str, Any] = {
        "command": args.command,
        "machine": machine(device),
        "commit": git_commit(),
        "model": args.model,
        "size": args.size,
        "seq": seq,
        "batch": batch,
        "grow": args.grow,
        "limit_bytes": limit,
        "limit_from": f"TapeSAC must-only's measured peak at the grown batch + {args.grow_limit:g} x "
        "(torchtitan policy's - must-only's) there",
        "controller_history": history,
        "rows": rows_,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "device": str(device),
    }
    if grown_plan is not None:
        ratios = [a / r["tapesac_replanned"] for a, r in zip(must, rounds)]
        q1, med, q3 = quartiles(ratios)
        out["replanned_speedup"] = {
            "median_of_ratios": med,
            "q1": q1,
            "q3": q3,
            "ratio_of_medians": statistics.median(must)
            / statistics.median([r["tapesac_replanned"] for r in rounds]),
            "predicted": grown_plan.predicted_speedup,
        }
    out["wall_s"] = time.perf_counter() - started
    return out


def growth_section(g: dict[str, Any]) -> str:
    lines = [
        f"## Batch growth x{g['grow']}: {g['model']} model, size {g['size']}",
        "",
        f"Command: `{g['command']}`  ",
        f"Limit: {_mib(g['limit_bytes'])} MiB ({g['limit_from']}), batch {g['batch']} -> "
        f"{g['batch'] * g['grow']} x seq {g['seq']}; {g['steps']} measured interleaved rounds "
        f"after {g['warmup']} warm-up at the grown batch. Controller steps: "
        + ", ".join(f"{h['batch']}:{h['mode']}" for h in g["controller_history"])
        + ".",
        "",
        "| method | peak at base batch MiB | peak at grown batch MiB | over the limit at grown batch MiB "
        "| median step ms at grown batch (IQR) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        over = r["over_limit_bytes"]
        lines.append(
            f"| {r['method']} | {_mib(r['peak_base_bytes'])} | {_mib(r['peak_grown_bytes'])} "
            f"| {'**' + _mib(over) + '**' if over else '0 (fits)'} "
            f"| {1e3 * r['median_s']:.1f} ({1e3 * r['q1_s']:.1f}-{1e3 * r['q3_s']:.1f}) "
            f"| {_cell(r['note'])} |"
        )
    s = g.get("replanned_speedup")
    if s:
        lines += [
            "",
            f"TapeSAC re-planned vs must-only at the grown batch: measured "
            f"{s['ratio_of_medians']:.3f}x (ratio of medians; per-round median {s['median_of_ratios']:.3f}, "
            f"IQR {s['q1']:.3f}-{s['q3']:.3f}), predicted {s['predicted']:.3f}x.",
        ]
    else:
        lines += ["", "The Controller did not reach a planned step at the grown batch."]
    return "\n".join(lines) + "\n"


def machine(device: torch.device) -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        info["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    import os

    info["cpus"] = os.cpu_count()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # The outputs this harness writes are not code: only changes elsewhere make a run unrepeatable.
    code = git(
        "status",
        "--porcelain",
        "--",
        "tapesac_core",
        "benchmarks",
        ":!benchmarks/results",
        ":!benchmarks/RESULTS.md",
    )
    return commit + (" + local changes" if code else "")


# ---------------------------------------------------------------------- report


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(result: dict[str, Any]) -> str:
    lines = [
        "| method | peak MiB | limit MiB (predicted peak) | median step ms (IQR) | recomputed GFLOP "
        "| extra memory (Fig. 9) | recompute eliminated, FLOPs | recompute eliminated, time (IQR) "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["peak_bytes"] is None, r["peak_bytes"] or 0)):
        if r["error"]:
            lines.append(
                f"| {r['method']} | - | - | failed | - | - | - | - | "
                f"{r['note']}; **{_cell(r['error'][:300])}** |"
            )
            continue
        t = (
            f"{1e3 * r['median_s']:.1f} ({1e3 * r['q1_s']:.1f}-{1e3 * r['q3_s']:.1f})"
            if "median_s" in r
            else "-"
        )
        ts = (
            f"{_pct(r['time_share'])} ({_pct(r['time_share_q1'])} to {_pct(r['time_share_q3'])})"
            if "time_share" in r
            else "-"
        )
        re = f"{r['recomputed_flops'] / 1e9:.4g}" if r.get("recomputed_flops") is not None else "-"
        limit = _mib(r["limit_bytes"]) + (
            f" ({_mib(r['plan_predicted_peak_bytes'])})"
            if r.get("plan_predicted_peak_bytes") is not None
            else ""
        )
        lines.append(
            f"| {r['method']} | {_mib(r['peak_bytes'])} | {limit} | {t} | {re} "
            f"| {_pct(r.get('memory_share'))} | {_pct(r.get('flop_share'))} | {ts} | {_cell(r['note'])} |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def comparisons(result: dict[str, Any]) -> list[str]:
    """For every baseline, the TapeSAC rows at equal or lower measured peak: the one recomputing
    the fewest FLOPs and the fastest by median time, each against the baseline; no point hidden."""
    rows_ = [r for r in result["rows"] if not r["error"] and "median_s" in r]
    ours = [r for r in rows_ if r["family"] == "tapesac"]
    out = []
    for b in rows_:
        if b["family"] in ("tapesac", "none"):
            continue
        fit = [r for r in ours if r["peak_bytes"] <= b["peak_bytes"]]
        head = (
            f"- **{b['method']}** ({_mib(b['peak_bytes'])} MiB, "
            f"{_gflop(b.get('recomputed_flops'))} GFLOP recomputed, {1e3 * b['median_s']:.1f} ms): "
        )
        if not fit:
            out.append(
                head + "**no TapeSAC row at equal or lower peak** (TapeSAC's lowest measured "
                f"peak is {_mib(min(r['peak_bytes'] for r in ours)) if ours else '-'} MiB)."
            )
            continue
        fewest = min(fit, key=lambda r: (r.get("recomputed_flops") or 0, r["median_s"]))
        fastest = min(fit, key=lambda r: r["median_s"])
        fb, fo = b.get("recomputed_flops") or 0, fewest.get("recomputed_flops") or 0
        flop = "ahead" if fo < fb else ("level" if fo == fb else "**behind**")
        ratio = b["median_s"] / fastest["median_s"]
        overlap = fastest["q1_s"] <= b["q3_s"] and b["q1_s"] <= fastest["q3_s"]
        timing = ("ahead" if ratio > 1 else "**behind**") + (" (IQRs overlap)" if overlap else "")
        out.append(
            head + f"by FLOPs {flop}: {fewest['method']} recomputes {_gflop(fo)} GFLOP at "
            f"{_mib(fewest['peak_bytes'])} MiB; by time {timing}: {fastest['method']} "
            f"{1e3 * fastest['median_s']:.1f} ms at {_mib(fastest['peak_bytes'])} MiB "
            f"(baseline / TapeSAC = {ratio:.3f})."
        )
    return out


def _gflop(flops: int | None) -> str:
    return "-" if flops is None else f"{flops / 1e9:.4g}"


def write_outputs(result: dict[str, Any], out_dir: Path, markdown: Path | None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"frontier_{'_'.join(run_name(result))}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    ok = [
        r
        for r in result["rows"]
        if not r["error"] and "median_s" in r and r["peak_bytes"] is not None
    ]
    points = [
        {
            "label": r["method"],
            "family": r["family"],
            "peak": r["peak_bytes"],
            "seconds": r["median_s"],
            "q1": r["q1_s"],
            "q3": r["q3_s"],
        }
        for r in ok
    ]
    title = f"{result['model']} {result['size']}, batch {result['batch']} x seq {result['seq']}"
    time_png = out_dir / f"{stem}_time_vs_memory.png"
    method_frontier_figure(points, title=f"Step time vs peak memory: {title}").savefig(time_png)
    norm = [
        {
            "label": r["method"],
            "family": r["family"],
            "memory_share": r["memory_share"],
            "flop_share": r.get("flop_share"),
            "time_share": r.get("time_share"),
            "time_q1": r.get("time_share_q1"),
            "time_q3": r.get("time_share_q3"),
        }
        for r in ok
        if r.get("memory_share") is not None
    ]
    norm_png = out_dir / f"{stem}_normalised.png"
    normalised_frontier_figure(norm, title=f"Normalised frontier (Figure 9): {title}").savefig(
        norm_png
    )
    paths = {"json": json_path, "time_png": time_png, "norm_png": norm_png}
    if markdown is not None:
        section = markdown_section(result, paths, markdown.parent)
        update_markdown(markdown, ":".join(run_name(result)), section)
        paths["markdown"] = markdown
    return paths


def run_name(result: dict[str, Any]) -> tuple[str, ...]:
    """Model and size, and the save-set cap when it is not the default (its own files and section)."""
    cap = result.get("max_set_size", 12)
    return (result["model"], result["size"]) + (() if cap == 12 else (f"set{cap}",))


def update_markdown(path: Path, key: str, section: str) -> None:
    """Replace this run's section (between its markers) in ``path``, or append it; everything
    outside the markers (the title, hand-written analysis, other runs' sections) is kept."""
    begin, end = f"<!-- frontier {key} -->", f"<!-- /frontier {key} -->"
    text = path.read_text() if path.exists() else TITLE
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def markdown_section(result: dict[str, Any], paths: dict[str, Path], base: Path) -> str:
    rel = {
        k: Path(p).resolve().relative_to(base.resolve())
        if Path(p).resolve().is_relative_to(base.resolve())
        else p
        for k, p in paths.items()
    }
    m = result["machine"]
    plan = result.get("tapesac_planning", {})
    lines = [
        f"## Frontier: {result['model']} model, size {result['size']}"
        + (
            f", TapeSAC's max_set_size {result['max_set_size']}"
            if len(run_name(result)) > 2
            else ""
        ),
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m.get('cpu')} ({m.get('cpus')} CPUs), {m.get('platform')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}{', GPU ' + m['gpu'] if 'gpu' in m else ''}; "
        f"{result['threads']} torch thread(s); commit {result['commit']}; wall {result['wall_s']:.0f} s.  ",
        f"Model: {result['parameters'] / 1e6:.2f}M parameters, batch {result['batch']} x seq {result['seq']}, "
        f"{result['dtype']}, dropout {result['dropout']}, on {result['device']}. Step = forward + loss + "
        f"backward (no optimizer; the same for every method).  ",
        f"Timing: {result['steps']} measured rounds after {result['warmup']} warm-up rounds; each round runs "
        "one step of every method, order rotated per round (torch.compile rows included: "
        "each budget compiled under a config patch in this process, so they are interleaved too).",
        "",
        "Peak: bytes above those live at the step's start (torch profiler's allocation events on "
        "CPU, exact; allocator peak on GPU). Recomputed FLOPs: backward FLOPs (FlopCounterMode, plus "
        "SDPA from shapes where FlopCounterMode has no formula, as on CPU) minus those of `none`. "
        "Figure 9 shares against `full`: extra memory = (peak − full's) / (none's − full's); "
        "recompute eliminated = (full's recomputation − this one's) / full's, from FLOPs and from "
        "time (per round: (t_full − t) / (t_full − t_none); median and IQR over rounds).",
        "",
        f"TapeSAC planning: the Controller (margin 0) profiled the model; must-only peak modelled "
        f"{_mib(plan.get('must_only_peak_model'))} MiB, everything worth saving "
        f"{_mib(plan.get('everything_worth_saving'))} MiB. `tapesac@f`: limit = must-only peak + f × "
        "everything; `tapesac@fig9=x`: limit = `full`'s measured peak + x × (`none`'s − `full`'s), "
        "Figure 9's extra-memory share x; `tapesac=X`: limit = X's measured peak. Rows whose plan is identical to an "
        "earlier one are merged (see notes).",
        "",
        table(result),
        "",
        "### TapeSAC against each baseline at equal or lower measured peak",
        "",
        *comparisons(result),
        "",
        f"![step time vs peak memory]({rel['time_png']})",
        "",
        f"![normalised frontier]({rel['norm_png']})",
        "",
        f"Raw data: `{rel['json']}`.",
        "",
    ]
    return "\n".join(lines)


def parser(prog: str = "frontier.py") -> argparse.ArgumentParser:
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
    argv: Sequence[str] | None = None, prog: str = "python benchmarks/frontier.py"
) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    args.command = " ".join([prog, *map(shlex.quote, argv)])
    if args.grow:
        g = run_growth(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"frontier_growth_{args.model}_{args.size}.json"
        path.write_text(json.dumps(g, indent=1, default=str) + "\n")
        section = growth_section(g)
        if args.markdown is not None:
            update_markdown(args.markdown, f"growth:{args.model}:{args.size}", section)
        print(section)
        return g
    result = run(args)
    paths = write_outputs(result, args.out_dir, args.markdown)
    print(table(result))
    print("\n".join(comparisons(result)))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
