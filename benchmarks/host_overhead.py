"""Per-op host cost of checkpointing a block, in one process.

Blocks (``--block``):

* ``tiny``          200 elementwise ops on 16 elements: kernels take well under a microsecond,
                    so what is measured is the host (Python, the dispatcher and autograd)
* ``qwen3_layer``   a Hugging Face ``Qwen3DecoderLayer`` (hidden 64, 1 x 32 tokens, called with
                    keyword arguments as the model calls it): real submodules and argument lists,
                    kernels still small next to the host's work

Each runs on one thread, under:

* ``eager``        no checkpointing (the reference every excess is taken against)
* ``noop_mode``    a TorchDispatchMode whose ``__torch_dispatch__`` only calls the op, around the
                   forward (what any Python dispatch mode costs; no recompute)
* ``noop_bare``    the same without the ``torch._disable_dynamo`` wrapper torch puts around
                   ``__torch_dispatch__`` (TapeSAC's Recorder opts out of it too): the floor of a
                   dispatcher-level recorder
* ``torch_ckpt``   ``torch.utils.checkpoint(use_reentrant=False)`` (full checkpointing)
* ``torch_sac``    torch's SAC: ``create_selective_checkpoint_contexts`` with a policy that saves
                   nothing (PREFER_RECOMPUTE for every op)
* ``tapesac_recorded`` ``tapesac_core.checkpoint_module``, no plan (must-only: saves S0 only),
                   every call recorded (``trace(record=True)``: a first call, a profiling or a
                   verification step)
* ``tapesac_steady``   the same from its cached tape (steady state: saved-tensor hooks and the checking mode)

Each round runs ``--reps`` training steps (forward, ``sum``, backward) of every configuration, in
an order rotated per round; a round's value is the median over its steps. Reported per
configuration: µs per op over eager (the same round's eager steps), forward only and whole step,
median and IQR over the rounds; then TapeSAC's excesses over torch checkpoint's, forward and
whole step, in steady state and recorded, and recorded's forward over the no-op mode's (ratios
of the medians).

Ops are the tiny block's 200 elementwise ops, and the Qwen3 layer's aten ops in one forward
(counted by a dispatch mode).

Run: python -m benchmarks.host_overhead [--block tiny|qwen3_layer] [--rounds 35] [--reps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import tapesac_core
from benchmarks.common import BareNoOpMode, NoOpMode, OpCounter, quartiles, rotated

OPS = 200
SIZE = 16


class TinyOps(torch.nn.Module):
    """``OPS`` elementwise ops (sin, mul by a parameter, add, tanh): each saves something for
    backward but ``add``, so backward unpacks (and a checkpoint recomputes) the whole chain."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((SIZE,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(OPS // 4):
            x = (x.sin() * self.w + 1.0).tanh()
        return x


def _save_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class Workload:
    """A block and how the model calls it: ``block(x, **kwargs)``, ``x`` requiring grad."""

    block: torch.nn.Module
    x: torch.Tensor
    kwargs: dict[str, Any]
    ops: int  # aten ops in one forward


def tiny_ops() -> Workload:
    torch.manual_seed(0)
    return Workload(TinyOps(), torch.randn(SIZE, requires_grad=True), {}, OPS)


def qwen3_layer() -> Workload:
    """The first decoder layer of ``steady_state``'s Hugging Face Qwen3 stack at hidden 64, with
    the rotary embeddings and position ids the model passes it."""
    from benchmarks.steady_state import hf_stack

    stack = hf_stack(hidden=64, layers=1)[0].model.model
    layer = stack.layers[0]
    x = torch.randn(1, 32, 64, requires_grad=True)
    position_ids = torch.arange(32)[None]
    with torch.no_grad():
        position_embeddings = stack.rotary_emb(x, position_ids)
    kwargs = {"position_ids": position_ids, "position_embeddings": position_embeddings}
    return Workload(layer, x, kwargs, count_ops(lambda: layer(x, **kwargs)))


BLOCKS = {"tiny": tiny_ops, "qwen3_layer": qwen3_layer}


def count_ops(forward: Callable[[], Any]) -> int:
    """The aten ops ``forward()`` runs."""
    with OpCounter() as counting:
        forward()
    return counting.count


def configurations(work: Workload) -> dict[str, Callable[[torch.Tensor], Any]]:
    """Each configuration's forward of the same block (one copy per configuration)."""
    block, kwargs = work.block, work.kwargs

    def under(mode: type[TorchDispatchMode]) -> Callable[[torch.Tensor], Any]:
        def forward(x: torch.Tensor) -> Any:
            with mode():
                return block(x, **kwargs)

        return forward

    def wrapped(module: torch.nn.Module) -> Callable[[torch.Tensor], Any]:
        return lambda x: module(x, **kwargs)

    sac_context = partial(create_selective_checkpoint_contexts, _save_nothing)
    return {
        "eager": wrapped(block),
        "noop_mode": under(NoOpMode),
        "noop_bare": under(BareNoOpMode),
        "torch_ckpt": lambda x: checkpoint(block, x, use_reentrant=False, **kwargs),
        "torch_sac": lambda x: checkpoint(
            block, x, use_reentrant=False, context_fn=sac_context, **kwargs
        ),
        "tapesac_recorded": recorded(wrapped(tapesac_core.checkpoint_module(copy.deepcopy(block)))),
        "tapesac_steady": wrapped(tapesac_core.checkpoint_module(copy.deepcopy(block))),
    }


def recorded(forward: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``forward`` with every call of its blocks recorded (no steady state)."""

    def run(x: torch.Tensor) -> Any:
        with tapesac_core.trace(record=True):
            return forward(x)

    return run


def timed_step(forward: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple:
    """CPU seconds of the forward and of the whole step (forward, loss, backward).

    The calling thread's CPU time, not wall time: on a shared machine wall time also counts the
    time other processes held the core. With one thread, CPU autograd runs on this thread too.
    """
    start = time.thread_time()
    out = forward(x)
    mid = time.thread_time()
    (out[0] if isinstance(out, tuple) else out).sum().backward()  # older HF layers: a tuple
    end = time.thread_time()
    x.grad = None
    return mid - start, end - start


def measure(
    work: Workload, rounds: int, reps: int, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Per configuration and phase, each round's excess over eager in µs per op."""
    configs = configurations(work)
    names = list(configs)
    x = work.x
    excess: dict[str, dict[str, list[float]]] = {
        name: {"forward": [], "step": []} for name in names
    }
    for r in range(warmup + rounds):
        medians: dict[str, tuple[float, float]] = {}
        for name in rotated(names, r):
            times = [timed_step(configs[name], x) for _ in range(reps)]
            medians[name] = (
                statistics.median(t[0] for t in times),
                statistics.median(t[1] for t in times),
            )
        if r < warmup:
            continue
        for name in names:
            for i, phase in enumerate(("forward", "step")):
                over = medians[name][i] - medians["eager"][i]
                excess[name][phase].append(1e6 * over / work.ops)
    return excess


def report(excess: dict[str, dict[str, list[float]]]) -> str:
    """The table of excesses and the two ratios."""
    lines = [
        f"{'config':<16} {'forward µs/op':>14} {'IQR':>14} {'step µs/op':>12} {'IQR':>14}",
    ]
    median = {n: {p: statistics.median(xs) for p, xs in e.items()} for n, e in excess.items()}
    for name, phases in excess.items():
        row = f"{name:<16}"
        for phase, width in (("forward", 14), ("step", 12)):
            lo, _, hi = quartiles(phases[phase])
            row += f" {median[name][phase]:>{width}.2f} {f'[{lo:.2f}, {hi:.2f}]':>14}"
        lines.append(row)
    for name, phase, base in (
        ("tapesac_steady", "forward", "torch_ckpt"),  # target: at most 1.25
        ("tapesac_steady", "step", "torch_ckpt"),  # target: at most 1.0
        ("tapesac_recorded", "forward", "torch_ckpt"),
        ("tapesac_recorded", "step", "torch_ckpt"),
        ("tapesac_recorded", "forward", "noop_mode"),
    ):
        ratio = median[name][phase] / median[base][phase]
        lines.append(f"ratio {phase} {name}/{base}: {ratio:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_overhead", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--block", choices=sorted(BLOCKS), default="tiny", help="the block")
    parser.add_argument("--rounds", type=int, default=35, help="measured interleaved rounds")
    parser.add_argument("--reps", type=int, default=10, help="steps per configuration per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = BLOCKS[args.block]()
    print(
        f"host overhead: {args.block} block, {work.ops} aten ops a forward, torch "
        f"{torch.__version__}, 1 thread, {args.rounds} rounds x {args.reps} steps; µs per op "
        "over eager, median [IQR] over rounds"
    )
    print(report(measure(work, args.rounds, args.reps)))


if __name__ == "__main__":
    main()
