"""The timeline a peak-aware model of a plan's step peak reads (``peak.predict``).

A must-only sample step is measured as a timeline of segments: the meter's peak between
consecutive events (a block's forward starts or ends, autograd unpacks a value of a block and
its replay returns, a block's saved values are freed).

Python, no torch: events in, a timeline out.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..enums import TextEnum


class EventKind(TextEnum):
    """What happened at an event the sample step records; each starts a segment of a phase.
    ``FREED``: a storage of a block that outlived its forward (``TimelineBlock.lingering``) was
    freed; the segment it splits keeps its phase on both sides."""

    FORWARD_START = "forward_start"
    FORWARD_END = "forward_end"
    UNPACK_START = "unpack_start"
    UNPACK_END = "unpack_end"
    RELEASE = "release"
    FREED = "freed"


class Phase(TextEnum):
    """What runs in a segment of the step: a block's forward, its replay, autograd's compute
    between unpacks, nothing of a block; ``RELEASING``: the instant a block is released (it
    still holds its saved values)."""

    FORWARD = "forward"
    REPLAY = "replay"
    COMPUTE = "compute"
    OUTSIDE = "outside"
    RELEASING = "releasing"


FORWARD_START, FORWARD_END, UNPACK_START, UNPACK_END, RELEASE, FREED = EventKind
KINDS = tuple(EventKind)
FORWARD, REPLAY, COMPUTE, OUTSIDE, RELEASING = Phase


@dataclass(frozen=True, kw_only=True)
class Event:
    """One reading at an event of the sample step: the peak since the previous event (the
    segment this event closes) and the bytes in use now."""

    kind: EventKind
    block: int  # index of the block in forward order within the step
    peak: int
    current: int
    vid: int | None = None  # the value unpacked (UNPACK_START / UNPACK_END) or freed (FREED)
    node: int | None = None  # the autograd node that unpacked it (its id, while it runs)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")
        if self.block < 0 or self.peak < 0 or self.current < 0:
            raise ValueError(f"an event needs block >= 0 and bytes >= 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class TimelineBlock:
    """A block of the sample step: its region, its index among that region's blocks (the plan's
    per-block entry), its op sequence and the values autograd unpacked, in order."""

    region: str
    index: int
    sequence: str
    unpacks: tuple[int, ...] = ()
    taken: frozenset[int] = frozenset()  # demanded values taken alive, not replayed
    groups: tuple[int, ...] = ()  # per unpack, the autograd node call it belongs to (numbered)
    # Values (one per storage) whose tensors outlived the block's forward, not held by it: a
    # tuple the caller keeps for a while (attention weights), a cache. The sample step measured
    # them alive until freed (a FREED event, else to the step's end); a plan that keeps one too
    # does not add its bytes again there (``Segment.lingering``, ``Option.linger``).
    lingering: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Memory between two events: its measured peak, the blocks whose saved values are alive
    (``first``..``last`` in forward order, empty when ``first > last``), and the block whose
    replay runs in it (``own``, with the position of the unpack and its phase)."""

    peak: int
    first: int
    last: int
    phase: Phase = OUTSIDE
    own: int | None = None
    unpack: int | None = None
    label: str = ""
    # (block, position in its ``lingering``) of each value that outlived its block's forward
    # and was alive throughout this segment: measured in ``peak`` already.
    lingering: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """A must-only sample step's memory over time, at ``tokens`` primary tokens.

    ``static`` is what was in use when the step began (model states: it does not scale with
    tokens); the largest segment peak is the step's must-only peak.
    """

    tokens: int
    static: int
    segments: tuple[Segment, ...]
    blocks: tuple[TimelineBlock, ...]

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.static < 0 or not self.segments:
            raise ValueError("a timeline needs tokens >= 1, static >= 0 and at least one segment")
        for s in self.segments:
            if s.first <= s.last and not (0 <= s.first and s.last < len(self.blocks)):
                raise ValueError(
                    f"segment {s} names blocks outside the timeline's {len(self.blocks)}"
                )
            if s.own is not None and not 0 <= s.own < len(self.blocks):
                raise ValueError(f"segment {s} replays a block outside the timeline")

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.segments)

    def shifted(self, by: int) -> Timeline:
        """The timeline with ``by`` bytes less in use throughout (memory outside the blocks)."""
        segments = tuple(dataclasses.replace(s, peak=s.peak - by) for s in self.segments)
        return dataclasses.replace(self, static=self.static - by, segments=segments)

    def scaled(self, base: int) -> Timeline:
        """The timeline at another token count whose must-only peak is ``base``: what each
        segment adds to the static memory scales with it (sizes scale with tokens, §3.4.1)."""
        grow = self.peak - self.static
        factor = (base - self.static) / grow if grow > 0 else 1.0
        segments = tuple(
            Segment(
                peak=round(self.static + (s.peak - self.static) * factor),
                first=s.first,
                last=s.last,
                phase=s.phase,
                own=s.own,
                unpack=s.unpack,
                label=s.label,
                lingering=s.lingering,
            )
            for s in self.segments
        )
        return Timeline(
            tokens=self.tokens, static=self.static, segments=segments, blocks=self.blocks
        )


def timeline_of(
    events: Sequence[Event],
    blocks: Sequence[TimelineBlock],
    *,
    tokens: int,
    static: int,
    end_peak: int,
    names: Sequence[str] | None = None,
) -> Timeline:
    """The timeline of a sample step from its events in order; ``end_peak`` is the peak between
    the last event and the end of the step. A block's saved values count from its forward start
    until its release (to the end of the step if it was never released); alive sets are widened
    to a contiguous range, which only adds bytes. A value that outlived its block's forward
    (``TimelineBlock.lingering``) is alive from the block's forward end until its FREED event
    (to the end of the step without one); the segments it was alive throughout name it."""
    n = len(blocks)
    started = [math.inf] * n
    released = [math.inf] * n
    unpack_pos: Counter[int] = Counter()
    positions: list[int | None] = []  # per event, the position of its unpack within its block
    for k, e in enumerate(events):
        if e.block >= n:
            raise ValueError(f"event {e} names block {e.block}, the step had {n}")
        if e.kind == FORWARD_START:
            started[e.block] = min(started[e.block], k)
        elif e.kind == RELEASE:
            released[e.block] = min(released[e.block], k)
        if e.kind == UNPACK_START:
            positions.append(unpack_pos[e.block])
            unpack_pos[e.block] += 1
        else:
            positions.append(unpack_pos[e.block] - 1 if e.kind == UNPACK_END else None)
    names = list(names) if names is not None else [f"block {i}" for i in range(n)]
    last_forward = max((k for k, e in enumerate(events) if e.kind == FORWARD_END), default=-1)
    first_unpack = min(
        (k for k, e in enumerate(events) if e.kind == UNPACK_START), default=len(events)
    )
    lingering = _lingering_spans(events, blocks, released)
    segments = []
    regular: Segment | None = None  # the last segment between two events
    for k in range(len(events) + 1):
        # Segment k lies between event k-1 and event k.
        opener = events[k - 1] if k > 0 else None
        if opener is not None and opener.kind == RELEASE:
            # A block is released inside its finalizer, before its tensors go: the instant of
            # the release still holds them (the event's bytes in use), what follows does not.
            # Counting them over the whole segment would add a plan's saved bytes to a later
            # peak (the optimizer step, after the first block's release).
            holding = [i for i in range(n) if started[i] <= k - 1 and released[i] >= k - 1]
            segments.append(
                Segment(
                    peak=opener.current,
                    first=min(holding),
                    last=max(holding),
                    phase=RELEASING,
                    own=opener.block,
                    unpack=0,
                    label=f"backward, as {names[opener.block]} frees its values",
                    lingering=_alive_at(lingering, k - 1, instant=True),
                )
            )
        alive = [i for i in range(n) if started[i] <= k - 1 and released[i] > k - 1]
        first, last = (min(alive), max(alive)) if alive else (0, -1)
        peak = events[k].peak if k < len(events) else end_peak
        phase, own, unpack = OUTSIDE, None, None
        if opener is not None and opener.kind == FREED and regular is not None:
            # A free splits a segment: both parts are the same phase of the same block.
            phase, own, unpack, label = regular.phase, regular.own, regular.unpack, regular.label
        elif opener is None:
            label = "before the first block (embedding)"
        elif opener.kind == FORWARD_START:
            phase, own, unpack = FORWARD, opener.block, 0
            label = f"forward of {names[opener.block]}"
        elif opener.kind in (UNPACK_START, UNPACK_END):
            phase = REPLAY if opener.kind == UNPACK_START else COMPUTE
            own, unpack = opener.block, positions[k - 1]
            label = f"backward window of {names[opener.block]}"
        elif k - 1 >= last_forward and k - 1 < first_unpack:
            label = "between forward and backward (the loss)"
        elif not alive and k - 1 > first_unpack:
            label = "after backward (optimizer step)"
        elif opener.kind == RELEASE:
            label = f"backward, after {names[opener.block]} freed its values"
        else:
            label = f"forward, after {names[opener.block]}"
        regular = Segment(
            peak=peak,
            first=first,
            last=last,
            phase=phase,
            own=own,
            unpack=unpack,
            label=label,
            lingering=_alive_at(lingering, k),
        )
        segments.append(regular)
    return Timeline(tokens=tokens, static=static, segments=tuple(segments), blocks=tuple(blocks))


def _lingering_spans(
    events: Sequence[Event], blocks: Sequence[TimelineBlock], released: Sequence[float]
) -> list[tuple[int, int, int, float, float]]:
    """Per value that outlived its block's forward: (block, position in its ``lingering``,
    the event of the block's forward end, of its free and of the block's release: inf for
    none). After the release a plan keeps nothing of the block: nothing is counted twice."""
    ends: dict[int, int] = {}
    freed: dict[tuple[int, int], int] = {}
    for k, e in enumerate(events):
        if e.kind == FORWARD_END:
            ends.setdefault(e.block, k)
        elif e.kind == FREED and e.vid is not None:
            freed.setdefault((e.block, e.vid), k)
    return [
        (i, j, ends[i], freed.get((i, v), math.inf), released[i])
        for i, b in enumerate(blocks)
        if i in ends
        for j, v in enumerate(b.lingering)
    ]


def _alive_at(
    spans: list[tuple[int, int, int, float, float]], k: int, instant: bool = False
) -> tuple[tuple[int, int], ...]:
    """The values of ``spans`` alive throughout segment ``k`` (between events k-1 and k: from
    their forward end at or before event k-1 to a free at or after event k) while their block
    holds its values (released after event k-1); ``instant``: at event ``k`` itself (freed
    after it, the block released at it or later)."""
    if instant:
        return tuple((i, j) for i, j, end, free, gone in spans if end <= k < free and k <= gone)
    return tuple(
        (i, j) for i, j, end, free, gone in spans if end <= k - 1 and k <= free and k - 1 < gone
    )
