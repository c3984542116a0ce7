"""TapeSAC core: tensor-level record and replay of checkpointed blocks, and the planner."""

from .block import BlockTrace
from .checkpoint import (
    BlockConfig,
    checkpoint,
    checkpoint_module,
    checkpoint_modules,
    record,
    trace,
    use_plan,
)
from .config import MemoryLimit, TapeSACConfig, parse_memory_limit
from .controller import Controller, StepReport
from .errors import TapeSACError
from .kernels import register_kernel
from .memory import MemoryReading, memory_meter, profile_memory
from .plan.plan import Plan
from .tape import Coord, Tape

__all__ = [
    "BlockConfig",
    "BlockTrace",
    "Controller",
    "Coord",
    "MemoryLimit",
    "MemoryReading",
    "Plan",
    "StepReport",
    "Tape",
    "TapeSACConfig",
    "TapeSACError",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_modules",
    "memory_meter",
    "parse_memory_limit",
    "profile_memory",
    "record",
    "register_kernel",
    "trace",
    "use_plan",
]
