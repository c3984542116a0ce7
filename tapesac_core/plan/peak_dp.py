"""The best plan under the predicted peak (``solve_peak``).

Blocks alive in one segment are a contiguous range in forward order (a micro-batch's blocks from
the first to the latest started), so the best plan under the predicted peak is an exact dynamic
program over blocks in forward order whose state is the bytes kept since the start of the
micro-batch.

Python and numpy, no torch: a timeline and menus in, choices out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .peak import Option, predict
from .peak_timeline import COMPUTE, FORWARD, RELEASING, REPLAY, Timeline


def solve_peak(
    timeline: Timeline, menus: Sequence[Sequence[Option]], capacity: int, resolution: int = 4096
) -> tuple[int, ...] | None:
    """Per block, the index into its menu maximising total gain with the predicted peak within
    ``capacity``; None when even the first option of every menu (must-only, 0 bytes) exceeds it.

    Exact dynamic program over blocks in forward order. Blocks whose alive ranges overlap form a
    group (a micro-batch); the state is the bytes kept by the group's blocks so far, in units of
    ``span / resolution`` (``span``: the most bytes the menus can keep, every block's largest
    option) with each option's bytes rounded up, so the result fits in true bytes. The unit does
    not depend on ``capacity``, so a larger capacity only admits more plans: the best gain never
    falls as the capacity rises, and among equal gains the fewest units win (monotone in the
    limit by construction; a capacity-relative unit rounded the same option differently at
    different limits). A segment is checked at its last alive block, with that block's own
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
    unit = _unit(menus, resolution)
    # No state above what every block's largest option keeps is reachable: a generous capacity
    # costs no more states than that.
    most = sum(-(-max(o.bytes for o in m) // unit) for m in menus)
    units = min(max(0, capacity - lowest) // unit, most) + 1
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


def _unit(menus: Sequence[Sequence[Option]], resolution: int) -> int:
    """Bytes per DP state: ``resolution`` units span the most bytes the menus can keep."""
    span = sum(max(o.bytes for o in m) for m in menus)
    return max(1, -(-span // resolution))


def lowest_peak(
    timeline: Timeline, menus: list[list[Option]], capacity: int, resolution: int
) -> tuple[int, ...]:
    """When no plan fits ``capacity``: the fastest plan among those of the lowest predicted peak
    (to 0.1% of the step's peak), by bisection on the capacity. Saving removes replay
    temporaries, so that is often well below must-only's peak, the upper end."""
    must_only = (0,) * len(menus)
    high = predict(timeline, [m[0] for m in menus]).peak
    low, best = capacity, must_only
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        picks = solve_peak(timeline, menus, middle, resolution=resolution)
        if picks is None:
            low = middle
        else:
            high, best = middle, picks
    return best


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
