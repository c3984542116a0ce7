"""The peak-aware memory model (plan's peak_timeline, simulate, peak, peak_dp and menus): pure
functions, exact numbers."""

import dataclasses
import itertools
import random

import pytest
from plan_graphs import random_options

from tapesac_core.plan import Graph
from tapesac_core.plan.menus import RegionMenu
from tapesac_core.plan.peak import Option, predict
from tapesac_core.plan.peak_dp import lowest_peak, solve_peak
from tapesac_core.plan.peak_timeline import (
    FORWARD_END,
    FORWARD_START,
    RELEASE,
    UNPACK_END,
    UNPACK_START,
    Event,
    Segment,
    Timeline,
    TimelineBlock,
    timeline_of,
)
from tapesac_core.plan.plan import BlockKind
from tapesac_core.plan.simulate import forward_memory, replay_memory


def _chain():
    # x -> a (10 B) -> b (20 B) -> c (40 B); backward reads a, b and c, in reverse order.
    return Graph(
        {"a": (1.0, 10, ["x"]), "b": (2.0, 20, ["a"]), "c": (4.0, 40, ["b"])},
        demand=["a", "b", "c"],
    )


def test_replay_memory_follows_replay_order_and_frees_at_last_read() -> None:
    g = _chain()
    a, b, c = (g.ids[n] for n in "abc")
    mo = replay_memory(g, (), [c, b, a])
    # Unpacking c replays a, b, c: a and b stay (read again later), c is handed to autograd.
    # While c's node runs: a + b + c = 70; then a + b live and c held by autograd (70).
    assert mo.replay == (70, 30, 10)
    assert mo.compute == (70, 30, 10)
    saved_b = replay_memory(g, {b}, [c, b, a])
    # b saved: c is replayed from b alone (40); a from x when unpacked (10).
    assert saved_b.replay == (40, 0, 10)
    assert saved_b.compute == (40, 0, 10)
    taken = replay_memory(g, (), [c, b, a], taken={c})
    # c alive elsewhere (a block output): nothing replayed for it.
    assert taken.replay == (0, 30, 10) and taken.compute == (0, 30, 10)


def test_replay_memory_holds_every_value_a_node_call_unpacked_until_it_has_computed() -> None:
    # One autograd node reads a and c = f(a), c not kept: replaying c for the second unpack
    # reads a for the last time, and replay lets go of it; the node still holds a (it
    # unpacked it) while it computes. (DeepSeek-V3's attention node unpacks q, k and v, then
    # its output, whose replay reads q, k and v last: metered 29 KiB above the prediction.)
    g = Graph({"a": (1.0, 10, ["x"]), "c": (4.0, 40, ["a"])}, demand=["a", "c"])
    a, c = g.ids["a"], g.ids["c"]
    one_call = replay_memory(g, (), [a, c], groups=[0, 0])
    assert one_call.replay == (10, 50) and one_call.compute == (10, 50)
    # Two node calls: the first one's hold on a ends before the second one's unpack.
    two_calls = replay_memory(g, (), [a, c], groups=[0, 1])
    assert two_calls.replay == (10, 50) and two_calls.compute == (10, 40)
    assert replay_memory(g, (), [a, c]).compute == (10, 40)


def test_forward_memory_keeps_saved_values_to_the_forward_end() -> None:
    g = _chain()
    a, b, c = (g.ids[n] for n in "abc")
    # Each value lives until its last read: the peak is while c is computed from b (20 + 40).
    assert forward_memory(g, ()) == 60
    assert forward_memory(g, {a}) == 70  # a is still alive then
    assert forward_memory(g, {c}) == 60  # c exists at that peak anyway
    menu = RegionMenu(
        sequence="s",
        graph=g,
        bytes=(0, 20, 80),  # at twice the graph's tokens
        gains=(0.0, 1.0, 2.0),
        saved=(frozenset(), frozenset({a}), frozenset({c})),
        scale=2.0,
    )
    # The block's own forward segment moves by what of its set is not alive at its peak.
    assert [o.forward for o in menu.options()] == [0, 0, -80]
    assert [o.forward for o in menu.options(simulate=False)] == [0, 0, 0]
    t = _timeline([100], [(0, 0)])
    forward = dataclasses.replace(t.segments[0], phase="forward", own=0, unpack=0)
    t = dataclasses.replace(t, segments=(forward,))
    assert [predict(t, [o]).peak for o in menu.options()] == [100, 120, 100]


def _timeline(peaks, first_last, own=None):
    segs = tuple(
        Segment(
            peak=p,
            first=f,
            last=last,
            phase="compute" if o is not None else "outside",
            own=o,
            unpack=0 if o is not None else None,
            label=f"s{k}",
        )
        for k, (p, (f, last), o) in enumerate(zip(peaks, first_last, own or [None] * len(peaks)))
    )
    n = 1 + max(last for _, last in first_last)
    return Timeline(
        tokens=1,
        static=0,
        segments=segs,
        blocks=tuple(TimelineBlock(region="r", index=i, sequence="s") for i in range(n)),
    )


def test_predict_counts_a_block_only_while_it_is_alive() -> None:
    # Three blocks; the loss segment holds all, block 2's window holds 0..2, block 0's only 0.
    t = _timeline(
        [100, 130, 120, 110, 90],
        [(0, 0), (0, 2), (0, 2), (0, 0), (1, 0)],
        own=[None, None, 2, 0, None],
    )
    opts = [
        Option(bytes=5, gain=1.0, point=1),
        Option(bytes=7, gain=1.0, point=1),
        Option(bytes=11, gain=1.0, point=1, compute=(-8,)),
    ]
    p = predict(t, opts)
    assert p.peak == 130 + 5 + 7 + 11 and p.label == "s1"
    # Eq. 8 would charge every byte at the must-only peak too; here block 0's window sees 5 only.
    assert predict(t, [Option(bytes=0, gain=0, point=0)] * 3).peak == 130


def test_solve_peak_is_exact_against_brute_force() -> None:
    rng = random.Random(7)
    for trial in range(40):
        n = rng.randint(1, 4)
        # Single micro-batch: forward segments 0..i, the loss, backward windows 0..j.
        ranges = (
            [(0, i) for i in range(n)]
            + [(0, n - 1)]
            + [(0, j) for j in reversed(range(n))]
            + [(1, 0)]
        )
        owns = [None] * (n + 1) + list(reversed(range(n))) + [None]
        peaks = [rng.randint(50, 100) for _ in ranges]
        t = _timeline(peaks, ranges, owns)
        menus = []
        for _ in range(n):
            opts = [Option(bytes=0, gain=0.0, point=0)]
            for p in range(1, rng.randint(1, 4)):
                opts.append(
                    Option(
                        bytes=opts[-1].bytes + rng.randint(1, 30),
                        gain=opts[-1].gain + rng.randint(1, 9),
                        point=p,
                        compute=(-rng.randint(0, 20),),
                    )
                )
            menus.append(opts)
        capacity = max(peaks) + rng.randint(0, 60)
        picks = solve_peak(t, menus, capacity, resolution=_span(menus))  # 1-byte units: exact
        best = max(
            (sum(menus[i][c].gain for i, c in enumerate(combo)), combo)
            for combo in itertools.product(*[range(len(m)) for m in menus])
            if predict(t, [menus[i][c] for i, c in enumerate(combo)]).peak <= capacity
        )
        got = [menus[i][c] for i, c in enumerate(picks)]
        assert predict(t, got).peak <= capacity
        assert sum(o.gain for o in got) == best[0], trial


def _windows_timeline(rng: random.Random, groups: int, blocks: int, unpacks: int) -> Timeline:
    """Micro-batches of ``blocks`` blocks each: forward segments, the loss, then per block (latest
    first) a replay and a compute segment per unpack, and a segment after its values are freed."""
    segs, n = [], groups * blocks
    for g in range(groups):
        lo = g * blocks
        segs += [
            Segment(peak=rng.randint(50, 100), first=lo, last=i, phase="forward", own=i, unpack=0)
            for i in range(lo, lo + blocks)
        ]
        segs.append(Segment(peak=rng.randint(50, 100), first=lo, last=lo + blocks - 1))
        for j in reversed(range(lo, lo + blocks)):
            segs += [
                Segment(peak=rng.randint(50, 100), first=lo, last=j, phase=phase, own=j, unpack=u)
                for u in range(unpacks)
                for phase in ("replay", "compute")
            ]
        segs.append(Segment(peak=rng.randint(30, 60), first=1, last=0))
    return Timeline(
        tokens=1,
        static=0,
        segments=tuple(segs),
        blocks=tuple(TimelineBlock(region="r", index=i, sequence="s") for i in range(n)),
    )


def test_solve_peak_is_exact_with_replay_deltas_and_micro_batches() -> None:
    """Several unpacks per window, replay and compute deltas (a saved value can lower a window
    below its must-only peak), forward deltas, two micro-batches: the DP's gain equals brute
    force's best."""
    rng = random.Random(11)
    for trial in range(60):
        groups, blocks, unpacks = rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 3)
        t = _windows_timeline(rng, groups, blocks, unpacks)
        menus = [random_options(rng, unpacks, rng.randint(2, 4)) for _ in t.blocks]
        capacity = max(s.peak for s in t.segments) + rng.randint(-30, 60)
        picks = solve_peak(t, menus, capacity, resolution=_span(menus))  # 1-byte units: exact
        fits = [
            (sum(menus[i][c].gain for i, c in enumerate(combo)), combo)
            for combo in itertools.product(*[range(len(m)) for m in menus])
            if predict(t, [menus[i][c] for i, c in enumerate(combo)]).peak <= capacity
        ]
        if not fits:
            assert picks is None, trial
            continue
        got = [menus[i][c] for i, c in enumerate(picks)]
        assert predict(t, got).peak <= capacity, trial
        assert sum(o.gain for o in got) == max(fits)[0], trial


def test_when_no_plan_fits_the_plan_of_the_lowest_predicted_peak_runs() -> None:
    """Block 1's window sets the must-only peak (150). Saving 10 bytes there removes 40 of its
    replay temporaries (120); saving 30 removes 45 (135); block 0's 5 bytes are alive in that
    window too (+5). Under a capacity of 100 nothing fits: the lowest peak, 120, runs."""
    t = _windows_timeline(random.Random(0), 1, 2, 1)
    t = Timeline(
        tokens=1,
        static=0,
        blocks=t.blocks,
        segments=(
            Segment(peak=90, first=0, last=0, phase="forward"),
            Segment(peak=100, first=0, last=1, phase="forward"),
            Segment(peak=100, first=0, last=1),  # the loss
            Segment(peak=150, first=0, last=1, phase="replay", own=1, unpack=0),  # block 1's window
            Segment(peak=110, first=0, last=0, phase="replay", own=0, unpack=0),  # block 0's window
            Segment(peak=40, first=1, last=0),
        ),
    )
    zero = Option(bytes=0, gain=0.0, point=0)
    menus = [
        [zero, Option(bytes=5, gain=1.0, point=1)],
        [
            zero,
            Option(bytes=10, gain=1.0, point=1, replay=(-40,)),
            Option(bytes=30, gain=3.0, point=2, replay=(-45,)),
        ],
    ]
    assert predict(t, [zero, zero]).peak == 150
    assert solve_peak(t, menus, 100) is None  # below every plan's peak
    picks = lowest_peak(t, menus, 100, resolution=4096)
    # Block 1 saves 10 (its window 150 + 10 - 40 = 120); block 0's 5 more would make it 125.
    assert picks == (0, 1) and predict(t, [m[c] for m, c in zip(menus, picks)]).peak == 120


def _span(menus) -> int:
    """The resolution of 1-byte units: the most bytes the menus can keep."""
    return max(1, sum(max(o.bytes for o in m) for m in menus))


def test_solve_peak_rounds_bytes_up_so_the_plan_fits() -> None:
    t = _timeline([100, 100], [(0, 0), (0, 1)])
    menus = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=7, gain=1.0, point=1)]] * 2
    assert solve_peak(t, menus, 114, resolution=4096) == (1, 1)
    assert solve_peak(t, menus, 113, resolution=4096) in ((0, 1), (1, 0))
    # One unit of 10 bytes: 5 bytes round up to it, and 13 bytes of room hold one unit.
    five = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=5, gain=1.0, point=1)]] * 2
    assert solve_peak(t, five, 113, resolution=1) in ((0, 1), (1, 0))
    assert solve_peak(t, five, 113, resolution=10) == (1, 1)
    assert solve_peak(_timeline([120, 100], [(1, 0), (0, 1)]), menus, 110) is None


def test_a_larger_capacity_never_picks_a_plan_of_less_gain() -> None:
    """The DP's unit comes from the menus, not the capacity: with units of the room above the
    lowest peak (before), 114 fit both 7-byte options in units of 7 and 115 only one, in units
    of 8. Over random timelines and capacities the best gain rises with the capacity."""
    t = _timeline([100, 100], [(0, 0), (0, 1)])
    sevens = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=7, gain=1.0, point=1)]] * 2
    assert solve_peak(t, sevens, 114, resolution=2) == solve_peak(t, sevens, 115, resolution=2)
    assert solve_peak(t, sevens, 115, resolution=2) == (1, 1)
    rng = random.Random(7)  # trials 0-39 include two the capacity-relative unit failed
    for trial in range(40):
        t = _windows_timeline(rng, rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 2))
        menus = []
        for _ in t.blocks:
            more = range(rng.randint(1, 4))
            sizes = [0, *itertools.accumulate(rng.randint(1, 3000) for _ in more)]
            gained = [0, *itertools.accumulate(rng.randint(1, 9) for _ in more)]
            deltas = [()] + [(rng.randint(-40, 5),) for _ in more]
            menus.append(
                [
                    Option(bytes=b, gain=float(g), point=i, replay=d)
                    for i, (b, g, d) in enumerate(zip(sizes, gained, deltas))
                ]
            )
        gains = []
        for capacity in range(100, 100 + 12000, 97):
            picks = solve_peak(t, menus, capacity, resolution=64)
            gains.append(-1.0 if picks is None else sum(m[c].gain for m, c in zip(menus, picks)))
        assert gains == sorted(gains), trial


def test_a_second_micro_batch_starts_from_freed_memory() -> None:
    # Micro-batch 1: blocks 0, 1; micro-batch 2: blocks 2, 3 (block 0, 1 freed before).
    t = _timeline([100, 100], [(0, 1), (2, 3)])
    menus = [[Option(bytes=0, gain=0.0, point=0), Option(bytes=10, gain=1.0, point=1)]] * 4
    assert solve_peak(t, menus, 120, resolution=120) == (1, 1, 1, 1)
    assert predict(t, [m[1] for m in menus]).peak == 120


def test_timeline_of_events_alive_ranges_and_labels() -> None:
    def ev(kind, b, peak, vid=None, current=0):
        return Event(kind=kind, block=b, peak=peak, current=current, vid=vid)

    events = [
        ev(FORWARD_START, 0, 10),
        ev(FORWARD_END, 0, 20),
        ev(FORWARD_START, 1, 21),
        ev(FORWARD_END, 1, 30),
        ev(UNPACK_START, 1, 50, 7),
        ev(UNPACK_END, 1, 45, 7),
        ev(RELEASE, 1, 44, current=42),
        ev(UNPACK_START, 0, 40, 3),
        ev(UNPACK_END, 0, 38, 3),
        ev(RELEASE, 0, 37, current=36),
    ]
    blocks = [TimelineBlock(region="r", index=i, sequence="s") for i in range(2)]
    t = timeline_of(events, blocks, tokens=8, static=5, end_peak=60, names=["L0", "L1"])
    got = [(s.peak, s.first, s.last, s.phase, s.own, s.unpack, s.label) for s in t.segments]
    assert got == [
        (10, 0, -1, "outside", None, None, "before the first block (embedding)"),
        (20, 0, 0, "forward", 0, 0, "forward of L0"),
        (21, 0, 0, "outside", None, None, "forward, after L0"),
        (30, 0, 1, "forward", 1, 0, "forward of L1"),
        (50, 0, 1, "outside", None, None, "between forward and backward (the loss)"),
        (45, 0, 1, "replay", 1, 0, "backward window of L1"),
        (44, 0, 1, "compute", 1, 0, "backward window of L1"),
        # The instant of a release still holds the block's values (bytes in use then); the
        # rest of the segment does not: a plan's bytes are not added to a later peak.
        (42, 0, 1, "releasing", 1, 0, "backward, as L1 frees its values"),
        (40, 0, 0, "outside", None, None, "backward, after L1 freed its values"),
        (38, 0, 0, "replay", 0, 0, "backward window of L0"),
        (37, 0, 0, "compute", 0, 0, "backward window of L0"),
        (36, 0, 0, "releasing", 0, 0, "backward, as L0 frees its values"),
        (60, 0, -1, "outside", None, None, "after backward (optimizer step)"),
    ]
    assert t.peak == 60 and t.scaled(115).peak == 115
    assert [s.peak for s in t.scaled(115).segments][:2] == [15, 35]  # 5 + (p - 5) * 2
    # A plan saving 100 bytes in L0 adds them up to its release, not to the optimizer's 60.
    saves = [Option(bytes=100, gain=1.0, point=1), Option(bytes=0, gain=0.0, point=0)]
    assert predict(t, saves).peak == 50 + 100  # at the loss; the optimizer's 60 + 100 before
    # A block whose values autograd frees in its window (a plain block) holds fewer at its own
    # release, and only there.
    plain = Option(bytes=100, gain=1.0, point=1, release=-90)
    assert [plain.delta(s) for s in t.segments if s.own == 1] == [0, 0, 0, -90]


def test_region_menu_options_carry_replay_deltas_scaled_to_tokens() -> None:
    g = _chain()
    menu = RegionMenu(
        sequence="s",
        graph=g,
        bytes=(0, 40),
        gains=(0.0, 3.0),
        saved=(frozenset(), frozenset({1})),
        scale=2.0,
    )
    base, saved = menu.options([2, 1, 0])
    assert base.replay == (0, 0, 0) and base.compute == (0, 0, 0)
    assert saved.replay == (-60, -60, 0) and saved.compute == (-60, -60, 0)
    with pytest.raises(ValueError, match="first at 0 bytes"):
        RegionMenu(sequence="s", graph=g, bytes=(5,), gains=(0.0,), saved=(frozenset(),))


def test_where_sizes_depend_on_data_recorded_options_are_credited_no_replay_bytes_removed() -> None:
    """The reference block's tape says saving b removes 60 B of replay at c's and b's unpacks;
    another block's expert may have had fewer tokens, so a region of data-dependent sizes is
    credited none of it. Its plain option keeps autograd's freeing (the worst bytes are held)."""
    g = _chain()
    every = frozenset(g.ids[n] for n in "abc")

    def options(data_factor):
        return RegionMenu(
            sequence="s",
            graph=g,
            bytes=(0, 40, 140),
            gains=(0.0, 3.0, 7.0),
            saved=(frozenset(), frozenset({g.ids["b"]}), every),
            kinds=(BlockKind.TAPE, BlockKind.TAPE, BlockKind.PLAIN),
            plain_bytes=140,
            scale=2.0,
            data_factor=data_factor,
        ).options([2, 1, 0])

    _, saved, plain = options(None)
    assert saved.replay == (-60, -60, 0)
    _, saved_worst, plain_worst = options(1.5)
    assert saved_worst.replay == saved_worst.compute == (0, 0, 0)
    assert (saved_worst.bytes, saved_worst.gain) == (saved.bytes, saved.gain)
    assert plain_worst == plain
    with pytest.raises(ValueError, match="data_factor"):
        options(0.5)


@pytest.mark.parametrize(
    ("sized", "credited"),
    [("", (-60, -60, 0)), ("c", (-60, -60, 0)), ("b", (-20, -20, 0)), ("abc", (0, 0, 0))]
    + [(None, (0, 0, 0))],
)
def test_where_sizes_depend_on_data_only_the_data_sized_storages_lose_their_credit(
    sized, credited
) -> None:
    """Saving b spares replaying a (10 B) and b (20 B) at c's and b's unpacks, times 2 for the
    tokens. Where c alone is sized by the data (an expert's output), c is replayed either way:
    the whole credit stands. Where b is, only a's 10 B are credited. Where all are, or the menu
    does not say which (None: every storage), none."""
    g = _chain()
    options = RegionMenu(
        sequence="s",
        graph=g,
        bytes=(0, 40),
        gains=(0.0, 3.0),
        saved=(frozenset(), frozenset({g.ids["b"]})),
        scale=2.0,
        data_factor=1.5,
        data_sized=None if sized is None else frozenset(g.value_storage[g.ids[n]] for n in sized),
    ).options([g.ids[n] for n in "cba"])
    assert options[1].replay == options[1].compute == credited


def test_a_torch_checkpoint_option_keeps_nothing_and_holds_the_plain_bytes_from_its_first_unpack():
    g = _chain()
    every = frozenset(g.ids[n] for n in "abc")
    c, b, a = (g.ids[n] for n in "cba")

    def options(plain_bytes):
        return RegionMenu(
            sequence="s",
            graph=g,
            bytes=(0, plain_bytes, 0),
            gains=(0.0, 2.0, 1.0),
            saved=(frozenset(), every, every),
            kinds=(BlockKind.TAPE, BlockKind.PLAIN, BlockKind.TORCH_CHECKPOINT),
            plain_bytes=plain_bytes,
        ).options([c, b, a])

    must_only, plain, checkpointed = options(70)
    # Plain: all 70 B from forward; autograd frees c, then b, as their nodes finish.
    assert (plain.bytes, plain.replay, plain.compute, plain.release) == (
        70,
        (-70, -70, -70),
        (-70, -70, -70),
        -70,
    )
    # Torch checkpoint: nothing from forward; at the first unpack the forward runs again and
    # holds what must-only's replay of the whole chain holds (70 B), then autograd frees alike.
    assert (checkpointed.bytes, checkpointed.forward) == (0, 0)
    assert checkpointed.replay == checkpointed.compute == (0, 0, 0)
    assert checkpointed.release == 0 and checkpointed.gain == 1.0
    # Sizes that depend on data: the worst block's 30 B beyond the reference are held too, from
    # the recompute on.
    _, _, worst = options(100)
    assert worst.replay == worst.compute == (30, 30, 30) and worst.release == 30
    # A block that ran another op sequence (not simulated) is charged its plain bytes throughout.
    assert (
        RegionMenu(
            sequence="s",
            graph=g,
            bytes=(0, 0),
            gains=(0.0, 1.0),
            saved=(frozenset(), every),
            kinds=(BlockKind.TAPE, BlockKind.TORCH_CHECKPOINT),
            plain_bytes=70,
        )
        .options(simulate=False)[1]
        .bytes
        == 70
    )


def test_a_state_above_the_room_over_the_lowest_segment_fits_where_deltas_lower_every_segment() -> (
    None
):
    """An option whose deltas and kept lingering bytes lower every segment it is checked at fits
    with more bytes than the room above the lowest segment's peak: the DP's states reach it
    (review: they stopped at that room, and the DP kept must-only where brute force fit)."""
    block = TimelineBlock(region="r", index=0, sequence="s", lingering=(5,))
    t = Timeline(
        tokens=1,
        static=0,
        segments=(
            Segment(peak=70, first=0, last=0, phase="forward", own=0, unpack=0),
            Segment(peak=80, first=0, last=0, lingering=((0, 0),)),
            Segment(peak=70, first=0, last=0, phase="replay", own=0, unpack=0),
        ),
        blocks=(block,),
    )
    keeps = Option(bytes=38, gain=1.0, point=1, forward=-38, replay=(-38,), linger=(35,))
    menu = [Option(bytes=0, gain=0.0, point=0), keeps]
    assert predict(t, [keeps]).peak == 83
    assert solve_peak(t, [menu], 84, resolution=38) == (1,)
