"""Sets of small non-negative ints held as Python int bitsets."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress

_DIGITS = bytes.maketrans(b"01", b"\x00\x01")


def bits(ids: Iterable[int]) -> int:
    """The bitset holding `ids`."""
    mask = 0
    for i in ids:
        mask |= 1 << i
    return mask


def members(mask: int) -> list[int]:
    """The ids in bitset `mask`, ascending."""
    # Scanning the binary string in C beats peeling bits off a 2,000-bit int.
    digits = bin(mask)[:1:-1]
    if mask.bit_count() > 32:
        return list(compress(range(len(digits)), digits.encode().translate(_DIGITS)))
    found, i = [], digits.find("1")
    while i >= 0:
        found.append(i)
        i = digits.find("1", i + 1)
    return found
