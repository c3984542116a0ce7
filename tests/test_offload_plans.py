"""Offload as the planner's third choice (issue 42; ``plan/offload_choice.py``, ``plan/peak.py``,
``plan/peak_dp.py``): pure functions on synthetic timelines, link bandwidths and menus. The
exact DP against brute force over every combination, monotone in the limit, and plans below
must-only's peak that only offloading reaches."""

from __future__ import annotations

import itertools
import random

import pytest
from plan_graphs import random_options

from tapesac_core.plan.offload_choice import (
    POOL_ROUNDING,
    TIE_BREAK,
    CopyWindow,
    Link,
    exposed_copy_time,
    refused_as_slow,
    too_slow,
    with_offload,
)
from tapesac_core.plan.peak import Option, predict
from tapesac_core.plan.peak_dp import solve_peak
from tapesac_core.plan.peak_timeline import Segment, Timeline, TimelineBlock


def _micro_batches(rng: random.Random, groups: int, blocks: int, unpacks: int) -> Timeline:
    """Micro-batches of ``blocks`` blocks, one after another: per block its forward and the
    segment after it, the loss, then per block (latest first) a replay and a compute segment
    per unpack, its release and the segment after it."""
    segs: list[Segment] = []
    for g in range(groups):
        lo, hi = g * blocks, g * blocks + blocks - 1

        def peak() -> int:
            return rng.randint(50, 100)

        for i in range(lo, hi + 1):
            segs.append(Segment(peak=peak(), first=lo, last=i, phase="forward", own=i, unpack=0))
            segs.append(Segment(peak=peak(), first=lo, last=i))
        segs.append(Segment(peak=peak(), first=lo, last=hi, label="loss"))
        for j in reversed(range(lo, hi + 1)):
            segs += [
                Segment(peak=peak(), first=lo, last=j, phase=phase, own=j, unpack=u)
                for u in range(unpacks)
                for phase in ("replay", "compute")
            ]
            segs.append(Segment(peak=peak(), first=lo, last=j, phase="releasing", own=j, unpack=0))
            segs.append(Segment(peak=peak(), first=lo, last=j - 1))
    return Timeline(
        tokens=1,
        static=0,
        segments=tuple(segs),
        blocks=tuple(
            TimelineBlock(region="r", index=i, sequence="s") for i in range(groups * blocks)
        ),
    )


def _menus(rng: random.Random, timeline: Timeline, unpacks: int, blocks: int) -> list[list[Option]]:
    """Random kept options per block, each offered offloaded as well where a block follows it in
    its micro-batch, over a link fast enough to hide some copies and not others."""
    menus = [random_options(rng, unpacks, rng.randint(1, 3)) for _ in timeline.blocks]
    windows = [
        None
        if i % blocks == blocks - 1
        else CopyWindow(
            held=rng.randint(0, 60), next_forward=rng.uniform(0, 4), next_backward=rng.uniform(0, 8)
        )
        for i in range(len(menus))
    ]
    return with_offload(menus, windows, Link(to_host=10.0, to_device=20.0))


def _best_by_brute_force(timeline, menus, capacity):
    fits = [
        sum(menus[i][c].gain for i, c in enumerate(combo))
        for combo in itertools.product(*[range(len(m)) for m in menus])
        if predict(timeline, [menus[i][c] for i, c in enumerate(combo)]).peak <= capacity
    ]
    return max(fits) if fits else None


def _span(menus) -> int:
    """The resolution of 1-byte units."""
    return max(1, sum(max(max(o.bytes, o.held) for o in m) for m in menus))


def test_an_offloaded_block_counts_near_its_own_segments_and_minus_what_it_held_elsewhere() -> None:
    t = _micro_batches(random.Random(0), groups=1, blocks=3, unpacks=1)
    flat = Timeline(
        tokens=1,
        static=0,
        segments=tuple(Segment(**{**vars(s), "peak": 100}) for s in t.segments),
        blocks=t.blocks,
    )
    kept = Option(bytes=0, gain=0.0, point=0)
    first = Option(bytes=5, gain=1.0, point=1, offload=True, held=10)
    by_segment = []
    for k in range(len(flat.segments)):
        only = Timeline(tokens=1, static=0, segments=(flat.segments[k],), blocks=flat.blocks)
        by_segment.append(predict(only, [first, kept, kept]).peak - 100)
    # Block 0: its forward and the segment after it, block 1's forward (copy out), then away
    # (-10) until block 1's backward window (copy back), its own window and release, and after.
    assert by_segment == [
        5, 5,  # forward of block 0, after it
        5, -10,  # forward of block 1, after it
        -10, -10,  # forward of block 2, after it
        -10,  # the loss
        -10, -10, -10, -10,  # block 2's replay and compute, its release, after it
        5, 5, 5, 5,  # block 1's window and release (block 0 copied back), after it
        5, 5, 5, 0,  # block 0's window and release; nothing alive after
    ]  # fmt: skip


def test_the_exposed_copy_time_is_what_the_next_block_does_not_hide() -> None:
    link = Link(to_host=100.0, to_device=200.0)
    hidden = CopyWindow(held=0, next_forward=1.0, next_backward=1.0)
    assert exposed_copy_time(100, link, hidden) == 0.0
    assert exposed_copy_time(300, link, hidden) == pytest.approx(2.0 + 0.5)
    with pytest.raises(ValueError, match="positive bandwidth"):
        Link(to_host=0.0, to_device=1.0)


def test_without_a_link_menus_stay_as_they_are() -> None:
    """No separate host memory (CPU): no block is offered offload."""
    menus = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=4, gain=1.0, point=1)]] * 2
    windows = [CopyWindow(held=8, next_forward=1.0, next_backward=3.0), None]
    assert with_offload(menus, windows, None) == menus
    offered = with_offload(menus, windows, Link(to_host=4.0, to_device=4.0))
    assert [len(m) for m in offered] == [4, 2]
    # 8 bytes (held) take 2 s each way at 4 B/s, 1 s out and all back hidden; 12 bytes 3 s.
    assert [o.gain + TIE_BREAK for o in offered[0][2:]] == [0.0 - 1.0, 1.0 - 2.0]
    assert all(o.offload and o.held == 8 for o in offered[0][2:])


def test_a_link_too_slow_for_a_block_s_copies_offers_no_offload_there() -> None:
    """Copies that would leave the step waiting longer than the windows that hide them compute
    are refused: here 8 held bytes take 2 s each way against windows of 1 s each (exposed 2 s,
    not above the 2 s of windows); 12 bytes take 3 s (exposed 4 s)."""
    menus = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=4, gain=1.0, point=1)]]
    window = CopyWindow(held=8, next_forward=1.0, next_backward=1.0)
    link = Link(to_host=4.0, to_device=4.0)
    assert not too_slow(8, link, window) and too_slow(12, link, window)
    offered = with_offload(menus, [window], link)
    assert [(o.point, o.offload) for o in offered[0]] == [(0, False), (1, False), (0, True)]
    assert refused_as_slow([window, None], link) == 0
    slower = Link(to_host=2.0, to_device=2.0)
    assert with_offload(menus, [window], slower) == menus
    assert refused_as_slow([window, None], slower) == 1 and refused_as_slow([window], None) == 0


def test_blocks_offload_in_forward_order_while_their_copies_fit_the_host_room() -> None:
    menu = [Option(bytes=0, gain=0.0, point=0), Option(bytes=4, gain=1.0, point=1)]
    window = CopyWindow(held=6, next_forward=1.0, next_backward=1.0)
    link = Link(to_host=1e9, to_device=1e9)
    most = POOL_ROUNDING * (4 + 6)  # the largest option offloaded, its buffers rounded up

    def offloading(room):
        offered = with_offload([menu] * 3, [window, window, None], link, room)
        return [any(o.offload for o in m) for m in offered]

    assert offloading(None) == [True, True, False]
    assert offloading(2 * most) == [True, True, False]
    assert offloading(2 * most - 1) == [True, False, False]
    assert offloading(most - 1) == [False, False, False]
    assert offloading(0) == [False, False, False]


def test_solve_peak_with_offload_is_exact_against_brute_force() -> None:
    rng = random.Random(42)
    worst_gap = 0.0
    for trial in range(80):
        groups, blocks, unpacks = rng.randint(1, 2), rng.randint(2, 3), rng.randint(1, 2)
        t = _micro_batches(rng, groups, blocks, unpacks)
        menus = _menus(rng, t, unpacks, blocks)
        if sum(len(m) for m in menus) > 24:
            menus = [m[:4] for m in menus]
        capacity = max(s.peak for s in t.segments) + rng.randint(-60, 40)
        best = _best_by_brute_force(t, menus, capacity)
        picks = solve_peak(t, menus, capacity, resolution=_span(menus))  # 1-byte units: exact
        if best is None:
            assert picks is None, trial
            continue
        assert picks is not None, trial
        got = [menus[i][c] for i, c in enumerate(picks)]
        assert predict(t, got).peak <= capacity, trial
        assert sum(o.gain for o in got) == pytest.approx(best), trial
        coarse = solve_peak(t, menus, capacity)  # the default resolution fits, within 1%
        if coarse is not None:
            kept = [menus[i][c] for i, c in enumerate(coarse)]
            assert predict(t, kept).peak <= capacity, trial
            if best > 0:
                worst_gap = max(worst_gap, (best - sum(o.gain for o in kept)) / best)
    assert worst_gap <= 0.01


def test_offloading_reaches_below_must_only_and_plans_stay_monotone_in_the_limit() -> None:
    rng = random.Random(5)
    below = 0
    for trial in range(30):
        t = _micro_batches(rng, 1, rng.randint(2, 4), 1)
        menus = _menus(rng, t, 1, len(t.blocks))
        kept_only = [[o for o in m if not o.offload] for m in menus]
        must_only = predict(t, [m[0] for m in menus]).peak
        gains = []
        for capacity in range(must_only - 80, must_only + 120, 3):
            picks = solve_peak(t, menus, capacity, resolution=256)
            gains.append(-1e9 if picks is None else sum(m[c].gain for m, c in zip(menus, picks)))
            if capacity < must_only:
                assert solve_peak(t, kept_only, capacity, resolution=256) is None
                if picks is not None:
                    below += 1
                    chosen = [m[c] for m, c in zip(menus, picks)]
                    assert any(o.offload for o in chosen)
                    assert predict(t, chosen).peak <= capacity
        assert gains == sorted(gains), trial
    assert below > 0  # offloading made room below must-only's peak in some trials


def test_plans_fit_where_a_segment_replays_an_earlier_block_or_starts_later_in_its_group() -> None:
    """Segments the DP cannot check exactly: one replaying a block other than the latest alive
    (taken at that block's worst option, with what it and the block before take back if they
    offload), one whose first alive block is not its group's first (no block before it may
    offload). The DP's plans fit their predicted peak and never beat brute force."""
    rng = random.Random(3)
    for trial in range(60):
        blocks = rng.randint(2, 3)
        t = _micro_batches(rng, 1, blocks, 1)
        extra = []
        for _ in range(rng.randint(1, 3)):
            last = rng.randint(1, blocks - 1)
            if rng.random() < 0.5:
                own = rng.randint(0, last - 1)
                extra.append(
                    Segment(
                        peak=rng.randint(50, 100),
                        first=0,
                        last=last,
                        phase="replay",
                        own=own,
                        unpack=0,
                    )
                )
            else:
                extra.append(
                    Segment(peak=rng.randint(50, 100), first=rng.randint(1, last), last=last)
                )
        cut = rng.randint(0, len(t.segments))
        t = Timeline(
            tokens=1,
            static=0,
            segments=t.segments[:cut] + tuple(extra) + t.segments[cut:],
            blocks=t.blocks,
        )
        menus = _menus(rng, t, 1, blocks)
        capacity = max(s.peak for s in t.segments) + rng.randint(-60, 40)
        best = _best_by_brute_force(t, menus, capacity)
        picks = solve_peak(t, menus, capacity, resolution=_span(menus))
        if picks is None:
            continue
        got = [menus[i][c] for i, c in enumerate(picks)]
        assert predict(t, got).peak <= capacity, trial
        assert best is not None and sum(o.gain for o in got) <= best + 1e-9, trial


def test_what_the_caller_keeps_of_an_offloaded_block_stays_on_the_device_while_it_is_away() -> None:
    """A value of block 0 that outlived its forward (the caller keeps it: measured in the loss
    segment already) is not copied out: away, block 0 takes off only what it held (review)."""
    loss = Segment(peak=100, first=0, last=1, lingering=((0, 0),))
    t = Timeline(
        tokens=1,
        static=0,
        segments=(loss,),
        blocks=(TimelineBlock(region="r", index=0, sequence="s", lingering=(7,)),)
        + (TimelineBlock(region="r", index=1, sequence="s"),),
    )
    none = Option(bytes=0, gain=0.0, point=0)
    kept = Option(bytes=30, gain=1.0, point=1, linger=(30,))
    away = Option(bytes=30, gain=1.0, point=1, linger=(30,), offload=True, held=20)
    assert predict(t, [kept, none]).peak == 100  # its 30 bytes are the lingering value's
    assert predict(t, [away, none]).peak == 100 - 20


def test_segments_the_dp_does_not_take_for_a_block_s_own_are_not_its_own_in_predict() -> None:
    """An own-phase segment without an unpack position, and an outside segment naming a block,
    move by no option's deltas and take no offloaded block back, in ``predict`` as in the DP
    (review: the DP picked plans ``predict`` put over the capacity)."""
    none = Option(bytes=0, gain=0.0, point=0)
    blocks = tuple(TimelineBlock(region="r", index=i, sequence="s") for i in range(2))
    no_position = Timeline(
        tokens=1,
        static=0,
        segments=(
            Segment(peak=60, first=0, last=0, phase="forward", own=0, unpack=0),
            Segment(peak=100, first=0, last=1, phase="forward", own=1, unpack=None),
            Segment(peak=60, first=0, last=1, phase="replay", own=1, unpack=0),
            Segment(peak=60, first=0, last=0, phase="replay", own=0, unpack=0),
        ),
        blocks=blocks,
    )
    menus = [[none, Option(bytes=0, gain=1.0, point=0, offload=True, held=50)], [none]]
    picks = solve_peak(no_position, menus, 60, resolution=50)
    assert picks == (1, 0)
    assert predict(no_position, [m[c] for m, c in zip(menus, picks)]).peak <= 60
    outside = Timeline(
        tokens=1,
        static=0,
        segments=(Segment(peak=50, first=0, last=0, phase="outside", own=0, unpack=0),),
        blocks=blocks[:1],
    )
    grows = Option(bytes=5, gain=1.0, point=1, compute=(40,))
    assert predict(outside, [grows]).peak == 55
