"""The step's memory as it really moves: a peak-aware model of any plan's step peak (DESIGN,
"The step's memory, as it really moves"; paper §3.4.2, the window model).

A must-only sample step is measured as a timeline of segments: the meter's peak between
consecutive events (a block's forward starts or ends, autograd unpacks a value of a block and
its replay returns, a block's saved values are freed). A plan changes that timeline in two ways:

* block ``i`` keeps ``x_i`` more bytes from its forward until it is freed (end of its backward
  window), so every segment in between rises by ``x_i``;
* in block ``j``'s backward window, replay holds other temporaries: the replay of the same
  unpacks is simulated on the tape for the must-only set and for the block's save set, and the
  segment moves by the difference.

The predicted peak is the largest segment after both changes. Blocks alive in one segment are a
contiguous range in forward order (a micro-batch's blocks from the first to the latest started),
so the best plan under the predicted peak is an exact dynamic program over blocks in forward order
whose state is the bytes kept since the start of the micro-batch (``solve_peak``).

Python and numpy, no torch: timelines and plan graphs in, predictions and choices out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .model import PlanGraph, storages_bytes
from .plan import BlockKind

# Event kinds the sample step records, and the phase of the segment each one starts.
FORWARD_START, FORWARD_END, UNPACK_START, UNPACK_END, RELEASE = (
    "forward_start",
    "forward_end",
    "unpack_start",
    "unpack_end",
    "release",
)
# A storage of a block that outlived its forward (``TimelineBlock.lingering``) was freed: the
# segment it splits keeps its phase on both sides.
FREED = "freed"
KINDS = (FORWARD_START, FORWARD_END, UNPACK_START, UNPACK_END, RELEASE, FREED)
FORWARD, REPLAY, COMPUTE, OUTSIDE = "forward", "replay", "compute", "outside"
RELEASING = "releasing"  # the instant a block is released: it still holds its saved values


@dataclass(frozen=True, kw_only=True)
class Event:
    """One reading at an event of the sample step: the peak since the previous event (the
    segment this event closes) and the bytes in use now."""

    kind: str
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
    phase: str = OUTSIDE
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


# ---------------------------------------------------------------------- replay memory


@dataclass(frozen=True, kw_only=True)
class ReplayMemory:
    """Bytes replay holds in one block's backward window, per unpack in order: the most while
    its closure runs (``replay``) and while autograd computes with the value (``compute``)."""

    replay: tuple[int, ...]
    compute: tuple[int, ...]


def replay_memory(
    graph: PlanGraph,
    saved: Iterable[int],
    unpacks: Sequence[int],
    taken: Iterable[int] = (),
    groups: Sequence[int] = (),
) -> ReplayMemory:
    """Simulate replay (as ``replay.Replay`` runs it) for the unpacks of one backward window.

    Available without replay: the graph's available values, ``saved`` and ``taken`` (values
    alive elsewhere); storages they use cost nothing. Each unpack of a missing value runs its
    producer closure in tape order; every output exists while its node runs, and is kept while
    a later read remains; autograd's reads are the unpacks themselves. An unpacked value that
    replay no longer holds is still held by autograd until its node has computed: until the
    unpacks of the same ``groups`` entry (one autograd node call) are done, or, without
    groups, until the next unpack.
    """
    available = graph.available | frozenset(saved) | frozenset(taken)
    deps_of, outs_of, producer = graph.node_deps, graph.node_outs, graph.producer
    sizes, storage = graph.storage_bytes, graph.value_storage
    held = {storage[v] for v in available}
    cost = [0 if s in held else b for s, b in enumerate(sizes)]  # bytes a live storage costs
    # Flags per value rather than sets: this loop runs once per frontier point and unpack.
    avail = [False] * len(storage)
    for v in available:
        avail[v] = True
    env = [False] * len(storage)  # replay holds the value
    reads = [0] * len(storage)
    for v in unpacks:
        if not avail[v]:
            reads[v] += 1
    # Every read of every node replay runs (its producer closure), counted in one walk.
    stack = [v for v in set(unpacks) if reads[v]]
    seen = bytearray(len(storage))
    ran = bytearray(len(deps_of))
    while stack:
        n = producer[stack.pop()]
        if ran[n]:
            continue
        ran[n] = 1
        for d in deps_of[n]:
            reads[d] += 1
            if not (avail[d] or seen[d]):
                seen[d] = 1
                stack.append(d)
    refs = [0] * len(sizes)  # storage -> values of env on it
    live = 0
    node_mark, value_mark = [0] * len(deps_of), [0] * len(storage)
    walks = 0
    # One autograd node call per groups entry: autograd's holds end where a new one starts.
    starts = (
        [True] * len(unpacks)
        if not groups
        else [k == 0 or groups[k] != groups[k - 1] for k in range(len(unpacks))]
    )
    replay, compute = [], []
    grabbed: dict[int, int] = {}  # storage -> bytes autograd holds for the current node
    # The loop below runs once per frontier point and unpack: names stay local (no closures),
    # so freeing a value is written out where it happens.
    for v, start in zip(unpacks, starts):
        if start:
            grabbed.clear()
        top = live
        if not (avail[v] or env[v]):
            # Replay's own walk (``tape.producer_closure``) from v, stopping at values that
            # exist; marks carry the walk's number so no per-walk arrays are built.
            walks += 1
            needed, stack = [], [v]
            value_mark[v] = walks
            while stack:
                n = producer[stack.pop()]
                if node_mark[n] == walks:
                    continue
                node_mark[n] = walks
                needed.append(n)
                for d in deps_of[n]:
                    if not (avail[d] or env[d]) and value_mark[d] != walks:
                        value_mark[d] = walks
                        stack.append(d)
            needed.sort()
            for n in needed:
                outs = outs_of[n]
                if len(outs) == 1:
                    s = storage[outs[0]]
                    rise = 0 if refs[s] else cost[s]
                else:
                    rise = sum(cost[s] for s in {storage[o] for o in outs if not refs[storage[o]]})
                if live + rise > top:
                    top = live + rise
                for o in outs:
                    if reads[o] > 0:
                        env[o] = True
                        s = storage[o]
                        refs[s] += 1
                        if refs[s] == 1:
                            live += cost[s]
                for d in deps_of[n]:
                    reads[d] -= 1
                    if reads[d] <= 0 and env[d]:  # its last read: replay lets go of it
                        env[d] = False
                        s = storage[d]
                        refs[s] -= 1
                        if not refs[s]:
                            live -= cost[s]
        replay.append(top + (sum(b for s, b in grabbed.items() if not refs[s]) if grabbed else 0))
        if not avail[v]:
            reads[v] -= 1
            if reads[v] <= 0 and env[v]:
                env[v] = False
                s = storage[v]
                refs[s] -= 1
                if not refs[s]:
                    live -= cost[s]
                    grabbed[s] = cost[s]  # autograd holds it while its node computes
        compute.append(live + (sum(b for s, b in grabbed.items() if not refs[s]) if grabbed else 0))
    return ReplayMemory(replay=tuple(replay), compute=tuple(compute))


def forward_memory(graph: PlanGraph, saved: Iterable[int]) -> int:
    """The most bytes a block's forward holds (beyond the graph's available values), simulated
    in tape order: each node's outputs exist while it runs and live until their last read in
    the forward, or until the recorded forward freed their storage if later (Python keeps a
    value while a reference to it remains: ``graph.storage_freed``), or to its end when they
    are in ``saved`` (kept for backward). Comparing two save sets says how much of the later
    one's bytes exist at the forward's peak."""
    keep = frozenset(saved)
    storage, cost = graph.value_storage, list(graph.storage_bytes)
    for v in graph.available:
        cost[storage[v]] = 0
    last_read = [-1] * len(storage)
    for n, deps in enumerate(graph.node_deps):
        for d in deps:
            last_read[d] = n
    if graph.storage_freed:
        # Freed before node k ran: alive through node k - 1 (the last node at most).
        end = len(graph.node_deps) - 1
        for v, s in enumerate(storage):
            last_read[v] = max(last_read[v], min(graph.storage_freed[s], end + 1) - 1)
    refs = [0] * len(cost)  # storage -> values on it alive
    dies: list[list[int]] = [[] for _ in graph.node_deps]
    live = top = 0
    for n, outs in enumerate(graph.node_outs):
        for o in outs:
            s = storage[o]
            refs[s] += 1
            if refs[s] == 1:
                live += cost[s]
            if o not in keep:
                dies[max(n, last_read[o])].append(o)
        top = max(top, live)
        for o in dies[n]:
            s = storage[o]
            refs[s] -= 1
            if not refs[s]:
                live -= cost[s]
    return top


# ---------------------------------------------------------------------- choices and the solver


@dataclass(frozen=True, kw_only=True)
class Option:
    """One choice for a block: the bytes it keeps beyond S0, the replay time it removes, and
    how it moves the block's replay bytes at each unpack of its window (``replay``, ``compute``
    deltas against must-only; empty: not simulated, no change), its own forward's peak
    (``forward``: saved values made late in the forward are not yet alive at its peak), the
    instant of its release (``release``: a plain block's values autograd freed by then), and,
    per value of its block's ``TimelineBlock.lingering``, the bytes of it the option keeps
    (``linger``: already measured wherever the segment names it, ``Segment.lingering``)."""

    bytes: int
    gain: float
    point: int
    replay: tuple[int, ...] = ()
    compute: tuple[int, ...] = ()
    forward: int = 0
    release: int = 0
    linger: tuple[int, ...] = ()

    def lingered(self, position: int) -> int:
        """The bytes of the ``position``-th lingering value this option keeps."""
        return self.linger[position] if position < len(self.linger) else 0

    def delta(self, segment: Segment) -> int:
        if segment.phase == FORWARD:
            return self.forward
        if segment.phase == RELEASING:
            return self.release
        deltas = self.replay if segment.phase == REPLAY else self.compute
        return (
            deltas[segment.unpack]
            if segment.unpack is not None and segment.unpack < len(deltas)
            else 0
        )


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A plan's predicted step peak and the segment where it falls."""

    peak: int
    segment: int
    label: str


def predict(timeline: Timeline, options: Sequence[Option]) -> Prediction:
    """The step peak when block ``i`` takes ``options[i]`` (one per timeline block)."""
    if len(options) != len(timeline.blocks):
        raise ValueError(
            f"one option per block: {len(timeline.blocks)} blocks, {len(options)} options"
        )
    prefix = [0]
    for o in options:
        prefix.append(prefix[-1] + o.bytes)
    best, where = -1, 0
    for k, s in enumerate(timeline.segments):
        value = s.peak + (prefix[s.last + 1] - prefix[s.first] if s.first <= s.last else 0)
        if s.own is not None:
            value += options[s.own].delta(s)
        for i, j in s.lingering:
            value -= options[i].lingered(j)
        if value > best:
            best, where = value, k
    return Prediction(peak=best, segment=where, label=timeline.segments[where].label)


def solve_peak(
    timeline: Timeline, menus: Sequence[Sequence[Option]], capacity: int, resolution: int = 4096
) -> tuple[int, ...] | None:
    """Per block, the index into its menu maximising total gain with the predicted peak within
    ``capacity``; None when even the first option of every menu (must-only, 0 bytes) exceeds it.

    Exact dynamic program over blocks in forward order. Blocks whose alive ranges overlap form a
    group (a micro-batch); the state is the bytes kept by the group's blocks so far, in units of
    ``(capacity - lowest segment peak) / resolution`` with each option's bytes rounded up, so the
    result fits in true bytes. A segment is checked at its last alive block, with that block's own
    option; it counts the whole group up to there (a narrower range only has fewer bytes), and a
    segment replaying a block other than its last alive one takes that block's worst delta.
    Segments are handled as arrays: a timeline has one per unpack and phase of every block.
    """
    n = len(timeline.blocks)
    if len(menus) != n or any(not m or m[0].bytes != 0 for m in menus):
        raise ValueError("one menu per timeline block, each starting with a 0-byte option")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    seg = _columns(timeline)
    deltas = _Deltas(menus)
    lingering = _own_lingering(timeline)
    # A segment replaying a block other than its last alive one is charged that block's worst
    # option (the DP only knows the last block's option when it checks the segment).
    checked = seg.peak.copy()
    other = (seg.own >= 0) & (seg.own != seg.last)
    for k in np.flatnonzero(other):
        checked[k] += deltas.worst(int(seg.own[k]), int(seg.phase[k]), int(seg.unpack[k]))
    alive = seg.first <= seg.last
    if (checked[~alive] > capacity).any():
        return None
    spans = alive & (seg.first < seg.last)
    opens = np.cumsum(
        np.bincount(seg.first[spans] + 1, minlength=n + 1)
        - np.bincount(seg.last[spans] + 1, minlength=n + 1)
    )
    joined = opens[:n] > 0  # block i shares a segment with block i - 1
    lowest = int(seg.peak[alive].min()) if alive.any() else capacity
    unit = max(1, -(-max(1, capacity - lowest) // resolution))
    units = max(0, capacity - lowest) // unit + 1
    order = np.flatnonzero(alive)
    order = order[np.argsort(seg.last[order], kind="stable")]
    bounds = np.searchsorted(seg.last[order], np.arange(n + 1))
    layer = _start(units)
    history = []  # per block: (layer before it, its options as (weight, gain, limit), reset state)
    for i in range(n):
        reset = None
        if i > 0 and not joined[i]:
            # A new group: the earlier blocks' bytes are freed; continue from the best state.
            reset = int(np.argmax(layer))
            layer = _start(units, layer[reset])
        mine = order[bounds[i] : bounds[i + 1]]
        tops = _tops(seg, checked, mine, i, deltas, lingering.get(i))
        choices = []
        for option, top in zip(menus[i], tops):
            if top is None:  # no segment ends at this block
                limit = units - 1
            else:
                head = capacity - top
                limit = min(units - 1, head // unit if head >= 0 else -1)
            choices.append((-(-option.bytes // unit), option.gain, limit))
        cur = _start(units, -math.inf)
        # States above the highest reachable one stay unreachable: skip them.
        high = _high(layer) if reset is None else 0
        for w, g, limit in choices:
            stop = min(limit, high + w)
            if stop >= w:
                np.maximum(cur[w : stop + 1], layer[: stop + 1 - w] + g, out=cur[w : stop + 1])
        history.append((layer, choices, reset))
        layer = cur
        if _high(layer) < 0:
            return None
    state = int(np.argmax(layer))
    value = layer[state]
    picks = [0] * n
    for i in range(n - 1, -1, -1):
        prev, choices, reset = history[i]
        for c, (w, g, limit) in enumerate(choices):
            if w <= state <= limit and prev[state - w] + g == value:
                picks[i], state, value = c, state - w, prev[state - w]
                break
        else:  # pragma: no cover - the layer was built from these choices
            raise AssertionError("backtracking found no option")
        if reset is not None:
            state = reset
    return tuple(picks)


def _own_lingering(timeline: Timeline) -> dict[int, dict[int, list[int]]]:
    """Per block, the segments checked at it (its last alive block) where values that outlived
    its own forward were alive: segment -> their positions in its ``lingering``. Those of other
    blocks in a segment are not known to the DP (it knows only the last block's option) and
    are not counted off: the DP then takes the segment for higher than ``predict`` does."""
    out: dict[int, dict[int, list[int]]] = {}
    for k, s in enumerate(timeline.segments):
        for i, j in s.lingering:
            if i == s.last:
                out.setdefault(i, {}).setdefault(k, []).append(j)
    return out


def _start(units: int, first: float = 0.0) -> np.ndarray:
    """A DP layer: the best gain per state, -inf where unreachable; ``first`` at state 0."""
    values = np.full(units, -math.inf)
    values[0] = first
    return values


def _high(layer: np.ndarray) -> int:
    """The highest reachable state (-1: none)."""
    reachable = np.flatnonzero(layer != -math.inf)
    return int(reachable[-1]) if len(reachable) else -1


@dataclass(frozen=True)
class _Columns:
    """A timeline's segments as arrays; -1 for no ``own`` block or unpack; ``phase`` is 0 for
    replay, 1 for compute, 2 for a block's own forward and 3 for its release (one column each),
    -1 for any other phase (no option moves it)."""

    peak: np.ndarray
    first: np.ndarray
    last: np.ndarray
    own: np.ndarray
    phase: np.ndarray
    unpack: np.ndarray


_PHASES = {REPLAY: 0, COMPUTE: 1, FORWARD: 2, RELEASING: 3}


def _columns(timeline: Timeline) -> _Columns:
    phases = _PHASES
    rows = np.array(
        [
            (
                s.peak,
                s.first,
                s.last,
                -1 if s.own is None or s.unpack is None else s.own,
                phases.get(s.phase, -1),
                -1 if s.unpack is None else s.unpack,
            )
            for s in timeline.segments
        ],
        dtype=np.int64,
    ).reshape(-1, 6)
    peak, first, last, own, phase, unpack = rows.T.copy()
    own[phase < 0] = -1
    return _Columns(peak=peak, first=first, last=last, own=own, phase=phase, unpack=unpack)


class _Deltas:
    """Per menu and phase, its options' replay-byte deltas as one matrix (options x unpacks),
    built once per distinct menu (blocks of one region share theirs)."""

    def __init__(self, menus: Sequence[Sequence[Option]]) -> None:
        self.menus = menus
        self.matrices: dict[tuple[int, int], np.ndarray] = {}

    def matrix(self, block: int, phase: int, width: int) -> np.ndarray:
        menu = self.menus[block]
        key = (id(menu), phase)
        m = self.matrices.get(key)
        if m is None:
            rows = [(o.replay, o.compute, (o.forward,), (o.release,))[phase] for o in menu]
            m = np.zeros((len(menu), max(map(len, rows), default=0)), dtype=np.int64)
            for r, d in enumerate(rows):
                m[r, : len(d)] = d
            self.matrices[key] = m
        if m.shape[1] < width:  # an unpack beyond the simulated ones: no change there
            m = np.pad(m, ((0, 0), (0, width - m.shape[1])))
        return m

    def worst(self, block: int, phase: int, unpack: int) -> int:
        return int(self.matrix(block, phase, unpack + 1)[:, unpack].max())


def _tops(
    seg: _Columns,
    checked: np.ndarray,
    mine: np.ndarray,
    block: int,
    deltas: _Deltas,
    lingering: Mapping[int, list[int]] | None = None,
) -> list[int | None]:
    """Per option of ``block``'s menu, the highest segment checked at it (None: none is): its own
    replay segments moved by the option's deltas, every other one as it is (``checked``). A
    segment of ``lingering`` (segment -> positions in the block's ``lingering``) is lowered by
    the bytes of those values each option keeps (measured there already)."""
    menu = deltas.menus[block]
    special = [int(k) for k in mine if lingering and int(k) in lingering]
    if special:
        mine = mine[~np.isin(mine, special)]
    own = seg.own[mine] == block
    rest = checked[mine[~own]]
    fixed = int(rest.max()) if len(rest) else None
    tops = np.full(len(deltas.menus[block]), -math.inf if fixed is None else fixed, dtype=float)
    for phase in (0, 1, 2, 3):
        at = mine[own & (seg.phase[mine] == phase)]
        if len(at):
            positions = seg.unpack[at]
            m = deltas.matrix(block, phase, int(positions.max()) + 1)
            if not np.array_equal(positions, np.arange(m.shape[1])):  # else every column, in order
                m = m[:, positions]
            tops = np.maximum(tops, (m + seg.peak[at]).max(axis=1))
    for k in special:
        phase, unpack = int(seg.phase[k]), int(seg.unpack[k])
        if seg.own[k] == block and phase >= 0:
            values = deltas.matrix(block, phase, unpack + 1)[:, unpack] + seg.peak[k]
        else:
            values = np.full(len(menu), checked[k])
        assert lingering is not None  # special is empty without it
        values = values - np.array([sum(o.lingered(j) for j in lingering[k]) for o in menu])
        tops = np.maximum(tops, values)
    return [None if t == -math.inf else int(t) for t in tops.tolist()]


def menus_of(timeline: Timeline, regions: Mapping[str, RegionMenu]) -> list[list[Option]]:
    """Per timeline block, its region's options (the shared frontier), with the replay
    deltas simulated on the region's tape for blocks that ran its op sequence."""
    menus = []
    cache: dict[tuple, list[Option]] = {}
    for b in timeline.blocks:
        region = regions.get(b.region)
        if region is None:
            menus.append([Option(bytes=0, gain=0.0, point=0)])
            continue
        key = (
            (b.region, b.unpacks, b.taken, b.groups, b.lingering)
            if b.sequence == region.sequence
            else (b.region,)
        )
        if key not in cache:
            cache[key] = region.options(
                b.unpacks, b.taken, b.groups, simulate=len(key) > 1, lingering=b.lingering
            )
        menus.append(cache[key])
    return menus


@dataclass(frozen=True, kw_only=True)
class RegionMenu:
    """A region's frontier for the peak model: points' bytes (at the plan's tokens), gains, save
    sets (value ids of ``graph``), and ``scale`` from the graph's bytes to the plan's tokens."""

    sequence: str
    graph: PlanGraph
    bytes: tuple[int, ...]
    gains: tuple[float, ...]
    saved: tuple[frozenset[int], ...]
    scale: float = 1.0
    # Per point, how its block runs (empty: every point recorded). A plain or torch-checkpoint
    # point's set is everything autograd saves (``plain_demand``), ``plain_bytes`` its bytes.
    kinds: tuple[BlockKind, ...] = ()
    plain_bytes: int = 0

    def __post_init__(self) -> None:
        if (
            not (len(self.bytes) == len(self.gains) == len(self.saved))
            or not self.bytes
            or self.bytes[0] != 0
            or self.kinds
            and len(self.kinds) != len(self.bytes)
        ):
            raise ValueError(
                "a region menu needs one bytes, gain, set (and kind, if any) per point, the "
                "first at 0 bytes"
            )

    def kind(self, point: int) -> BlockKind:
        return self.kinds[point] if self.kinds else BlockKind.TAPE

    @functools.cached_property
    def forward_deltas(self) -> tuple[int, ...]:
        """Per point, how its block's own forward peak moves (<= 0): the set's bytes are counted
        from the forward's start, but at its peak only those made (and not freed anyway) by then
        exist. The same for every block of the region, whatever its unpacks."""
        graph = self.graph
        forward = forward_memory(graph, ())
        late = [
            forward_memory(graph, s) - forward - storages_bytes(graph, s) if s else 0
            for s in self.saved
        ]
        return tuple(min(0, math.ceil(x * self.scale)) for x in late)

    def options(
        self,
        unpacks: Sequence[int] = (),
        taken: Iterable[int] = (),
        groups: Sequence[int] = (),
        *,
        simulate: bool = True,
        lingering: Sequence[int] = (),
    ) -> list[Option]:
        """Every point as an option, with its forward-peak and replay-byte deltas simulated on
        the region's tape for the block's ``unpacks`` (``simulate=False``: none, for a block
        that ran another op sequence), and the bytes it keeps of the block's ``lingering``
        values (``Option.linger``)."""
        if not simulate:
            # Without its unpacks a torch-checkpoint block's backward is not simulated: it is
            # charged its plain bytes throughout, the bound a plain block has.
            return [
                Option(
                    bytes=self.plain_bytes if self.kind(i) is BlockKind.TORCH_CHECKPOINT else b,
                    gain=g,
                    point=i,
                )
                for i, (b, g) in enumerate(zip(self.bytes, self.gains))
            ]
        graph = self.graph
        base = replay_memory(graph, (), unpacks, taken, groups) if unpacks else None
        out = []
        for i, (b, g, s, forward) in enumerate(
            zip(self.bytes, self.gains, self.saved, self.forward_deltas)
        ):
            option = Option(bytes=b, gain=g, point=i, forward=forward)
            if lingering and self.kind(i) is not BlockKind.TORCH_CHECKPOINT:
                option = dataclasses.replace(option, linger=self._kept_of(s, lingering))
            if base is not None:
                mem = base if not s else replay_memory(graph, s, unpacks, taken, groups)
                option = dataclasses.replace(
                    option,
                    replay=tuple(
                        math.ceil((x - y) * self.scale) for x, y in zip(mem.replay, base.replay)
                    ),
                    compute=tuple(
                        math.ceil((x - y) * self.scale) for x, y in zip(mem.compute, base.compute)
                    ),
                )
                if self.kind(i) is not BlockKind.TAPE:
                    option = _freed_by_autograd(option, graph, s, unpacks, groups, self.scale)
                if self.kind(i) is BlockKind.TORCH_CHECKPOINT:
                    option = self._recomputed_at_first_unpack(option, s, base)
            elif self.kind(i) is BlockKind.TORCH_CHECKPOINT:
                option = dataclasses.replace(option, forward=0)
            out.append(option)
        return out

    def _kept_of(self, saved: frozenset[int], lingering: Sequence[int]) -> tuple[int, ...]:
        """Per value of ``lingering``, the bytes of its storage that keeping ``saved`` keeps
        (each storage once, none of those kept anyway), scaled down to the plan's tokens where
        fewer, never up: what is counted off must have been measured."""
        graph = self.graph
        storage, sizes = graph.value_storage, graph.storage_bytes
        kept = {storage[v] for v in saved} - graph.held_storages
        fixed: frozenset[int] = getattr(graph, "token_independent", frozenset())
        out: list[int] = []
        seen: set[int] = set()
        for v in lingering:
            s = storage[v] if 0 <= v < len(storage) else -1
            if s in kept and s not in seen:
                seen.add(s)
                scale = 1.0 if v in fixed else min(1.0, self.scale)
                out.append(math.floor(sizes[s] * scale))
            else:
                out.append(0)
        return tuple(out)

    def _recomputed_at_first_unpack(
        self, plain: Option, saved: frozenset[int], base: ReplayMemory
    ) -> Option:
        """The plain ``plain`` option as torch.utils.checkpoint runs the block: nothing kept
        from forward (inputs and S0 at most, which must-only keeps too); at the block's first
        unpack its forward runs again, its transients and every saved value alive as in forward
        (simulated to the tape's end: torch's early stop may end it sooner, which only holds
        less); from there on autograd frees them as it does a plain block's."""
        graph, scale = self.graph, self.scale
        # What the data may add beyond the reference's sizes (``plain_worst``) is held too.
        worst = max(0, self.plain_bytes - math.ceil(storages_bytes(graph, saved) * scale))
        recompute = math.ceil((forward_memory(graph, saved) - base.replay[0]) * scale) + worst
        held = self.plain_bytes
        replay = tuple(x + held for x in plain.replay)
        return dataclasses.replace(
            plain,
            bytes=0,
            forward=0,
            replay=(max(replay[0], recompute), *replay[1:]) if replay else (),
            compute=tuple(x + held for x in plain.compute),
            release=plain.release + held,
        )


def _freed_by_autograd(
    option: Option,
    graph: PlanGraph,
    saved: frozenset[int],
    unpacks: Sequence[int],
    groups: Sequence[int],
    scale: float,
) -> Option:
    """``option`` of a block run plain, whose saved values autograd frees in its backward: a
    storage once the node call (``groups`` entry; without groups, the unpack) that reads it
    last is done, not when the block is released as the tape's are (so none is left at the
    release of those read in the window)."""
    group = list(groups) if groups else list(range(len(unpacks)))
    storage, sizes = graph.value_storage, graph.storage_bytes
    last: dict[int, int] = {}
    for v, g in zip(unpacks, group):
        last[storage[v]] = g
    ours = {storage[v] for v in saved} - graph.held_storages
    # Storages of the set never unpacked in this window stay until the release.
    ends = sorted((last[s], sizes[s]) for s in ours if s in last)
    freed, done, j = [], 0, 0
    for g in group:
        while j < len(ends) and ends[j][0] < g:
            done += ends[j][1]
            j += 1
        freed.append(math.ceil(done * scale))
    return dataclasses.replace(
        option,
        replay=tuple(x - f for x, f in zip(option.replay, freed)),
        compute=tuple(x - f for x, f in zip(option.compute, freed)),
        release=-math.ceil(sum(size for _, size in ends) * scale),
    )
