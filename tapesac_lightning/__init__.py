"""TapeSAC integrations for Lightning and Accelerate."""

from .callback import TapeSACCallback
from .strategy import TapeSACFSDPStrategy
from .accelerate import TapeSACAccelerator, TapeSACPlugin

__all__ = ["TapeSACAccelerator", "TapeSACCallback", "TapeSACFSDPStrategy", "TapeSACPlugin"]
