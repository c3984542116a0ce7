"""TapeSAC core: tensor-level record and replay of checkpointed blocks, and the planner."""

from .block import BlockTrace
from .checkpoint import (BlockConfig, checkpoint, checkpoint_module, checkpoint_modules, record,
                         trace, use_plan)
from .errors import TapeSACError
from .tape import Coord, Tape

__all__ = ["BlockConfig", "BlockTrace", "Coord", "Tape", "TapeSACError", "checkpoint",
           "checkpoint_module", "checkpoint_modules", "record", "trace", "use_plan"]
