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

    Offloading options (``Option.offload``) add what they hold off the device to the state
    (negative, rounded towards zero), and their bytes back where they are near (``peak.near``):
    at the block's own segments, known with its option, and at the next block's, known with the
    option of the block before (the state carries it: one layer per offloading option of the
    block before, and one for all its other options). A block offloads only where every
    segment after it in its group counts it alive (so counting the group from its start holds).
    """
    n = len(timeline.blocks)
    if len(menus) != n or any(not m or m[0].bytes != 0 or m[0].offload for m in menus):
        raise ValueError("one menu per timeline block, each starting with a 0-byte option")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    seg = _columns(timeline)
    deltas = _Deltas(menus)
    lingering = _own_lingering(timeline)
    back = [max([o.back for o in m if o.offload], default=0) for m in menus]
    # A segment replaying a block other than its last alive one is charged that block's worst
    # option (the DP only knows the last block's option when it checks the segment), and the
    # bytes it and the block before it take back if they offload.
    checked = seg.peak.copy()
    other = (seg.own >= 0) & (seg.own != seg.last)
    for k in np.flatnonzero(other):
        j = int(seg.own[k])
        checked[k] += deltas.worst(j, int(seg.phase[k]), int(seg.unpack[k])) + back[j]
        if j - 1 >= seg.first[k]:
            checked[k] += back[j - 1]
    alive = seg.first <= seg.last
    if (checked[~alive] > capacity).any():
        return None
    spans = alive & (seg.first < seg.last)
    opens = np.cumsum(
        np.bincount(seg.first[spans] + 1, minlength=n + 1)
        - np.bincount(seg.last[spans] + 1, minlength=n + 1)
    )
    joined = opens[:n] > 0  # block i shares a segment with block i - 1
    offloads = _may_offload(seg, alive, joined, n)
    unit = _unit(menus, resolution)
    weights = [[-(o.held // unit) if o.offload else -(-o.bytes // unit) for o in m] for m in menus]
    # State index ``low + u`` for a group's u units (u < 0: offloaded blocks hold less than
    # must-only). No state above what every block's largest option keeps is reachable. (Not
    # capped by the room above the lowest segment: an option's deltas and the lingering bytes
    # it keeps can lower every segment it is checked at, and a state above that room fits.)
    low = sum(-min(0, *w) for w, ok in zip(weights, offloads) if ok)
    most = sum(max(0, *w) for w in weights)
    units = low + most + 1
    order = np.flatnonzero(alive)
    order = order[np.argsort(seg.last[order], kind="stable")]
    bounds = np.searchsorted(seg.last[order], np.arange(n + 1))
    # Layers by the option of the block before: 0 for any that keeps its values on the device,
    # ``c + 1`` for its offloading option ``c``, which takes its bytes back at this block's own
    # segments.
    layers = {0: _start(units, low)}
    history = []  # per block: layers before it, its options, their limits, reset
    for i in range(n):
        reset = None
        if i > 0 and not joined[i]:
            # A new group: the earlier blocks' bytes are freed; continue from the best state.
            reset = _best(layers)
            layers = {0: _start(units, low, layers[reset[0]][reset[1]])}
        mine = order[bounds[i] : bounds[i + 1]]
        fixed, own = _tops(seg, checked, mine, i, deltas, lingering.get(i))
        backs = np.array([o.back for o in menus[i]], dtype=np.int64)
        limits = {}  # per layer before: each option's highest state whose segments fit
        for p in layers:
            top = np.maximum(fixed, own + (menus[i - 1][p - 1].back if p else 0))
            none = top == -math.inf  # no segment ends at this block
            head = capacity - np.where(none, 0, top).astype(np.int64) - backs
            limits[p] = np.where(none, units - 1, np.minimum(units - 1, low + head // unit))
        # States above the highest reachable one stay unreachable: skip them.
        high = {p: _high(layer) for p, layer in layers.items()}
        cur: dict[int, np.ndarray] = {}
        choices = []
        for c, (option, w) in enumerate(zip(menus[i], weights[i])):
            if option.offload and not offloads[i]:
                continue
            kind = c + 1 if option.offload else 0
            for p, layer in layers.items():
                lo, hi = max(0, w), min(int(limits[p][c]), high[p] + w, units - 1 + w)
                if hi >= lo:
                    into = cur.get(kind)
                    if into is None:
                        into = cur[kind] = _start(units, low, -math.inf)
                    np.maximum(
                        into[lo : hi + 1],
                        layer[lo - w : hi + 1 - w] + option.gain,
                        out=into[lo : hi + 1],
                    )
            choices.append((c, kind, w, option.gain))
        history.append((layers, choices, limits, reset))
        layers = cur
        if not layers or all(_high(layer) < 0 for layer in layers.values()):
            return None
    kind, state = _best(layers)
    value = layers[kind][state]
    picks = [0] * n
    for i in range(n - 1, -1, -1):
        before_layers, choices, limits, reset = history[i]
        found = None
        for c, its_kind, w, g in choices:
            if its_kind != kind:
                continue
            for p, layer in before_layers.items():
                if max(0, w) <= state <= min(int(limits[p][c]), units - 1 + w) and (
                    layer[state - w] + g == value
                ):
                    found = c, p, state - w
                    break
            if found is not None:
                break
        if found is None:  # pragma: no cover - the layer was built from these choices
            raise AssertionError("backtracking found no option")
        picks[i], kind, state = found
        value = before_layers[kind][state]
        if reset is not None:
            kind, state = reset
    return tuple(picks)


def _may_offload(seg: _Columns, alive: np.ndarray, joined: np.ndarray, n: int) -> list[bool]:
    """Per block, whether the DP may let it offload: a block after it in its group hides its
    copies, and every segment its group's later blocks are alive in counts it alive too (the
    DP counts a segment's group from the group's start, which only adds bytes where blocks keep
    theirs, and would take off those of an offloaded block that segment does not count)."""
    start = np.arange(n)
    for i in range(1, n):
        if joined[i]:
            start[i] = start[i - 1]
    ok = [i + 1 < n and bool(joined[i + 1]) for i in range(n)]
    late = alive & (seg.first > start[np.maximum(seg.last, 0)])
    for first, last in zip(seg.first[late].tolist(), seg.last[late].tolist()):
        for b in range(int(start[last]), first):
            ok[b] = False
    return ok


def _best(layers: Mapping[int, np.ndarray]) -> tuple[int, int]:
    """The layer and state of the best gain, the fewest units among equal gains."""
    best: tuple[float, int, int] | None = None
    for kind in sorted(layers):
        state = int(np.argmax(layers[kind]))
        value = float(layers[kind][state])
        if best is None or value > best[0] or (value == best[0] and state < best[2]):
            best = (value, kind, state)
    assert best is not None, "a DP has a layer"
    return best[1], best[2]


def _unit(menus: Sequence[Sequence[Option]], resolution: int) -> int:
    """Bytes per DP state: ``resolution`` units span the most bytes the menus can keep, or take
    off the device by offloading (so the states below none kept are as many at most)."""
    span = sum(max(max(o.bytes, o.held) for o in m) for m in menus)
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


def _start(units: int, zero: int, first: float = 0.0) -> np.ndarray:
    """A DP layer: the best gain per state, -inf where unreachable; ``first`` at state ``zero``
    (no bytes kept)."""
    values = np.full(units, -math.inf)
    values[zero] = first
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
) -> tuple[np.ndarray, np.ndarray]:
    """Per option of ``block``'s menu, the highest segment checked at it among the others'
    (``checked``, as they are) and among its own (its forward, replay and release, moved by the
    option's deltas); -inf where there is none. A segment of ``lingering`` (segment ->
    positions in the block's ``lingering``) is lowered by the bytes of those values each option
    keeps (measured there already)."""
    menu = deltas.menus[block]
    special = [int(k) for k in mine if lingering and int(k) in lingering]
    if special:
        mine = mine[~np.isin(mine, special)]
    own = seg.own[mine] == block
    rest = checked[mine[~own]]
    fixed = np.full(len(menu), float(rest.max()) if len(rest) else -math.inf)
    tops = np.full(len(menu), -math.inf)
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
        assert lingering is not None  # special is empty without it
        kept = np.array([sum(o.lingered(j) for j in lingering[k]) for o in menu])
        if seg.own[k] == block and phase >= 0:
            values = deltas.matrix(block, phase, unpack + 1)[:, unpack] + seg.peak[k]
            tops = np.maximum(tops, values - kept)
        else:
            fixed = np.maximum(fixed, checked[k] - kept)
    return fixed, tops
