"""Setups a block cannot run in, each refused with a ``TapeSACError`` naming the fix: a block
inside a block and ``fully_shard`` on a module inside one (when a module is wrapped, and again at
its forward), torch.utils.checkpoint around a block or saved-tensor hooks inside one, Hugging
Face's checkpointing flag on a block, and a reentrant checkpoint inside one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._compat import saved_tensors_hooks_on_top
from ..errors import TapeSACError
from ..tape.block import Block
from ..tape.recompute import Recompute
from ..tape.recorder import Recorder
from ..tape.steady import SteadyForward
from .block_settings import block_config


def refuse_outer_torch_checkpoint(name: str) -> None:
    """torch.utils.checkpoint (non-reentrant) installs saved-tensor hooks around what it wraps."""
    hooks = saved_tensors_hooks_on_top()
    if hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint":
        raise TapeSACError(
            f"block {name!r} runs inside torch.utils.checkpoint. Fix: remove the outer "
            "checkpoint; TapeSAC already checkpoints this block"
        )


def refuse_hf_checkpointing(module: torch.nn.Module, name: str) -> None:
    """Hugging Face's ``GradientCheckpointingLayer`` runs its checkpoint function inside its own
    forward while its ``gradient_checkpointing`` flag is on: autograd would hand every saved
    tensor to torch's hooks, not TapeSAC's, and the block would save and replay nothing."""
    if module.training and getattr(module, "gradient_checkpointing", False) is True:
        raise TapeSACError(
            f"block {name!r} has Hugging Face activation checkpointing on (its "
            "gradient_checkpointing flag): torch.utils.checkpoint would run inside the TapeSAC "
            "block, which would then save and replay nothing. Fix: turn it off, "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
            "transformers 5), or gradient_checkpointing=False in the Trainer's arguments; "
            "TapeSAC replaces it"
        )


def hf_layer_forward(module: torch.nn.Module, fn: Any) -> bool:
    """``fn`` (bound to ``module``) is what a ``GradientCheckpointingLayer`` hands its
    checkpoint function, TapeSAC's here: the forward it wraps (transformers 5) or
    ``nn.Module.__call__`` under its own ``__call__`` (transformers 4). Neither runs the
    layer's checkpointing again, so its flag being on is no reason to refuse."""
    method = getattr(fn, "__func__", None)
    if method is None:
        return False
    cls = type(module)
    wrapped = getattr(cls.forward, "__wrapped__", None)
    own_call = cls.__call__ is not torch.nn.Module.__call__
    return method is wrapped or (own_call and method is torch.nn.Module.__call__)


# The pack hooks of the calls whose submodules are hooked (``submodule_hooks.py``).
_OWN_PACK_HOOKS = (Recorder.pack, SteadyForward.pack, Recompute.pack)


def refuse_inner_saved_tensor_hooks(block: Block, submodule: str) -> None:
    """Saved-tensor hooks pushed inside a block (torch.utils.checkpoint or a wrapper of it,
    activation offloading) take every tensor autograd saves there away from the tape's pack
    hook: the block would silently save and replay nothing of it. Checked as each submodule is
    entered in a call whose submodules are hooked; a steady-state call without hooks sees fewer
    saved tensors than its tape (a divergence) and records its next call, which refuses."""
    hooks = saved_tensors_hooks_on_top()
    if hooks is None or getattr(hooks[0], "__func__", None) in _OWN_PACK_HOOKS:
        return
    origin = getattr(hooks[0], "__module__", "") or ""
    what = (
        "torch.utils.checkpoint (or a wrapper of it, e.g. checkpoint_wrapper)"
        if origin == "torch.utils.checkpoint"
        else f"saved-tensor hooks of {origin or 'unknown origin'} (e.g. save_on_cpu offloading)"
    )
    raise TapeSACError(
        f"{what} runs inside TapeSAC block {block.name!r} (around {block.name}.{submodule}): "
        "autograd would hand the tensors it saves there to those hooks, and TapeSAC would save "
        "and replay nothing of them. Fix: remove that checkpoint (or hooks) inside the block; "
        "TapeSAC already checkpoints it"
    )


def refuse_reentrant_checkpoint_inside(name: str, autograd: Sequence[str] | None) -> None:
    """A reentrant checkpoint inside a block (``autograd``: the kinds of the autograd nodes its
    recorded forward made, ``steady.autograd_nodes``): its forward runs under no_grad, where no
    saved-tensor hook shows it, and its backward runs its part of the block again, outside the
    tape. Seen in the graph of a recorded call; where that graph reaches tensors made before the
    block that are not its inputs, the walk may give up first (None: not checked)."""
    if autograd is not None and _REENTRANT_NODE in autograd:
        raise TapeSACError(
            f"a reentrant checkpoint (torch.utils.checkpoint(use_reentrant=True)) runs inside "
            f"TapeSAC block {name!r}: it would run its part of the block again in backward. "
            "Fix: remove that checkpoint; TapeSAC already checkpoints the block"
        )


# The autograd node of torch.utils.checkpoint(use_reentrant=True) (and DeepSpeed's checkpoint).
_REENTRANT_NODE = "CheckpointFunctionBackward"


def refuse_wrapping(module: torch.nn.Module, name: str) -> None:
    """Every reason ``module`` cannot become a block, as an error naming the fix."""
    _refuse_nesting(module, name)
    refuse_sharded_inside(module, name)


def _refuse_nesting(module: torch.nn.Module, name: str) -> None:
    """A checkpointed module inside ``module``, or ``module`` inside one: an error naming both."""
    outer = getattr(module, "_tapesac_inside", None)
    if outer is not None:
        raise TapeSACError(
            f"cannot checkpoint {name!r}: it lies inside {outer!r}, which is "
            "already checkpointed (a block inside a block). Fix: checkpoint only "
            "one of them"
        )
    inner = next(
        (
            f"{name}.{sub_name}"
            for sub_name, sub in module.named_modules()
            if sub is not module and block_config(sub) is not None
        ),
        None,
    )
    if inner is not None:
        raise TapeSACError(
            f"cannot checkpoint {name!r}: it contains {inner!r}, which is already "
            "checkpointed (a block inside a block). Fix: checkpoint only one of them"
        )


def refuse_sharded_inside(
    module: torch.nn.Module, name: str, submodules: Sequence[torch.nn.Module] | None = None
) -> None:
    """``fully_shard`` on a module inside a block: an error naming it (FSDP would gather and free
    its parameters inside the block's forward, which replay cannot repeat). ``submodules``:
    ``list(module.modules())`` where the caller has it (every call of a block checks)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    inside = module.modules() if submodules is None else submodules
    if not any(isinstance(sub, FSDPModule) for sub in inside if sub is not module):
        return
    inner = next(
        (
            f"{name}.{sub_name}"
            for sub_name, sub in module.named_modules()
            if sub is not module and isinstance(sub, FSDPModule)
        ),
        None,
    )
    if inner is not None:
        raise TapeSACError(
            f"block {name!r} contains {inner!r}, sharded by fully_shard on its own: "
            "FSDP gathers and frees its parameters inside the block, which replay "
            "cannot repeat. Fix: apply fully_shard to the block (or a module "
            "around it), not to modules inside it"
        )
