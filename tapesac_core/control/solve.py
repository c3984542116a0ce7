"""From region profiles and a byte budget to a Plan (Algorithm 1, lines 3-7)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ..config import TapeSACConfig
from ..measure.step_time import StepTime
from ..plan import Point, RegionFrontier, replay_time, saved_bytes, solve_knapsack
from ..plan.hysteresis import favour_previous, previous_points, with_previous_sets
from ..plan.menus import RegionMenu, menus_of
from ..plan.offload_choice import (
    CopyWindow,
    Link,
    exposed_copy_time,
    refused_as_slow,
    with_offload,
)
from ..plan.peak import Option, predict
from ..plan.peak_dp import lowest_peak, solve_peak
from ..plan.peak_timeline import Timeline
from ..plan.plan import BlockKind, Plan, RegionPlan, Saved
from ..tape.steady import tape_blocker
from ..units import format_bytes
from .profile import RegionProfile


def scaled(
    points: tuple[Point, ...], factor: float, bytes_at: Callable[[Point, float], int] | None = None
) -> tuple[Point, ...]:
    """A frontier at another token count: times scale linearly with tokens (§3.4.1), and so do
    sizes, or as ``bytes_at`` says (values that do not grow with tokens stay). Points another
    one now dominates are dropped, so the result is again a frontier."""
    size = bytes_at or (lambda p, f: math.ceil(p.bytes * f))
    moved = sorted(
        (Point(bytes=size(p, factor), time=p.time * factor, saved=p.saved) for p in points),
        key=lambda p: (p.bytes, p.time),
    )
    frontier: list[Point] = []
    for p in moved:
        if not frontier or p.time < frontier[-1].time and p.bytes > frontier[-1].bytes:
            frontier.append(p)
    return tuple(frontier)


def modelled_replay(profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int]) -> float:
    """Seconds of must-only replay in a step at ``tokens``, from the profiled node times (Eq. 6
    for S0, every block of each region, times scaled linearly with tokens)."""
    return math.fsum(
        p.blocks * p.must_only_replay_time * tokens[r] / p.tokens
        for r, p in profiles.items()
        if r in tokens
    )


def full_recompute_extra(profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int]) -> float:
    """Seconds full checkpointing adds to a must-only step at ``tokens``: each block recomputes
    its forward (Eq. 5) instead of replaying (Eq. 6), and its forward costs no recording or
    steady-state overhead (``RegionProfile.forward_overhead``)."""
    return math.fsum(
        p.blocks
        * (
            (p.full_recompute_time - p.must_only_replay_time) * tokens[r] / p.tokens
            - p.forward_overhead
        )
        for r, p in profiles.items()
        if r in tokens
    )


def _frontiers(
    profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int], config: TapeSACConfig
) -> dict[str, tuple[Point, ...]]:
    """Each region's frontier at ``tokens`` (``scaled``)."""
    return {
        r: scaled(
            p.frontier(config.beam_width, config.max_set_size), tokens[r] / p.tokens, p.bytes_at
        )
        for r, p in profiles.items()
    }


def solve_plan(
    profiles: Mapping[str, RegionProfile],
    tokens: Mapping[str, int],
    *,
    model: tuple[str, ...],
    capacity: int,
    base: int,
    must_only_step_time: float,
    config: TapeSACConfig,
    timeline: Timeline | None = None,
    torch_checkpoint_gains: Mapping[str, float] | None = None,
    previous: Plan | None = None,
    link: Link | None = None,
    host_room: int | None = None,
) -> Plan:
    """The plan maximising replay time removed with its predicted step peak ≤ capacity.

    With ``config.memory_model == "peak"`` and a ``timeline`` of a must-only sample step whose
    blocks match the profiles, the peak is the timeline model's (``plan.peak``: saved values
    alive from their block's forward to its backward, replay temporaries of the block that
    sets the peak from the set it saves), scaled so its must-only peak is ``base``; when no plan
    fits, the fastest of those with the lowest predicted peak (must-only for a limit of 0).
    Otherwise Eq. 8: Σ bytes ≤ capacity − base (nothing saved when base alone exceeds it).

    Under the timeline model a block may also run plain (``config.plain_blocks``) or under
    torch.utils.checkpoint where ``torch_checkpoint_gains`` names a region: the seconds per block
    that running so saves against must-only, positive (``torch_checkpoint_gains``).

    A bucket solved again (``previous``: its plan until now) keeps each block's previous option
    unless another gains clearly more, beyond the spread of the region's profiled replay times
    (``plan.hysteresis``; the timeline model only).

    Its predicted speedup comes from ``StepTime``: ``must_only_step_time`` minus the modelled
    must-only replay is the time outside replay (floored, see ``StepTime.model``), so the
    prediction is finite and at most must-only / outside, whatever the profiled times were.
    """
    frontiers = _frontiers(profiles, tokens, config)
    # The timeline model where its blocks match the profiles; else Eq. 8.
    timed = timeline if config.memory_model == "peak" and timeline is not None else None
    if timed is not None and not _matches(timed, profiles):
        timed = None
    if previous is not None and timed is not None:  # its menus take any points, not a frontier
        frontiers = {
            r: with_previous_sets(f, previous.regions.get(r), profiles[r].pricer(tokens[r]))
            for r, f in frontiers.items()
        }
    budget = capacity - base
    gains = torch_checkpoint_gains or {}
    extras = {r: _extra_kinds(config, gains.get(r, 0.0)) for r in profiles}
    peak = (
        _peak_choice(
            profiles,
            frontiers,
            tokens,
            timed,
            capacity,
            base,
            config,
            extras,
            gains,
            previous,
            link,
            host_room,
        )
        if timed is not None
        else None
    )
    choices: Mapping[str, tuple[int, ...]]
    offloaded: Mapping[str, tuple[bool, ...]] = {}
    offloaded_bytes, copy_time, refused = 0, 0.0, 0
    if peak is not None:
        choices, saved_bytes, gain = peak.choices, peak.saved_bytes, peak.gain
        predicted, peak_at = peak.predicted, peak.peak_at
        offloaded, offloaded_bytes, copy_time = peak.offloaded, peak.offloaded_bytes, peak.copy_time
        refused = peak.refused_as_slow
    else:
        choice = solve_knapsack(
            {r: RegionFrontier(points=f, blocks=profiles[r].blocks) for r, f in frontiers.items()},
            budget,
            resolution=config.knapsack_resolution,
        )
        choices, saved_bytes, gain = choice.choices, choice.bytes, choice.gain
        predicted, peak_at = base + saved_bytes, "the start of backward (Eq. 8 bound)"
    regions = {
        r: _region_plan(
            profiles[r],
            frontiers[r],
            choices[r],
            tokens[r],
            extras[r],
            torch_checkpoint_blocks=config.torch_checkpoint_blocks,
            offloaded=offloaded.get(r, ()),
        )
        for r in sorted(profiles)
    }
    full = full_recompute_extra(profiles, tokens)
    step = StepTime.of_step(must_only_step_time, modelled_replay(profiles, tokens))
    planned_time = step.planned(gain)
    speedup_vs_full = (step.must_only + full) / planned_time
    notes = _capacity_notes(base, capacity, predicted, saved_bytes) + full_faster_notes(
        speedup_vs_full, config
    )
    return Plan(
        model=model,
        regions=regions,
        capacity=capacity,
        base=base,
        saved_bytes=saved_bytes,
        predicted_speedup=step.speedup(gain),
        predicted_speedup_vs_full=speedup_vs_full,
        notes=notes,
        step_time=step.must_only,
        replay_time=step.replay,
        memory_model="peak" if peak is not None else "sum",
        predicted_peak=predicted,
        peak_at=peak_at,
        static=timeline.static if timeline is not None else 0,
        offloaded_bytes=offloaded_bytes,
        copy_time=copy_time,
        offload_refused=refused if predicted > capacity else 0,
    )


def _capacity_notes(base: int, capacity: int, predicted: int, saved: int) -> tuple[str, ...]:
    """What explain() says when the must-only step does not fit the capacity."""
    if base <= capacity:
        return ()
    head = (
        f"the must-only step needs {format_bytes(base)} of the {format_bytes(capacity)} the "
        "limit leaves"
    )
    if predicted > capacity:
        return (
            f"{head}, and no plan fits: this one has the lowest predicted peak, "
            f"{format_bytes(predicted)}"
            if saved
            else f"{head}: nothing more is saved",
        )
    return (
        f"{head}: this plan fits, its saved values remove more replay temporaries than they keep",
    )


def full_faster_notes(speedup_vs_full: float, config: TapeSACConfig) -> tuple[str, ...]:
    """What explain() says where full recomputation under torch's checkpoint is predicted
    faster than the plan, beyond the band predictions are trusted within (``speedup_band``),
    and plans may not run blocks so: how to let them, and at what risk."""
    if config.torch_checkpoint_blocks or speedup_vs_full >= 1 - config.speedup_band:
        return ()
    return (
        f"torch.utils.checkpoint on every block (full recomputation) is predicted "
        f"{1 / speedup_vs_full:.2f}x faster than this plan: checking each steady-state call's "
        "ops, or recording them, costs host time per op that torch's checkpoint does not. "
        "torch_checkpoint_blocks=True lets plans run blocks under it where measured faster "
        "and within the capacity (it runs a block's forward again in backward: a forward with "
        "side effects gets other gradients, docs/how-it-works.md)",
    )


def torch_checkpoint_gains(
    profiles: Mapping[str, RegionProfile],
    tokens: Mapping[str, int],
    must_only_step: float,
    full_step: float,
    modelled_must_only: float,
) -> dict[str, float]:
    """Per region, the seconds one block saves running under torch.utils.checkpoint instead of
    must-only, from measured steps: the median must-only step (``must_only_step``) against the
    median full-checkpointing one (``full_step``), as a share of the must-only step modelled at
    ``tokens``, shared among the blocks by their full recompute time (Eq. 5). Empty when the full
    step was not faster: no block gains."""
    saving = (1 - full_step / must_only_step) * modelled_must_only if must_only_step > 0 else 0
    weight = {r: p.full_recompute_time * tokens[r] / p.tokens for r, p in profiles.items()}
    total = sum(p.blocks * weight[r] for r, p in profiles.items())
    if saving <= 0 or total <= 0:
        return {}
    return {r: saving * weight[r] / total for r in profiles if weight[r] > 0}


def _extra_kinds(config: TapeSACConfig, torch_checkpoint_gain: float) -> tuple[BlockKind, ...]:
    """The options after a region's frontier, in this order: plain where the config allows it,
    torch.utils.checkpoint where it measured faster than must-only."""
    return (BlockKind.PLAIN,) * config.plain_blocks + (BlockKind.TORCH_CHECKPOINT,) * (
        torch_checkpoint_gain > 0
    )


def region_menus(
    profiles: Mapping[str, RegionProfile],
    frontiers: Mapping[str, tuple[Point, ...]],
    tokens: Mapping[str, int],
    extras: Mapping[str, tuple[BlockKind, ...]] | None = None,
    torch_checkpoint_gains: Mapping[str, float] | None = None,
) -> dict[str, RegionMenu]:
    """Each region's frontier (at ``tokens``) for the timeline model, and after it the options
    ``extras`` names for the region (``_with_extras``)."""
    menus = {}
    for r, points in frontiers.items():
        p = profiles[r]
        menu = RegionMenu(
            sequence=p.sequence,
            graph=p.graph,
            bytes=tuple(pt.bytes for pt in points),
            gains=tuple(points[0].time - pt.time for pt in points),
            saved=tuple(p.graph.value_ids(pt.saved) for pt in points),
            scale=tokens[r] / p.tokens,
            data_factor=p.data_factor,
            data_sized=p.data_sized_storages,
        )
        kinds = (extras or {}).get(r, ())
        gain = (torch_checkpoint_gains or {}).get(r, 0.0)
        menus[r] = _with_extras(menu, p, points, tokens[r], kinds, gain) if kinds else menu
    return menus


def _with_extras(
    menu: RegionMenu,
    profile: RegionProfile,
    points: tuple[Point, ...],
    tokens: int,
    kinds: tuple[BlockKind, ...],
    torch_checkpoint_gain: float,
) -> RegionMenu:
    """``menu`` with an option after its frontier per kind (from index ``len(points)``).
    Plain: the block keeps everything autograd saves, replays nothing, and saves its forward's
    overhead too (recording or steady state, ``RegionProfile.forward_overhead``), so it beats the frontier's last point wherever both fit. Torch checkpoint: it
    keeps nothing, recomputes its whole forward at its first unpack, and gains what measured
    steps say (``torch_checkpoint_gains``)."""
    plain = profile.plain_point
    plain_bytes = profile.bytes_at(plain, tokens / profile.tokens)
    gain = {
        BlockKind.PLAIN: _plain_gain(profile, points, tokens, torch_checkpoint_gain),
        BlockKind.TORCH_CHECKPOINT: torch_checkpoint_gain,
    }
    size = {BlockKind.PLAIN: plain_bytes, BlockKind.TORCH_CHECKPOINT: 0}
    return dataclasses.replace(
        menu,
        bytes=(*menu.bytes, *(size[k] for k in kinds)),
        gains=(*menu.gains, *(gain[k] for k in kinds)),
        saved=(*menu.saved, *(profile.graph.value_ids(plain.saved) for _ in kinds)),
        kinds=(BlockKind.TAPE,) * len(points) + kinds,
        plain_bytes=plain_bytes,
    )


def _plain_gain(
    profile: RegionProfile, points: tuple[Point, ...], tokens: int, torch_checkpoint_gain: float
) -> float:
    """What a plain block saves against must-only: its replay and its forward's overhead as
    profiled, and at least what a block under torch's checkpoint measured saving plus the
    forward that block runs again, which a plain block does not. Profiled op times leave out
    host time per replayed node, so the measured saving can exceed the modelled one; without
    the bound a plan would choose torch's checkpoint over a plain block that fits."""
    modelled = points[0].time + profile.forward_overhead
    if torch_checkpoint_gain <= 0:
        return modelled
    recompute = profile.full_recompute_time * tokens / profile.tokens
    return max(modelled, torch_checkpoint_gain + recompute)


def torch_checkpoint_peak(
    profiles: Mapping[str, RegionProfile],
    tokens: Mapping[str, int],
    timeline: Timeline,
    base: int,
    config: TapeSACConfig,
) -> int | None:
    """The predicted peak of a step with every block under torch.utils.checkpoint (what a
    full-checkpointing step that measures it reaches); None when the timeline's blocks do not
    match the profiles."""
    if not _matches(timeline, profiles):
        return None
    # Only the must-only point is needed beside the torch-checkpoint option.
    frontiers = {r: f[:1] for r, f in _frontiers(profiles, tokens, config).items()}
    checkpointed = {r: (BlockKind.TORCH_CHECKPOINT,) for r in profiles}
    scaled_timeline = timeline.scaled(base)
    menus = menus_of(
        scaled_timeline,
        region_menus(profiles, frontiers, tokens, checkpointed, dict.fromkeys(profiles, 1.0)),
    )
    return predict(scaled_timeline, [m[-1] for m in menus]).peak


def _matches(timeline: Timeline, profiles: Mapping[str, RegionProfile]) -> bool:
    """Whether the timeline has as many blocks of each region as its profile."""
    counts: dict[str, int] = {}
    for b in timeline.blocks:
        counts[b.region] = counts.get(b.region, 0) + 1
    return all(counts.get(r, 0) == p.blocks for r, p in profiles.items())


class PeakChoice(NamedTuple):
    """A plan under the timeline model: per region the menu option of each block, the bytes
    saved, the replay seconds removed (less the copies' exposed time), the predicted step peak
    and where in the step it falls; per region whether each block offloads, the bytes the
    offloading blocks copy out and the seconds their copies add after overlap."""

    choices: dict[str, tuple[int, ...]]
    saved_bytes: int
    gain: float
    predicted: int
    peak_at: str
    offloaded: dict[str, tuple[bool, ...]]
    offloaded_bytes: int
    copy_time: float
    refused_as_slow: int  # blocks the link is too slow to offload even must-only


def _peak_choice(
    profiles: Mapping[str, RegionProfile],
    frontiers: Mapping[str, tuple[Point, ...]],
    tokens: Mapping[str, int],
    timeline: Timeline,
    capacity: int,
    base: int,
    config: TapeSACConfig,
    extras: Mapping[str, tuple[BlockKind, ...]],
    torch_checkpoint_gains: Mapping[str, float],
    previous: Plan | None,
    link: Link | None,
    host_room: int | None,
) -> PeakChoice:
    """The plan under the timeline model, whose blocks match the profiles (``_matches``)."""
    scaled_timeline = timeline.scaled(base)
    regions = region_menus(profiles, frontiers, tokens, extras, torch_checkpoint_gains)
    windows = copy_windows(scaled_timeline, profiles, tokens)
    menus = _with_offload(
        menus_of(scaled_timeline, regions),
        scaled_timeline,
        profiles,
        regions,
        windows,
        link,
        host_room,
    )
    biased = menus
    if previous is not None:  # solved again: a change must beat the profiles' noise
        spreads = [
            profiles[b.region].replay_spread if b.region in profiles else 0.0
            for b in timeline.blocks
        ]
        points = previous_points(scaled_timeline, regions, previous)
        biased = favour_previous(menus, points, spreads)
    picks = solve_peak(scaled_timeline, biased, capacity, resolution=config.knapsack_resolution)
    if picks is None:  # a limit of 0 asks for must-only, any other for the least memory
        picks = (
            (0,) * len(menus)
            if config.parsed_memory_limit.must_only
            else lowest_peak(scaled_timeline, menus, capacity, config.knapsack_resolution)
        )
    options = [m[c] for m, c in zip(menus, picks)]
    prediction = predict(scaled_timeline, options)
    choices: dict[str, list[int]] = {r: [0] * p.blocks for r, p in profiles.items()}
    offloaded: dict[str, list[bool]] = {r: [False] * p.blocks for r, p in profiles.items()}
    copied, copy_time = 0, 0.0
    for b, o, window in zip(timeline.blocks, options, windows):
        if b.region in choices:
            choices[b.region][b.index] = o.point
            offloaded[b.region][b.index] = o.offload
        if o.offload and link is not None and window is not None:
            copied += o.bytes + o.held
            copy_time += exposed_copy_time(o.bytes + o.held, link, window)
    return PeakChoice(
        choices={r: tuple(c) for r, c in choices.items()},
        saved_bytes=sum(o.bytes for o in options),
        gain=math.fsum(o.gain for o in options),
        predicted=prediction.peak,
        peak_at=prediction.label,
        offloaded={r: tuple(f) for r, f in offloaded.items() if any(f)},
        offloaded_bytes=copied,
        copy_time=copy_time,
        refused_as_slow=refused_as_slow(windows, link),
    )


def copy_windows(
    timeline: Timeline, profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int]
) -> list[CopyWindow | None]:
    """Per timeline block, what hides its copies: the next block's forward as profiled, for its
    copy out and, a lower bound on that block's backward window, for its copy back; and the
    bytes the block holds must-only that offloading takes off (``offloaded_bytes``). None for
    the last block and blocks of no profiled region."""
    seconds = {r: p.forward_seconds(tokens[r]) for r, p in profiles.items()}
    blocks = timeline.blocks
    out: list[CopyWindow | None] = []
    for i, b in enumerate(blocks):
        after = blocks[i + 1].region if i + 1 < len(blocks) else ""
        if b.region not in profiles or after not in profiles:
            out.append(None)
            continue
        held = profiles[b.region].offloaded_bytes(tokens[b.region], b.index)
        out.append(CopyWindow(held=held, next_forward=seconds[after], next_backward=seconds[after]))
    return out


def _offloadable_points(profile: RegionProfile, menu: RegionMenu) -> frozenset[int]:
    """The points of ``menu`` a block may offload: recorded, their sets on no storage of the
    block's outputs or of values backward takes alive."""
    graph, tape = menu.graph, profile.tape
    outside = {graph.value_storage[v] for v in tape.outputs | profile.alive}
    return frozenset(
        i
        for i, saved in enumerate(menu.saved)
        if menu.kind(i) is BlockKind.TAPE
        and not any(graph.value_storage[v] in outside for v in saved)
    )


def _with_offload(
    menus: list[list[Option]],
    timeline: Timeline,
    profiles: Mapping[str, RegionProfile],
    regions: Mapping[str, RegionMenu],
    windows: list[CopyWindow | None],
    link: Link | None,
    host_room: int | None,
) -> list[list[Option]]:
    """``menus`` with offloading options after each block's own (``with_offload``), of its
    recorded points only (a plain block or one under torch's checkpoint has no tape to offload
    from) whose sets keep nothing on a storage that stays on the device: the block's outputs'
    and those backward takes alive (``_offloadable_points``; the mechanism copies only what the block alone
    holds)."""
    offloadable = {
        r: _offloadable_points(profiles[r], m) for r, m in regions.items() if r in profiles
    }
    recorded = [
        [o for o in menu if b.region in offloadable and o.point in offloadable[b.region]]
        for menu, b in zip(menus, timeline.blocks)
    ]
    moved = with_offload(recorded, windows, link, host_room)
    return [menu + m[len(r) :] for menu, r, m in zip(menus, recorded, moved)]


def _region_plan(
    profile: RegionProfile,
    points: tuple[Point, ...],
    chosen: tuple[int, ...],
    tokens: int,
    extras: tuple[BlockKind, ...],
    *,
    torch_checkpoint_blocks: bool,
    offloaded: tuple[bool, ...] = (),
) -> RegionPlan:
    graph = profile.graph
    menu = (BlockKind.TAPE,) * len(points) + extras  # the options after the frontier
    kinds = tuple(menu[i] for i in chosen)
    plain = tuple(k is BlockKind.PLAIN for k in kinds)
    recorded = tuple(k is BlockKind.TAPE for k in kinds)
    blocks = tuple(points[i].saved if r else frozenset() for i, r in zip(chosen, recorded))
    anchors = tuple(frozenset(graph.produced(v)[1] for v in graph.value_ids(b)) for b in blocks)
    modules = {a.module: graph.module_digests[a.module] for b in anchors for a in b}
    others = len(blocks) - sum(profile.shares_reference)
    notes = []
    if others:
        notes.append(
            f"{others} of {len(blocks)} blocks ran another op sequence (data-dependent control "
            "flow): they save what the plan names in submodules whose ops match the reference "
            "block's (anchored coordinates)"
        )
    if any(plain) and profile.data_dependent:
        notes.append(
            "saved sizes depend on data: a plain block is given the bytes of the most any block "
            "of the region kept when profiled"
        )
    if any(recorded) and profile.data_factor is not None:
        notes.append(
            f"replay sizes depend on data: on the {len(profile.data_sized_storages)} of its "
            f"{len(profile.graph.storage_bytes)} storages whose sizes follow the data, its "
            "recorded blocks are credited none of the replay bytes their saved values remove on "
            f"the reference block, and charged what they add at {profile.data_factor:.2f}x its "
            "sizes (the largest block profiled); the others are priced at the reference's sizes"
        )
    blocker = tape_blocker(profile.tape)
    if any(recorded) and blocker is not None:
        notes.append(f"its recorded blocks record every call, not only the first: {blocker}")
        if not torch_checkpoint_blocks:
            # Recording every call costs host time per op that torch's checkpoint does not.
            notes.append(
                "torch_checkpoint_blocks=True would measure torch.utils.checkpoint, which records "
                "nothing, on this region and run its blocks so where faster"
            )
    if BlockKind.TORCH_CHECKPOINT in kinds:
        notes.append(
            f"torch checkpoint: {kinds.count(BlockKind.TORCH_CHECKPOINT)} of its {len(kinds)} "
            "blocks run under torch.utils.checkpoint, which measured faster than must-only here "
            "and fits the capacity"
        )
    note = "; ".join(notes)
    largest = points[max((i for i in chosen if i < len(points)), default=0)]
    return RegionPlan(
        sequence=profile.sequence,
        blocks=blocks,
        tokens=tokens,
        saved=_describe(profile, largest, tokens / profile.tokens),
        note=note,
        block_bytes=tuple(
            profile.bytes_at(profile.plain_point, tokens / profile.tokens)
            if p
            else points[i].bytes
            if r
            else 0
            for i, p, r in zip(chosen, plain, recorded)
        ),
        anchors=anchors,
        modules=modules,
        kinds=kinds if not all(recorded) else (),
        offloaded=offloaded,
    )


def _describe(profile: RegionProfile, point: Point, factor: float) -> tuple[Saved, ...]:
    """Each value of a save set: bytes, and replay time it removes given the rest of the set."""
    graph = profile.graph
    saved = graph.value_ids(point.saved)
    whole = replay_time(graph, saved)
    rows = []
    for vid in sorted(saved):
        grows = vid not in graph.token_independent
        coord, anchor = graph.produced(vid)
        rows.append(
            Saved(
                coord=coord,
                module=anchor.module or None,  # "": the block's own op
                bytes=math.ceil(saved_bytes(graph, [vid]) * (factor if grows else 1)),
                time_removed=(replay_time(graph, saved - {vid}) - whole) * factor,
            )
        )
    return tuple(rows)
