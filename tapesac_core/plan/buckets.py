"""Geometric token buckets (paper §3.4.4): one plan per bucket, solved at its upper edge."""

from __future__ import annotations

import math

PRIMARY_FACTOR = 1.1
SECONDARY_FACTOR = 1.25


def bucket(tokens: int, factor: float) -> int:
    """The bucket q of `tokens`: factor**q <= tokens < factor**(q + 1)."""
    _check_factor(factor)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    q = int(math.log(tokens) / math.log(factor))
    # The logarithm can land one off near a power; the powers decide.
    while factor ** (q + 1) <= tokens:
        q += 1
    while q > 0 and factor**q > tokens:
        q -= 1
    return q


def upper_edge(q: int, factor: float) -> int:
    """The largest token count below factor**(q + 1): no count in bucket q exceeds it."""
    _check_factor(factor)
    if isinstance(q, bool) or not isinstance(q, int) or q < 0:
        raise ValueError(f"bucket must be an int >= 0, got {q!r}")
    return math.ceil(factor ** (q + 1)) - 1


def _check_factor(factor: float) -> None:
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
        raise ValueError(
            f"factor must be a finite number > 1 (1.1 primary, 1.25 secondary), got {factor!r}"
        )
