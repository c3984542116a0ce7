"""The planner's time model of a step: time outside replay plus modelled replay time.

Pure Python, no torch. The replay time is modelled from the profiled node times, the same times
every plan's gain comes from, so a plan's gain can never exceed it; the time outside replay comes
from measured must-only steps minus their modelled replay. A predicted speedup is then finite,
at least 1, monotone in the gain and at most ``must_only / outside``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

_TINY = 1e-9  # seconds: keeps a step of zero measured and modelled time finite


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """A must-only step at one token count: ``outside`` seconds outside replay (forward, backward
    kernels, optimizer, ...) and ``replay`` seconds of modelled must-only replay (all blocks).

    Build it with ``model`` or ``of_step``, which apply the floor ``outside >= replay``.
    """

    outside: float
    replay: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.outside) and math.isfinite(self.replay)):
            raise ValueError(f"step times must be finite, got {self}")
        if self.replay < 0 or self.outside <= 0:
            raise ValueError(f"need replay >= 0 and outside > 0, got {self}")

    @classmethod
    def model(cls, outside: float, replay: float) -> StepTime:
        """``outside`` floored at ``replay``: replay re-runs a subset of the forward's ops, and the
        forward runs outside replay in the same step, so a step shorter than twice its modelled
        replay means the replay model is inflated (a busy host while profiling), not that the
        step is all replay. The floor bounds every predicted speedup by 2."""
        replay = max(0.0, float(replay))
        return cls(outside=max(float(outside), replay, _TINY), replay=replay)

    @classmethod
    def of_step(cls, must_only_step: float, replay: float) -> StepTime:
        """From one must-only step's seconds (measured or estimated) and its modelled replay."""
        return cls.model(must_only_step - replay, replay)

    @property
    def must_only(self) -> float:
        """Predicted seconds of the must-only step."""
        return self.outside + self.replay

    @property
    def bound(self) -> float:
        """The largest speedup any plan can have: all replay removed."""
        return self.must_only / self.outside

    def planned(self, gain: float) -> float:
        """Predicted seconds of a step whose plan removes ``gain`` seconds of replay (clamped to
        [0, replay]: a plan cannot remove more replay than there is)."""
        return self.must_only - min(max(gain, 0.0), self.replay)

    def speedup(self, gain: float) -> float:
        """Predicted must-only / planned step time: in [1, bound], non-decreasing in ``gain``."""
        return self.must_only / self.planned(gain)


def outside_per_token(steps: Iterable[tuple[float, float, int]]) -> float | None:
    """Median over must-only steps ``(seconds, modelled replay seconds, tokens)`` of the time
    outside replay per token (each step's own tokens), or None without steps. A median, so one
    disturbed step does not set it."""
    rates = [(seconds - replay) / tokens for seconds, replay, tokens in steps if tokens > 0]
    return statistics.median(rates) if rates else None
