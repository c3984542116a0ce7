"""How a checkpointed module runs as a block: the ``BlockConfig`` wrapping leaves on it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tape.verify import HiddenWrites


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """How a module is checkpointed: its region type, once known its path in the model, and the
    hidden writes verifying steps found in its model's blocks (shared by the blocks of one
    ``checkpoint_modules`` call)."""

    region: str
    path: str | None = None
    hidden_writes: HiddenWrites = field(default_factory=HiddenWrites, compare=False, repr=False)
    deterministic_ops: frozenset[str] = frozenset()  # custom ops declared not to draw numbers
    # The Hugging Face caches its training calls were given and left out of (``hf_cache.py``):
    # one given again came back from an earlier call, emptied.
    emptied_caches: weakref.WeakSet[Any] = field(
        default_factory=weakref.WeakSet, compare=False, repr=False
    )
    # Its blocks that ran under autocast with the weight cache on, while autograd holds them
    # (until their backward): a later call among them shared the casts without checkpointing.
    autocast_calls: weakref.WeakSet[Any] = field(
        default_factory=weakref.WeakSet, compare=False, repr=False
    )


def block_config(module: torch.nn.Module) -> BlockConfig | None:
    """How ``module`` is checkpointed (its region type and path), or None: not a TapeSAC block."""
    return getattr(module, "_tapesac", None)
