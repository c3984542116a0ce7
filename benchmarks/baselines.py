"""The methods users would choose instead of TapeSAC's planner: no checkpointing,
torch.utils.checkpoint (early_stop on and off), torchtitan's op-level policy and "save the
attention output" under torch's SAC and under TapeSAC replay, torch.compile's memory budgets."""

from __future__ import annotations

import copy
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import tapesac_core
from benchmarks.method import Method

# torchtitan's op-level SAC save list (torchtitan/distributed/activation_checkpoint.py), plus
# the SDPA kernels torch picks on CPU and with cuDNN, which the list names on its own devices.
SDPA = tuple(
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
        *SDPA,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)
ATTENTION_SAVE = frozenset(SDPA)
POLICIES = {"tt": "torchtitan op-level policy", "attn": "save attention output"}


# ---------------------------------------------------------------------- policies


def torchtitan_saves(op: Any, mm_count: int) -> bool:
    """torchtitan's rule: save the listed ops, except every second mm of a block."""
    return op in TORCHTITAN_SAVE and not (op == torch.ops.aten.mm.default and mm_count % 2 == 0)


def torchtitan_policy(meta: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    """torchtitan's ``_custom_policy``, its mm counts kept in ``meta``."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = torchtitan_saves(func, meta[key])
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def attention_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the attention kernel's outputs; recompute everything else."""
    return (
        CheckpointPolicy.MUST_SAVE if func in ATTENTION_SAVE else CheckpointPolicy.PREFER_RECOMPUTE
    )


def torchtitan_contexts() -> Any:
    """torch SAC's contexts for one checkpointed call, its mm counts starting at zero."""
    return create_selective_checkpoint_contexts(torchtitan_policy(defaultdict(int)))


def attention_contexts() -> Any:
    return create_selective_checkpoint_contexts(attention_policy)


def policy_coordinates(tape: tapesac_core.Tape, which: str) -> frozenset:
    """The same saved set as TapeSAC coordinates: the policy run over the block's recorded ops."""
    mm = 0
    coords = set()
    for node in tape.nodes:
        if node.op == torch.ops.aten.mm.default:
            mm += 1
        save = torchtitan_saves(node.op, mm) if which == "tt" else node.op in ATTENTION_SAVE
        if save:
            coords.update((node.name, node.k, j) for j in range(len(node.outs) - len(node.extra)))
    return frozenset(coords)


# ---------------------------------------------------------------------- wrappers


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
    source = "def run(block, *args, **kwargs):\n    return block.eager_forward(*args, **kwargs)\n"
    exec(compile(source, f"<frontier compile budget {budget}>", "exec"), namespace)
    compiled = torch.compile(namespace["run"], backend=backend)
    for _, _, child in blocks_of(model, block):
        child.eager_forward = child.forward  # what the compiled function runs
        child.forward = types.MethodType(lambda self, *a, **k: compiled(self, *a, **k), child)
    return model


# ---------------------------------------------------------------------- methods

# name, family, early_stop, SAC contexts, note: every block under torch's checkpoint.
TORCH_CHECKPOINTS = (
    ("full", "full", True, None, "checkpoint(use_reentrant=False), early_stop=True (default)"),
    (
        "full_no_stop",
        "full",
        False,
        None,
        "checkpoint(use_reentrant=False, early_stop=False) (torchtitan's setting)",
    ),
    (
        "tt_torch",
        "torch_sac",
        False,
        torchtitan_contexts,
        "torchtitan op-level SAC under torch (early_stop=False, as torchtitan)",
    ),
    (
        "attn_torch",
        "torch_sac",
        False,
        attention_contexts,
        "save attention output under torch SAC (early_stop=False)",
    ),
)


def baseline_methods(
    base: torch.nn.Module, block: type, budgets: Sequence[float], backend: str, families: set[str]
) -> list[Method]:
    """The methods of ``families`` that run without TapeSAC, each on its own copy of ``base``."""
    methods = [Method("none", "none", copy.deepcopy(base))] if "none" in families else []
    for name, family, early_stop, contexts, note in TORCH_CHECKPOINTS:
        if family in families:
            model = wrap_torch(copy.deepcopy(base), block, early_stop, contexts)
            methods.append(Method(name, family, model, note=note))
    if "compile" in families:
        methods += [compile_method(base, block, b, backend) for b in budgets]
    return methods


def compile_method(base: torch.nn.Module, block: type, budget: float, backend: str) -> Method:
    """torch.compile per block under ``activation_memory_budget``; a backend that fails to
    compile is a row with its error."""
    name = f"compile@{budget:g}"
    note = f"torch.compile(backend={backend!r}) per block, activation_memory_budget={budget:g}"
    try:
        model = wrap_compile(copy.deepcopy(base), block, budget, backend)
    except Exception as e:  # noqa: BLE001  (an unknown backend fails here)
        error = f"torch.compile: {type(e).__name__}: {e}"[:2000]
        return Method(name, "compile", base, note=note, error=error)
    setup = partial(
        torch._functorch.config.patch,
        activation_memory_budget=budget,
        enable_autograd_cache=False,
    )
    # Every step under the budget's patch: a recompilation keeps the budget.
    return Method(name, "compile", model, context=setup, setup=setup, note=note)


def policy_replay_methods(
    tape: tapesac_core.Tape, model: torch.nn.Module, region: str
) -> list[Method]:
    """The hand-written policies' saved sets as TapeSAC coordinates (named on ``tape``, a
    recorded block), replayed by TapeSAC on a copy each of ``model``'s blocks of ``region``.

    Each TapeSAC row runs its own copy of the model, as a training run does: a block caches the
    tapes of a few signatures, its plan entry among them, and twenty rows sharing one model
    would evict each other's every step, so that every call recorded."""
    methods = []
    for which, label in POLICIES.items():
        plan = {region: policy_coordinates(tape, which)}
        methods.append(
            Method(
                f"{which}_tapesac",
                "tapesac_policy",
                copy.deepcopy(model),
                context=partial(tapesac_core.use_plan, plan),
                plan=plan,
                note=f"{label}'s saved set as TapeSAC coordinates, replayed",
            )
        )
    return methods
