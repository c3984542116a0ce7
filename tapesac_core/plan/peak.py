"""The step's memory as it really moves: a peak-aware model of any plan's step peak (DESIGN,
"The step's memory, as it really moves"; paper §3.4.2, the window model).

A must-only sample step is measured as a timeline of segments (``peak_timeline``). A plan
changes that timeline in two ways:

* block ``i`` keeps ``x_i`` more bytes from its forward until it is freed (end of its backward
  window), so every segment in between rises by ``x_i``;
* in block ``j``'s backward window, replay holds other temporaries: the replay of the same
  unpacks is simulated on the tape for the must-only set and for the block's save set
  (``simulate``), and the segment moves by the difference;
* a block that offloads (``Option.offload``, issue 42) copies what it holds to host memory after
  its forward and back ahead of its backward, so it is on the device only near its own segments
  (``near``): elsewhere it adds minus what it held must-only (``Option.away``).

The predicted peak is the largest segment after both changes (``predict``); the best plan under
it is ``peak_dp.solve_peak``'s.

Python, no torch: timelines and options in, predictions out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .peak_timeline import COMPUTE, FORWARD, RELEASING, REPLAY, Segment, Timeline

# The phases of a block's own segments: its forward, its backward window, its release.
OWN_PHASES = (FORWARD, REPLAY, COMPUTE, RELEASING)


@dataclass(frozen=True, kw_only=True)
class Option:
    """One choice for a block: the bytes it keeps beyond S0, the replay time it removes, and
    how it moves the block's replay bytes at each unpack of its window (``replay``, ``compute``
    deltas against must-only; empty: not simulated, no change), its own forward's peak
    (``forward``: saved values made late in the forward are not yet alive at its peak), the
    instant of its release (``release``: a plain block's values autograd freed by then), and,
    per value of its block's ``TimelineBlock.lingering``, the bytes of it the option keeps
    (``linger``: already measured wherever the segment names it, ``Segment.lingering``). An
    ``offload`` option copies what the block holds, ``held`` bytes must-only and ``bytes`` more,
    to host memory while the block is away (``near``); its gain has the copy time the compute
    around it cannot hide taken off (``offload_choice.py``)."""

    bytes: int
    gain: float
    point: int
    replay: tuple[int, ...] = ()
    compute: tuple[int, ...] = ()
    forward: int = 0
    release: int = 0
    linger: tuple[int, ...] = ()
    offload: bool = False
    held: int = 0

    def __post_init__(self) -> None:
        if self.held < 0 or (self.held and not self.offload):
            raise ValueError(f"held bytes are those an offloading option moves, got {self}")

    @property
    def away(self) -> int:
        """What the block adds to a segment where it is alive but not near: an offloading
        block is on the host then, without even what it held must-only."""
        return -self.held if self.offload else self.bytes

    @property
    def back(self) -> int:
        """What an offloading block adds near its own segments beyond ``away`` (0 for others)."""
        return self.bytes + self.held if self.offload else 0

    def lingered(self, position: int) -> int:
        """The bytes of the ``position``-th lingering value this option keeps."""
        return self.linger[position] if position < len(self.linger) else 0

    def delta(self, segment: Segment) -> int:
        if segment.unpack is None or segment.phase not in OWN_PHASES:
            return 0  # not one of the block's own segments (the DP's ``_columns`` alike)
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
        prefix.append(prefix[-1] + o.away)
    best, where = -1, 0
    for k, s in enumerate(timeline.segments):
        value = s.peak + (prefix[s.last + 1] - prefix[s.first] if s.first <= s.last else 0)
        close = near(s)
        value += sum(options[b].back for b in close if s.first <= b)
        if s.own is not None:
            value += options[s.own].delta(s)
        for i, j in s.lingering:
            # Away, an offloading block leaves on the device what the caller keeps alive too
            # (``tape/offload.py``): its ``away`` took off only what it held.
            if not options[i].offload or i in close:
                value -= options[i].lingered(j)
        if value > best:
            best, where = value, k
    return Prediction(peak=best, segment=where, label=timeline.segments[where].label)


def near(segment: Segment) -> tuple[int, ...]:
    """The blocks an offloading block is on the device for in ``segment`` (issue 42's mechanism):
    the latest started block (its copy out runs until the next block's forward is done); the
    block whose own segment it is, and the one before it in forward order, whose copy back
    starts at that block's first unpack, one block ahead."""
    if segment.first > segment.last:
        return ()
    own = segment.own
    if own is None or segment.unpack is None or segment.phase not in OWN_PHASES:
        return (segment.last,)
    return tuple(b for b in sorted({segment.last, own, own - 1}) if 0 <= b <= segment.last)
