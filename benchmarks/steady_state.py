"""Must-only TapeSAC in steady state against torch's full checkpoint, interleaved in one process.

For one model, four ways of running the same training step (forward, loss, backward), each on a
copy of the same weights:

* ``none``              no checkpointing
* ``full``              every block under ``torch.utils.checkpoint(use_reentrant=False)``
* ``tapesac_recorded``  TapeSAC must-only, every block recorded (``trace(record=True)``: what a
                        first call, a profiling or a verification step costs)
* ``tapesac_steady``    TapeSAC must-only from the cached tapes (steady state, saved-tensor hooks
                        only)

Each round runs ``--reps`` steps of every method, in an order rotated per round; a round's value
is the median of its steps (the calling thread's CPU time, one torch thread). Reported: each
method's median step and IQR over rounds, the per-round ratios against ``full`` (median, IQR,
rounds), recomputed FLOPs (a step's FLOPs over ``none``'s, ``FlopCounterMode``) and exact step
peaks (torch's profiler, ``profile_memory=True``).

Models: the frontier harness's (``--model dense|moe|qwen3 --size small|example``), or Hugging
Face stacks of 4 layers: ``Qwen3ForCausalLM`` (``--model hf_stack --hidden 128``, 4 x 256
tokens), ``GPT2LMHeadModel`` (``--model hf_gpt2 --dropout 0.1``, 4 x 256 tokens) or
``Qwen3MoeForCausalLM`` with eager experts, 16 top-2 (``--model hf_qwen3_moe``, 4 x 128 tokens).

With stock ATen ops must-only and ``full`` run the same kernels: autograd saves an ATen op's
inputs before its kernel runs, so torch's ``early_stop`` ends the recomputation inside the last
GEMM's call, before the GEMM. ``--down function`` makes each MLP's down projection an
``autograd.Function`` (as TransformerEngine's or an FP8 linear), whose ``save_for_backward``
comes after its GEMM: torch's recomputation runs that GEMM and discards it, replay does not
(the paper's Table 4). TapeSAC's blocks call it as a registered kernel (``register_kernel``),
declared deterministic.

``--planned`` adds ``tapesac_planned``: TapeSAC under a Controller with its default settings at
``full``'s measured step peak (its control and verification steps count among its steps).

Run: python -m benchmarks.steady_state --model hf_stack --hidden 256 [--rounds 20] [--reps 3]
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

import tapesac_core
from benchmarks.baselines import wrap_torch
from benchmarks.common import quartiles, rotated
from benchmarks.measure import live_bytes
from benchmarks.workload import HFCausalLM, build_model

METHODS = ("none", "full", "tapesac_recorded", "tapesac_steady")
LINEAR_OP = "tapesac_bench::linear"


class LinearFunction(torch.autograd.Function):
    """``x @ w.T``, saving ``x`` and ``w`` after the GEMM (as a fused or FP8 linear does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x @ w.t()
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, (grad.flatten(0, -2).t() @ x.flatten(0, -2))


@functools.cache  # op names are per process: registered once
def _linear_kernel() -> Callable[..., torch.Tensor]:
    """``LinearFunction`` as a registered kernel, with its GEMM's FLOPs for
    ``FlopCounterMode``, which does not look inside a custom op."""
    kernel = tapesac_core.register_kernel(
        LINEAR_OP,
        LinearFunction,
        schema="(Tensor x, Tensor w) -> Tensor",
        fake=lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]),
    )
    namespace, name = LINEAR_OP.split("::")
    register_flop_formula(getattr(getattr(torch.ops, namespace), name))(_linear_flops)
    return kernel


def _linear_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * math.prod(x_shape) * w_shape[0]


class FunctionLinear(torch.nn.Module):
    """A bias-free linear layer run by ``LinearFunction``: ``.apply``, or the registered kernel."""

    def __init__(self, linear: torch.nn.Linear, registered: bool) -> None:
        super().__init__()
        self.weight = linear.weight
        self.call = _linear_kernel() if registered else LinearFunction.apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x, self.weight)


def with_function_down(model: torch.nn.Module, registered: bool) -> torch.nn.Module:
    """``model`` with every ``mlp.down_proj`` a ``FunctionLinear`` (in place)."""
    for module in list(model.modules()):
        down = getattr(module, "down_proj", None)
        if isinstance(down, torch.nn.Linear) and down.bias is None:
            module.down_proj = FunctionLinear(down, registered)
    return model


def _qwen3_shape(hidden: int, layers: int) -> dict[str, int]:
    """The Qwen3 stacks' shape: heads of 32, half as many key-value heads, an MLP 3x wide."""
    heads = max(2, hidden // 32)
    return {
        "vocab_size": 1024,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }


def hf_stack(
    hidden: int, layers: int = 4, dropout: float = 0.0
) -> tuple[torch.nn.Module, type, int, int]:
    """A Hugging Face Qwen3 stack: ``layers`` decoder layers at ``hidden``, 4 x 256 tokens,
    ``dropout`` on the attention weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    config = Qwen3Config(
        **_qwen3_shape(hidden, layers),
        attn_implementation="sdpa",
        attention_dropout=dropout,
    )
    torch.manual_seed(0)
    return HFCausalLM(Qwen3ForCausalLM(config)), Qwen3DecoderLayer, 256, 4


def hf_gpt2(hidden: int, layers: int = 4, dropout: float = 0.1) -> tuple:
    """A Hugging Face GPT-2 stack: ``layers`` blocks at ``hidden``, 4 x 256 tokens, ``dropout``
    on the embeddings, attention weights and residuals (GPT-2's three)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        vocab_size=1024,
        n_embd=hidden,
        n_layer=layers,
        n_head=max(2, hidden // 32),
        n_positions=256,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    torch.manual_seed(0)
    return HFCausalLM(GPT2LMHeadModel(config)), GPT2Block, 256, 4


def hf_qwen3_moe(hidden: int, layers: int = 4, experts: str = "eager") -> tuple:
    """A Hugging Face Qwen3-MoE stack with ``experts`` experts (``eager``: a loop over the
    experts hit; ``grouped_mm``: one grouped GEMM): ``layers`` layers at ``hidden``, 16 experts
    top-2, 4 x 128 tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    config = Qwen3MoeConfig(
        **_qwen3_shape(hidden, layers),
        moe_intermediate_size=hidden,
        num_experts=16,
        num_experts_per_tok=2,
        attn_implementation="sdpa",
        experts_implementation=experts,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.train()
    return HFCausalLM(model), Qwen3MoeDecoderLayer, 128, 4


def methods(
    base: torch.nn.Module, block: type, function_down: bool = False
) -> dict[str, tuple[torch.nn.Module, Callable[[], Any]]]:
    """Each method's model copy and the context its steps run in (``function_down``: each MLP's
    down projection an ``autograd.Function``, registered for TapeSAC)."""

    def copied(registered: bool) -> torch.nn.Module:
        model = copy.deepcopy(base)
        return with_function_down(model, registered) if function_down else model

    tapesac = copied(registered=True)
    deterministic = (LINEAR_OP,) if function_down else ()
    tapesac_core.checkpoint_modules(tapesac, {block}, deterministic_ops=deterministic)
    recorded = copy.deepcopy(tapesac)
    return {
        "none": (copied(registered=False), nullcontext),
        "full": (wrap_torch(copied(registered=False), block, early_stop=True), nullcontext),
        "tapesac_recorded": (recorded, lambda: tapesac_core.trace(record=True)),
        "tapesac_steady": (tapesac, nullcontext),
    }


def with_planned(
    runs: dict[str, tuple[torch.nn.Module, Callable[[], Any]]], ids: torch.Tensor
) -> dict[str, tuple[torch.nn.Module, Callable[[], Any]]]:
    """``runs`` and ``tapesac_planned`` (``planned``)."""
    model, controller = planned(runs, ids)
    return {
        **runs,
        "tapesac_planned": (model, functools.partial(controller.step, tokens=ids.numel())),
    }


def planned(
    runs: dict[str, tuple[torch.nn.Module, Callable[[], Any]]], ids: torch.Tensor
) -> tuple[torch.nn.Module, tapesac_core.Controller]:
    """A copy of the steady model driven by a Controller with default settings at ``full``'s
    measured step peak (CPU), stepped on ``ids`` until it runs planned steps."""
    full, _ = runs["full"]
    model = copy.deepcopy(runs["tapesac_steady"][0])
    # Absolute, as a Controller counts: what lives now (every copy's weights) and full's step.
    peak = tapesac_core.profile_memory(lambda: step(full, nullcontext, ids))[1].peak
    limit = live_bytes(torch.device("cpu")) + peak
    controller = tapesac_core.Controller(model, limit)
    context = functools.partial(controller.step, tokens=ids.numel())
    for _ in range(64):
        step(model, context, ids)
        if (
            controller.report is not None
            and controller.report.mode == tapesac_core.StepMode.PLANNED
        ):
            break
    return model, controller


def step(model: torch.nn.Module, context: Callable[[], Any], ids: torch.Tensor) -> float:
    """One step's CPU seconds on this thread (with one thread, CPU autograd runs here too)."""
    start = time.thread_time()
    with context():
        model.loss(ids).backward()
    seconds = time.thread_time() - start
    model.zero_grad(set_to_none=True)
    return seconds


def flops(model: torch.nn.Module, context: Callable[[], Any], ids: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter, context():
        model.loss(ids).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def measure(
    runs: dict[str, tuple[torch.nn.Module, Callable[[], Any]]],
    ids: torch.Tensor,
    rounds: int,
    reps: int,
) -> dict[str, list[float]]:
    """Per method, each round's median step seconds (methods interleaved, order rotated)."""
    names = list(runs)
    for model, context in runs.values():  # warm up, and fill TapeSAC's tape caches
        for _ in range(2):
            step(model, context, ids)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            model, context = runs[name]
            out[name].append(statistics.median(step(model, context, ids) for _ in range(reps)))
    return out


def report(
    title: str,
    times: dict[str, list[float]],
    flop: dict[str, int],
    peaks: dict[str, int],
) -> str:
    rounds = len(times["full"])
    lines = [
        title,
        f"{'method':<18} {'step ms':>9} {'IQR':>17} {'recomputed GFLOP':>17} {'peak MiB':>9}",
    ]
    for name, ts in times.items():
        lo, _, hi = quartiles([1e3 * t for t in ts])
        recomputed = (flop[name] - flop["none"]) / 1e9
        lines.append(
            f"{name:<18} {1e3 * statistics.median(ts):>9.2f} {f'[{lo:.2f}, {hi:.2f}]':>17} "
            f"{recomputed:>17.3f} {peaks[name] / 2**20:>9.2f}"
        )
    for name in ("tapesac_steady", "tapesac_recorded", "tapesac_planned", "none"):
        if name not in times:
            continue
        ratios = [a / b for a, b in zip(times[name], times["full"])]
        lo, _, hi = quartiles(ratios)
        lines.append(
            f"{name} / full per round: {statistics.median(ratios):.3f} "
            f"(IQR {lo:.3f}-{hi:.3f}, {rounds} rounds)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.steady_state", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model",
        default="hf_stack",
        choices=["hf_stack", "hf_gpt2", "hf_qwen3_moe", "dense", "moe", "qwen3"],
    )
    parser.add_argument("--size", default="small", help="the harness's size (not for hf_stack)")
    parser.add_argument("--hidden", type=int, default=128, help="hf_stack's hidden size")
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="dropout (blocks with random ops)"
    )
    parser.add_argument(
        "--down",
        default="linear",
        choices=["linear", "function"],
        help="each MLP's down projection: nn.Linear, or an autograd.Function saving after its GEMM",
    )
    parser.add_argument(
        "--planned",
        action="store_true",
        help="also TapeSAC under a Controller (defaults) at full's measured peak",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model == "hf_stack":
        base, block, seq, batch = hf_stack(args.hidden, dropout=args.dropout)
        title = f"HF Qwen3ForCausalLM, 4 layers, hidden {args.hidden}, {batch}x{seq} tokens"
    elif args.model == "hf_gpt2":
        base, block, seq, batch = hf_gpt2(args.hidden, dropout=args.dropout)
        title = f"HF GPT2LMHeadModel, 4 layers, hidden {args.hidden}, {batch}x{seq} tokens"
    elif args.model == "hf_qwen3_moe":
        base, block, seq, batch = hf_qwen3_moe(args.hidden)
        title = (
            f"HF Qwen3MoeForCausalLM (eager experts, 16 top-2), 4 layers, hidden {args.hidden}, "
            f"{batch}x{seq} tokens"
        )
    else:
        base, block, seq, batch = build_model(args.model, args.size, args.dropout)
        title = f"{args.model} {args.size}, {batch}x{seq} tokens"
    title += f", dropout {args.dropout}" if args.dropout else ""
    title += ", down projection an autograd.Function" if args.down == "function" else ""
    vocab = getattr(base, "vocab_size", None) or base.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    runs = methods(base, block, function_down=args.down == "function")
    if args.planned:
        runs = with_planned(runs, ids)
    times = measure(runs, ids, args.rounds, args.reps)
    flop = {n: flops(m, c, ids) for n, (m, c) in runs.items()}
    peaks = {
        n: tapesac_core.profile_memory(lambda m=m, c=c: step(m, c, ids))[1].peak
        for n, (m, c) in runs.items()
    }
    print(f"{title}; torch {torch.__version__}, 1 thread, {args.rounds} rounds x {args.reps} steps")
    print(report(title, times, flop, peaks))


if __name__ == "__main__":
    main()
