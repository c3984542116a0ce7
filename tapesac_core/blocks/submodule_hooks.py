"""The hooks that tell a block which submodule issues each op it records and what each submodule
returns (``Block.enter_module``, ``Block.exit_module``), and refuse saved-tensor hooks pushed
inside it.

They are installed on the block's submodules for one call, only where a call needs them: a
recorded call, or a steady-state call that holds values a submodule returns. Any forward hook on a
module sends each of its calls down ``nn.Module``'s slower path, about 70 µs a call of a Qwen3
decoder layer on CPU: installed for good, every steady-state call would pay that for nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._compat import torch_function_disabled
from ..tape.block import Block
from .refusals import refuse_inner_saved_tensor_hooks


@contextmanager
def submodules_tracked(module: torch.nn.Module, block: Block) -> Iterator[None]:
    """``block``'s forward runs with hooks on every submodule of ``module``, removed after."""
    handles = []
    try:
        for name, sub in module.named_modules():
            if sub is not module:
                # First among a submodule's hooks: ops a user's pre-hook runs are named for the
                # submodule, and the exit sees what its forward returned, before a user's hook
                # may replace it (the same in recorded and steady-state calls).
                enter = functools.partial(_entered, block, name)
                handles.append(sub.register_forward_pre_hook(enter, prepend=True))
                exit_ = functools.partial(_exited, block)
                handles.append(sub.register_forward_hook(exit_, prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _entered(block: Block, name: str, module: torch.nn.Module, args: Any) -> None:
    # Another thread calling the same model meanwhile runs these hooks too: not this block's.
    if block.is_running():
        with torch_function_disabled():  # bookkeeping, not the forward's calls (call_checks.py)
            refuse_inner_saved_tensor_hooks(block, name)
            block.enter_module(name)


def _exited(block: Block, module: torch.nn.Module, args: Any, output: Any) -> None:
    if block.is_running():
        with torch_function_disabled():
            block.exit_module(output)
