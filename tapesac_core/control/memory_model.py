"""The must-only step's memory at the token counts seen (paper §3.4.1): metered samples, the
sample step's timelines, fragmentation and memory outside the blocks."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..measure.memory import MemoryReading
from ..plan.peak_timeline import Timeline


def step_fragmentation(reading: MemoryReading) -> int:
    """Reserved minus allocated at a sample step's peak, when the step itself set the reserved
    high-water mark; 0 when it fit in memory an earlier step reserved (nothing measured)."""
    return max(0, reading.reserved - reading.peak) if reading.reserved_growth > 0 else 0


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """The must-only step's memory at a token count (Eq. 8's base and Eq. 9's measured terms)."""

    tokens: int
    peak: int
    static: int = 0  # in use when the step started (model states): does not scale with tokens
    outside: int = 0  # device memory outside PyTorch's caching allocator
    fragmentation: int = 0  # reserved minus allocated at the peak

    @classmethod
    def of(cls, reading: MemoryReading, tokens: int, static: int) -> MemorySample:
        """A metered must-only step at ``tokens``; ``static``: in use when it started."""
        return cls(
            tokens=tokens,
            peak=reading.peak,
            static=static,
            outside=reading.outside,
            fragmentation=step_fragmentation(reading),
        )


@dataclass
class MemoryModel:
    """base(tokens): the must-only step peak, interpolated between samples (paper §3.4.2).

    Samples and timelines are kept as if the memory in use when a step starts (model states,
    other models, buffers: memory outside the blocks, which no plan can give back) were what the
    first sample measured, ``reference_static``; ``static_growth`` is how much more is in use now
    (negative: less), as last measured, and comes off the capacity.
    """

    samples: list[MemorySample] = field(default_factory=list)
    extra_fragmentation: int = 0  # raised when observed peaks come near the limit
    model_error: int = 0  # raised when a metered step exceeded its predicted peak
    timelines: dict[int, Timeline] = field(default_factory=dict)  # per sampled token count
    reference_static: int | None = None
    static_growth: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Samples and corrections (timelines are not kept: a new bucket profiles again)."""
        return {
            "samples": [vars(s) for s in self.samples],
            "extra_fragmentation": self.extra_fragmentation,
            "model_error": self.model_error,
            "reference_static": self.reference_static,
            "static_growth": self.static_growth,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> MemoryModel:
        model = cls(
            extra_fragmentation=state["extra_fragmentation"],
            model_error=int(state.get("model_error", 0)),  # absent before version 3
            # Absent before version 4: samples then were as measured, the first one's static
            # their reference.
            reference_static=state.get("reference_static"),
            static_growth=int(state.get("static_growth", 0)),
        )
        for s in state["samples"]:
            model.samples.append(MemorySample(**s))
        if model.reference_static is None and model.samples:
            model.reference_static = model.samples[0].static
        return model

    def growth_at(self, static: int) -> int:
        """How much more than the reference is in use at a step's start of ``static`` bytes."""
        return static - self.reference_static if self.reference_static is not None else 0

    def add_timeline(self, timeline: Timeline) -> None:
        """The memory timeline of a must-only sample step (the peak-aware model's input)."""
        self.timelines[timeline.tokens] = timeline.shifted(self.growth_at(timeline.static))

    def timeline(self, tokens: int) -> Timeline | None:
        """The timeline sampled nearest ``tokens`` (None before any): its shape is scaled to
        the must-only peak at ``tokens`` when solving (``Timeline.scaled``), the memory that
        does not grow with tokens (``fixed``) taken as static, unscaled."""
        if not self.timelines:
            return None
        nearest = self.timelines[min(self.timelines, key=lambda t: (abs(t - tokens), -t))]
        return dataclasses.replace(nearest, static=nearest.static + self.fixed)

    @property
    def fixed(self) -> int:
        """The must-only peak's part above the static memory that does not grow with tokens
        (under FSDP2 the gathered parameters, weight casts): the intercept of a line fitted
        through the samples, once they span token counts 20% apart; 0 before."""
        s = self.samples
        if len(s) < 2 or s[-1].tokens < 1.2 * s[0].tokens:
            return 0
        xs = [x.tokens for x in s]
        ys = [x.peak - x.static for x in s]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
            (x - mean_x) ** 2 for x in xs
        )
        return int(min(max(0.0, mean_y - slope * mean_x), min(ys)))

    def add(self, sample: MemorySample) -> None:
        """A metered must-only step, kept at the reference static (see the class)."""
        if self.reference_static is None:
            self.reference_static = sample.static
        shift = self.growth_at(sample.static)
        sample = dataclasses.replace(sample, peak=sample.peak - shift, static=sample.static - shift)
        self.samples = sorted(
            [s for s in self.samples if s.tokens != sample.tokens] + [sample],
            key=lambda s: s.tokens,
        )

    def base(self, tokens: int) -> int:
        """Linear between samples, never below the smallest one (memory only grows with tokens);
        above them, what the step adds to its static memory grows at least proportionally."""
        if not self.samples:
            raise ValueError("no memory sample yet: run a must-only sample step first")
        s = self.samples
        if tokens <= s[0].tokens:
            return s[0].peak
        for lo, hi in zip(s, s[1:]):
            if tokens <= hi.tokens:
                return round(
                    lo.peak + (hi.peak - lo.peak) * (tokens - lo.tokens) / (hi.tokens - lo.tokens)
                )
        last = s[-1]
        slope = max(0, last.peak - last.static) / last.tokens
        if len(s) > 1:
            prev = s[-2]
            slope = max(slope, (last.peak - prev.peak) / (last.tokens - prev.tokens))
        return round(last.peak + slope * (tokens - last.tokens))

    def covers(self, tokens: int, tolerance: float) -> bool:
        """A sample within ``tolerance`` (relative) of ``tokens``."""
        return any(abs(tokens - s.tokens) <= tolerance * s.tokens for s in self.samples)

    @property
    def outside(self) -> int:
        return max((s.outside for s in self.samples), default=0)

    @property
    def measured_fragmentation(self) -> int:
        """The largest fragmentation a sample step measured (without the controller's raises)."""
        return max((s.fragmentation for s in self.samples), default=0)

    @property
    def fragmentation(self) -> int:
        return self.measured_fragmentation + self.extra_fragmentation
