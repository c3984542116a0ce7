"""Profiling on the training step (paper §3.4.1): one reference block per region type, its node
times, and the must-only step's peak memory at the token counts seen."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .block import BlockTrace
from .plan import PlanGraph, Point, solve_frontier
from .plan.tape_graph import graph_of
from .tape import Tape
from .timing import seconds


@dataclass(eq=False)
class RegionProfile:
    """A region type's model: its reference block's tape and times, and which blocks share it."""

    region: str
    tape: Tape
    tokens: int
    node_time: dict[int, float]     # replayed under must-only, seconds (minimum over steps)
    forward_time: dict[int, float]  # every node, in forward, seconds (minimum over steps)
    shares_reference: tuple[bool, ...]  # per block of the region, forward order

    @property
    def sequence(self) -> str:
        return self.tape.fingerprint

    @property
    def blocks(self) -> int:
        """m_r: the blocks of the region. Those whose op sequence differs from the reference's
        save by anchored coordinates, within the same bytes."""
        return len(self.shares_reference)

    @functools.cached_property
    def graph(self) -> PlanGraph:
        return graph_of(self.tape, self.node_time)

    def frontier(self, beam_width: int, max_set_size: int) -> tuple[Point, ...]:
        """The Pareto frontier of the reference block at its own token count (cached)."""
        key = (beam_width, max_set_size)
        if key not in self._frontiers:
            self._frontiers[key] = solve_frontier(self.graph, beam_width=beam_width,
                                                  max_set_size=max_set_size).points
        return self._frontiers[key]

    def bytes_at(self, point: Point, factor: float) -> int:
        """A save set's bytes at ``factor`` times the reference's tokens: what grows with tokens
        scales linearly (§3.4.1); values that do not (``Tape.token_independent``) stay."""
        tape = self.tape
        fixed = tape.saved_bytes(self.graph.value_ids(point.saved) & tape.token_independent)
        return fixed + math.ceil((point.bytes - fixed) * factor)

    @functools.cached_property
    def _frontiers(self) -> dict[tuple[int, int], tuple[Point, ...]]:
        return {}

    @property
    def must_only_replay_time(self) -> float:
        """Eq. 6 for the mandatory set alone, per block, seconds."""
        return sum(self.node_time.get(i, 0.0) for i in self.tape.replay_nodes())

    @property
    def full_recompute_time(self) -> float:
        """Eq. 5 for torch's plain checkpoint (nothing saved but the inputs), per block, seconds."""
        tape = self.tape
        missing = tape.demand - tape.leaves
        if not missing:
            return 0.0
        last = max(tape.values[v].node for v in missing)
        # Replay times where measured (same kind of measurement as must-only), else forward times.
        return sum(self.node_time.get(i, self.forward_time.get(i, 0.0)) for i in range(last + 1))


def _fastest(samples: Iterable) -> float:
    return min(seconds(s) for s in samples)


def region_profiles(blocks: list[BlockTrace], tokens: dict[str, int]) -> dict[str, RegionProfile]:
    """One profile per region from a profiling step's traces (times of the reference blocks)."""
    by_region: dict[str, list[BlockTrace]] = {}
    for b in blocks:
        by_region.setdefault(b.tape.region, []).append(b)
    profiles = {}
    for region, traces in by_region.items():
        common, _ = Counter(b.tape.fingerprint for b in traces).most_common(1)[0]
        reference = next(b for b in traces if b.tape.fingerprint == common)
        profiles[region] = RegionProfile(
            region=region, tape=reference.tape, tokens=tokens[region],
            node_time={i: _fastest(s) for i, s in reference.node_times.items()},
            forward_time={i: seconds(s) for i, s in reference.forward_times.items()},
            shares_reference=tuple(b.tape.fingerprint == common for b in traces))
    return profiles


def merged(old: RegionProfile | None, new: RegionProfile) -> RegionProfile:
    """Keep each node's shorter time over profiling steps of the same block shape."""
    if old is None or old.sequence != new.sequence or old.tokens != new.tokens:
        return new
    keep = {i: min(t, old.node_time.get(i, t)) for i, t in new.node_time.items()}
    forward = {i: min(t, old.forward_time.get(i, t)) for i, t in new.forward_time.items()}
    return RegionProfile(region=new.region, tape=new.tape, tokens=new.tokens, node_time=keep,
                         forward_time=forward, shares_reference=new.shares_reference)


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """The must-only step's memory at a token count (Eq. 8's base and Eq. 9's measured terms)."""

    tokens: int
    peak: int
    static: int = 0          # in use when the step started (model states): does not scale with tokens
    outside: int = 0         # device memory outside PyTorch's caching allocator
    fragmentation: int = 0   # reserved minus allocated at the peak


@dataclass
class MemoryModel:
    """base(tokens): the must-only step peak, interpolated between samples (paper §3.4.2)."""

    samples: list[MemorySample] = field(default_factory=list)
    extra_fragmentation: int = 0  # raised when observed peaks come near the limit

    def add(self, sample: MemorySample) -> None:
        self.samples = sorted([s for s in self.samples if s.tokens != sample.tokens] + [sample],
                              key=lambda s: s.tokens)

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
                return round(lo.peak + (hi.peak - lo.peak) * (tokens - lo.tokens) / (hi.tokens - lo.tokens))
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
