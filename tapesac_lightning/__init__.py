"""TapeSAC integrations for Lightning, Accelerate and Hugging Face's Trainer.

Each integration imports its library when first used (PEP 562), so either works without the other
installed and ``tapesac report`` needs neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # What __getattr__ loads, spelled out for type checkers: keep in step with _EXPORTS.
    from .accelerate import TapeSACAccelerator, TapeSACPlugin
    from .hf_trainer import TapeSACTrainerCallback
    from .lightning_callback import TapeSACCallback
    from .lightning_strategy import TapeSACFSDPStrategy

# Public name: its module, the extra that installs what it needs, and those libraries (an extra
# named after its library needs no list).
_EXPORTS = {
    "TapeSACAccelerator": (".accelerate", "accelerate"),
    "TapeSACPlugin": (".accelerate", "accelerate"),
    "TapeSACCallback": (".lightning_callback", "lightning"),
    "TapeSACFSDPStrategy": (".lightning_strategy", "lightning"),
    "TapeSACTrainerCallback": (".hf_trainer", "hf", "transformers", "accelerate"),
}

__all__ = [
    "TapeSACAccelerator",
    "TapeSACCallback",
    "TapeSACFSDPStrategy",
    "TapeSACPlugin",
    "TapeSACTrainerCallback",
]


@contextmanager
def needs_extra(extra: str, what: str, *modules: str) -> Iterator[None]:
    """Turns the block's failure to import the library ``extra`` (or one of ``modules``, which the
    extra also installs) into an ImportError saying which extra to install; other import errors
    (a broken install of something else) pass unchanged."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in (extra, *modules):
            raise
        raise ImportError(
            f"{what} needs {missing}, which is not installed. Fix: pip install 'tapesac[{extra}]'"
        ) from e


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, extra, *libraries = _EXPORTS[name]
    with needs_extra(extra, f"tapesac_lightning.{name}", *libraries):
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
