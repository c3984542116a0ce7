"""TapeSAC integrations for Lightning and Accelerate."""

from .callback import TapeSACCallback
from .strategy import TapeSACFSDPStrategy

__all__ = ["TapeSACCallback", "TapeSACFSDPStrategy"]
