"""``TextEnum``: an enum whose members are their text (``enum.StrEnum`` from Python 3.11 on)."""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """Members compare equal to their text and print as it (``str()``, f-strings, JSON), so a
    typed field reads and serialises as the bare string it replaces."""

    def __str__(self) -> str:
        return self.value
