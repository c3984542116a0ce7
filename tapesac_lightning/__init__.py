"""TapeSAC integrations for Lightning and Accelerate."""

from .accelerate import TapeSACAccelerator, TapeSACPlugin
from .callback import TapeSACCallback
from .strategy import TapeSACFSDPStrategy

__all__ = ["TapeSACAccelerator", "TapeSACCallback", "TapeSACFSDPStrategy", "TapeSACPlugin"]
