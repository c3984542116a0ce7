"""TapeSAC core: tensor-level record and replay of checkpointed blocks, and the planner.

The public names load on first use (PEP 562), so that ``tapesac_core.plan`` imports without torch
(the planner is pure Python) and ``import tapesac_core`` costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # What __getattr__ loads, spelled out for type checkers: keep in step with _EXPORTS.
    from .blocks.block_settings import BlockConfig, block_config
    from .blocks.plan_scope import use_plan
    from .blocks.running import checkpoint, record
    from .blocks.trace_scope import trace
    from .blocks.wrapping import checkpoint_module, checkpoint_modules, restore_modules
    from .config import MemoryLimit, TapeSACConfig, parse_memory_limit
    from .control.controller import Controller
    from .control.step_report import StepMode, StepReport
    from .errors import TapeSACError
    from .measure.memory import MemoryReading, memory_meter, profile_memory
    from .plan.plan import Plan
    from .tape.block import PLAIN, TORCH_CHECKPOINT, BlockTrace
    from .tape.kernels import register_kernel
    from .tape.tape import Coord, Tape

# The module each public name comes from.
_EXPORTS = {
    ".tape.block": ("BlockTrace", "PLAIN", "TORCH_CHECKPOINT"),
    ".blocks.block_settings": ("BlockConfig", "block_config"),
    ".config": ("MemoryLimit", "TapeSACConfig", "parse_memory_limit"),
    ".control.controller": ("Controller",),
    ".errors": ("TapeSACError",),
    ".tape.kernels": ("register_kernel",),
    ".measure.memory": ("MemoryReading", "memory_meter", "profile_memory"),
    ".plan.plan": ("Plan",),
    ".blocks.plan_scope": ("use_plan",),
    ".blocks.running": ("checkpoint", "record"),
    ".control.step_report": ("StepMode", "StepReport"),
    ".tape.tape": ("Coord", "Tape"),
    ".blocks.trace_scope": ("trace",),
    ".blocks.wrapping": ("checkpoint_module", "checkpoint_modules", "restore_modules"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "BlockConfig",
    "BlockTrace",
    "Controller",
    "Coord",
    "MemoryLimit",
    "MemoryReading",
    "PLAIN",
    "Plan",
    "StepMode",
    "StepReport",
    "Tape",
    "TapeSACConfig",
    "TapeSACError",
    "TORCH_CHECKPOINT",
    "block_config",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_modules",
    "memory_meter",
    "parse_memory_limit",
    "profile_memory",
    "record",
    "register_kernel",
    "restore_modules",
    "trace",
    "use_plan",
]


def __getattr__(name: str) -> Any:
    """A public name from its module, else a submodule (``tapesac_core.tape.replay``), as the eager
    imports made every submodule an attribute."""
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
