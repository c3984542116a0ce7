"""Deprecated alias of ``tapesac_integrations``, kept so that code written before the rename runs.

The package held Lightning, Accelerate, the Hugging Face Trainer and the CLI under Lightning's
name, and its ``logging`` module shadowed the standard library's. Every public name and module
path still resolves to the same object in ``tapesac_integrations``; importing warns once.
"""

from __future__ import annotations

import warnings
from typing import Any

import tapesac_integrations

warnings.warn(
    "tapesac_lightning is deprecated and will be removed: import from tapesac_integrations "
    "instead (same names; the modules strategy, callback and trainer are now lightning_strategy, "
    "lightning_callback and hf_trainer)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = tapesac_integrations.__all__


def __getattr__(name: str) -> Any:
    return getattr(tapesac_integrations, name)


def __dir__() -> list[str]:
    return sorted(__all__)
