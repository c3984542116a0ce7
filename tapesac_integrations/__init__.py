"""Deprecated alias of ``tapesac_lightning``, the integrations' name for a few releases.

Every public name and module path resolves to the very object ``tapesac_lightning`` holds;
importing warns once.
"""

from __future__ import annotations

import warnings
from typing import Any

import tapesac_lightning

warnings.warn(
    "tapesac_integrations is deprecated and will be removed: import from tapesac_lightning "
    "instead (same names and module names)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = tapesac_lightning.__all__


def __getattr__(name: str) -> Any:
    return getattr(tapesac_lightning, name)


def __dir__() -> list[str]:
    return sorted(__all__)
