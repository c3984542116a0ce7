"""Profiling on the training step (paper §3.4.1): one reference block per region type and its
node times (the must-only step's memory at the token counts seen: ``memory_model``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..measure.timing import seconds
from ..plan import Point, replay_time, saved_bytes, solve_frontier
from ..plan.coords import ValueName
from ..plan.tape_graph import TapeGraph, graph_of
from ..tape.block import BlockTrace
from ..tape.steady import savable_values
from ..tape.tape import DYNAMIC_SHAPE, OP, Tape

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RegionProfile:
    """A region type's model: its reference block's tape and times, and which blocks share it."""

    region: str
    tape: Tape
    tokens: int
    node_time: dict[int, float]  # replayed under must-only, seconds (see region_profiles, merged)
    forward_time: dict[int, float]  # every node, in forward, seconds (likewise)
    shares_reference: tuple[bool, ...]  # per block of the region, forward order
    # Seconds a block's recording costs beyond its ops (bookkeeping per op, measured on CPU
    # profile steps; 0 elsewhere): what a plain block saves on top of its replay.
    recording_overhead: float = 0.0
    # Seconds a block run in steady state costs beyond its ops (its saved-tensor hooks), and
    # the share of the region's recent blocks that ran so (``with_forward_paths``, on CPU).
    steady_overhead: float = 0.0
    steady_share: float = 0.0
    # The most bytes a block of the region kept or would keep run plain, over every block
    # profiled (``plain_bytes``): where sizes depend on data (tokens routed to an expert) a
    # block can keep more than the reference; 0 leaves the reference's bytes.
    plain_worst: int = 0
    # Values of the reference block backward took alive when profiled (``BlockTrace.alive_taken``):
    # alive at its backward whatever the plan, so running the block plain keeps them at no cost.
    alive: frozenset[int] = frozenset()
    # How far the blocks that timed the op sequence disagree on its must-only replay time
    # (``_spread``): the noise in this profile's estimates, which a plan change must beat.
    replay_spread: float = 0.0
    # Values of the reference tape whose storage bytes differed between blocks that ran its op
    # sequence in one profiling step (same tokens): sized by the data (``_varied``).
    varied: frozenset[int] = frozenset()
    # Per block of the region, in forward order, the bytes of its inputs it alone held once the
    # next block started (``BlockTrace.inputs_alone``): a caller may keep one block's input
    # (Hugging Face models keep the first layer's, the embeddings) and not the others'. A block
    # past the tuple, or not measured, counts 0.
    inputs_alone: tuple[int, ...] = ()

    @property
    def forward_overhead(self) -> float:
        """Seconds a block's forward is expected to cost beyond its ops, by the paths its
        region's blocks took lately: recorded, or in steady state. What running a block plain or
        under torch's checkpoint saves on top of the replay."""
        share = self.steady_share
        return share * self.steady_overhead + (1 - share) * self.recording_overhead

    @property
    def data_dependent(self) -> bool:
        """Whether the region's saved sizes may depend on data: a block ran another op sequence
        (data-dependent control flow) or an op's output shape depends on values."""
        return not all(self.shares_reference) or DYNAMIC_SHAPE in self.tape.mandatory.values()

    @functools.cached_property
    def data_factor(self) -> float | None:
        """Where sizes depend on data (``data_dependent``), how far a block's may exceed the
        reference's: the worst profiled block's plain bytes over the reference's, at least 1.
        None where the reference's tape predicts every block."""
        if not self.data_dependent:
            return None
        reference = self._reference_plain[1]
        return max(1.0, self.plain_worst / reference) if reference else 1.0

    @property
    def data_sized(self) -> frozenset[int]:
        """Values of the reference tape whose sizes may differ on another block of the region:
        those the tape's ops make from data-sized values (``Tape.data_sized``), and those seen
        to differ (``varied``)."""
        return self.tape.data_sized | self.varied

    @functools.cached_property
    def data_sized_storages(self) -> frozenset[int]:
        """The storages of ``graph`` that ``data_sized`` values use (what the planner prices
        at the worst sizes), computed once per profile, not at each solve."""
        storage = self.graph.value_storage
        return frozenset(storage[v] for v in self.data_sized)

    @functools.cached_property
    def _reference_plain(self) -> tuple[set[int], int]:
        """What the reference block saves run plain (``plain_demand``), and its bytes."""
        demand = plain_demand(self.graph, self.tape, self.alive)
        return demand, saved_bytes(self.graph, demand)

    @functools.cached_property
    def plain_point(self) -> Point:
        """Running a block plain as a save set: everything autograd saves (``plain_demand``), no
        replay left, and the bytes of the region's worst block (``plain_worst``): what a block
        of data-dependent sizes may keep is bounded by the most any block kept when profiled."""
        demand, reference = self._reference_plain
        return Point(
            bytes=max(reference, self.plain_worst),
            time=0.0,
            saved=frozenset(self.graph.value_names[v] for v in demand),
        )

    @property
    def sequence(self) -> str:
        return self.tape.fingerprint

    @property
    def blocks(self) -> int:
        """m_r: the blocks of the region. Those whose op sequence differs from the reference's
        save by anchored coordinates, within the same bytes."""
        return len(self.shares_reference)

    @functools.cached_property
    def graph(self) -> TapeGraph:
        """The planner's model of the reference block: a plan keeps only what a steady-state
        call can hold, where its blocks can run in steady state."""
        return graph_of(self.tape, self.node_time, savable_values(self.tape))

    def frontier(self, beam_width: int, max_set_size: int) -> tuple[Point, ...]:
        """The Pareto frontier of the reference block at its own token count (cached)."""
        key = (beam_width, max_set_size)
        if key not in self._frontiers:
            self._frontiers[key] = solve_frontier(
                self.graph, beam_width=beam_width, max_set_size=max_set_size
            ).points
        return self._frontiers[key]

    def bytes_at(self, point: Point, factor: float) -> int:
        """A save set's bytes at ``factor`` times the reference's tokens: what grows with tokens
        scales linearly (§3.4.1); values that do not (``Tape.token_independent``) stay."""
        tape = self.tape
        fixed = tape.saved_bytes(self.graph.value_ids(point.saved) & tape.token_independent)
        return fixed + math.ceil((point.bytes - fixed) * factor)

    def pricer(self, tokens: int) -> Callable[[frozenset[ValueName]], Point | None]:
        """A save set's point at ``tokens`` (None where the tape lacks one of its values)."""
        graph, factor = self.graph, tokens / self.tokens

        def point(saved: frozenset[ValueName]) -> Point | None:
            if not saved <= graph.ids.keys():
                return None
            ids = graph.value_ids(saved)
            raw = Point(bytes=saved_bytes(graph, ids), time=replay_time(graph, ids), saved=saved)
            return Point(bytes=self.bytes_at(raw, factor), time=raw.time * factor, saved=saved)

        return point

    def offloaded_bytes(self, tokens: int, position: int) -> int:
        """What offloading takes off the device of the region's ``position``-th must-only block
        (in forward order) at ``tokens``: S0's storages that ops made, less those of the block's
        outputs and of values a must-only backward found alive (``alive``), which stay on the
        device (``tape/offload.py`` copies only storages nothing outside the block holds),
        scaled as ``bytes_at`` scales; and its inputs it alone held when the next block started,
        as measured (``inputs_alone``), scaled with tokens. Rounded down: a lower bound, as the
        peak model needs (it takes them off)."""
        alone = self.inputs_alone[position] if position < len(self.inputs_alone) else 0
        fixed, grows = self._held_made
        return fixed + math.floor((grows + alone) * tokens / self.tokens)

    @functools.cached_property
    def _held_made(self) -> tuple[int, int]:
        """The bytes of S0's storages ops made that offloading takes off (see
        ``offloaded_bytes``): those independent of tokens, and the others."""
        tape = self.tape
        outside = {tape.values[v].sid for v in tape.outputs | self.alive}
        held = {
            v
            for v in tape.mandatory
            if tape.values[v].kind is OP and tape.values[v].sid not in outside
        }
        fixed = tape.bytes_of(held & tape.token_independent)
        return fixed, tape.bytes_of(held) - fixed

    def forward_seconds(self, tokens: int) -> float:
        """A block's forward as profiled (its ops' times), at ``tokens``."""
        return math.fsum(self.forward_time.values()) * tokens / self.tokens

    @functools.cached_property
    def _frontiers(self) -> dict[tuple[int, int], tuple[Point, ...]]:
        return {}

    @property
    def must_only_replay_time(self) -> float:
        """Eq. 6 for the mandatory set alone, per block, seconds."""
        return replay_time(self.graph, ())

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


def plain_demand(graph: TapeGraph, tape: Tape, alive: Iterable[int] = ()) -> set[int]:
    """What a block run plain keeps: every value autograd saves (the demand set beyond S0 and
    the leaves), less those on the storages of ``alive``: values a must-only step found alive
    at the block's backward (``BlockTrace.alive_taken``), as a block output that is the next
    block's input is. Being an output is not enough: a caller may drop one before backward (the
    attention weights an eager attention returns), and then only autograd keeps it."""
    held = {tape.values[v].sid for v in alive}
    return {v for v in graph.demand - graph.available if tape.values[v].sid not in held}


def plain_bytes(tape: Tape, alive: Iterable[int] = ()) -> int:
    """The bytes a block would keep run plain, from its own tape (its own sizes), ``alive``
    as ``plain_demand`` takes it."""
    graph = graph_of(tape, {})
    return saved_bytes(graph, plain_demand(graph, tape, alive))


def _repeated(samples: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """Per node, the median over the blocks that timed it (one run each): with three or more
    blocks a single disturbed run cannot set a node's time; with two, the minimum keeps the
    undisturbed one (a busy host only ever adds time)."""
    nodes = {i for s in samples for i in s}
    out = {}
    for i in nodes:
        times = [s[i] for s in samples if i in s]
        out[i] = statistics.median(times) if len(times) > 2 else min(times)
    return out


def _spread(samples: Sequence[Mapping[int, float]]) -> float:
    """The median absolute deviation of the blocks' replay times over their median, each block's
    the sum over the nodes every block timed; 0 with fewer than two blocks (no second estimate).
    The median deviation, not the range: one disturbed block does not set it."""
    common = set.intersection(*(set(s) for s in samples)) if samples else set()
    totals = [math.fsum(s[i] for i in common) for s in samples]
    middle = statistics.median(totals) if len(totals) > 1 else 0.0
    if middle <= 0:
        return 0.0
    return statistics.median(abs(t - middle) for t in totals) / middle


def region_profiles(
    blocks: list[BlockTrace], tokens: Mapping[str, int]
) -> dict[str, RegionProfile]:
    """One profile per region from a profiling step's traces: the reference block's tape, and
    each node's time over every block that ran the reference's op sequence (``_repeated``)."""
    by_region: dict[str, list[BlockTrace]] = {}
    for b in blocks:
        by_region.setdefault(b.tape.region, []).append(b)
    profiles = {}
    for region, traces in by_region.items():
        common, _ = Counter(b.tape.fingerprint for b in traces).most_common(1)[0]
        reference = next(b for b in traces if b.tape.fingerprint == common)
        same = [b for b in traces if b.tape.fingerprint == common]
        replayed = [{i: min(map(seconds, s)) for i, s in b.node_times.items()} for b in same]
        profiles[region] = RegionProfile(
            region=region,
            tape=reference.tape,
            tokens=tokens[region],
            node_time=_repeated(replayed),
            forward_time=_repeated(
                [{i: seconds(s) for i, s in b.forward_times.items()} for b in same]
            ),
            shares_reference=tuple(b.tape.fingerprint == common for b in traces),
            recording_overhead=_recording_overhead(same),
            plain_worst=max(plain_bytes(b.tape, b.alive_taken) for b in traces),
            alive=frozenset(reference.alive_taken),
            replay_spread=_spread(replayed),
            varied=_varied([b.tape for b in same]),
            inputs_alone=_inputs_alone(traces),
        )
    return profiles


def _inputs_alone(traces: Sequence[BlockTrace]) -> tuple[int, ...]:
    """Per block of a region, by its place among the region's blocks in the step, the bytes of
    its inputs it alone held once the next block started (0 where not measured)."""
    alone = [0] * (max(b.position for b in traces) + 1)
    for b in traces:
        alone[b.position] = b.inputs_alone or 0
    return tuple(alone)


def _varied(tapes: Sequence[Tape]) -> frozenset[int]:
    """Values whose storage bytes differ between ``tapes`` (one op sequence, one step's tokens):
    the first tape's value ids. With one tape, or tapes whose values do not pair up, nothing
    was compared: every value."""
    reference, *others = tapes
    if not others or any(len(t.values) != len(reference.values) for t in others):
        return frozenset(v.vid for v in reference.values)
    return frozenset(
        v.vid
        for v in reference.values
        if any(
            reference.storage_bytes[v.sid] != t.storage_bytes[t.values[v.vid].sid] for t in others
        )
    )


def _recording_overhead(traces: list[BlockTrace]) -> float:
    """Median over blocks of their recorded forward's wall time beyond its ops' times."""
    excess = [
        max(0.0, b.forward_seconds - math.fsum(seconds(s) for s in b.forward_times.values()))
        for b in traces
        if b.forward_seconds is not None
    ]
    return statistics.median(excess) if excess else 0.0


def merged(old: RegionProfile | None, new: RegionProfile) -> RegionProfile:
    """Each node's shorter time over profiling steps of the same op sequence, the old step's
    times scaled linearly to the new step's token count first (times scale with tokens, §3.4.1),
    so that unequal token counts do not let the last step alone set the times."""
    if old is None or old.sequence != new.sequence:
        return new
    f = new.tokens / old.tokens
    keep = {i: min(t, old.node_time.get(i, t / f) * f) for i, t in new.node_time.items()}
    forward = {i: min(t, old.forward_time.get(i, t / f) * f) for i, t in new.forward_time.items()}
    return RegionProfile(
        region=new.region,
        tape=new.tape,
        tokens=new.tokens,
        node_time=keep,
        forward_time=forward,
        shares_reference=new.shares_reference,
        recording_overhead=min(old.recording_overhead, new.recording_overhead),
        # Measured on timed steps, not on profiling steps: kept until measured again.
        steady_overhead=old.steady_overhead,
        steady_share=old.steady_share,
        # The worst block over every profiling step, not the last step's alone.
        plain_worst=max(new.plain_worst, math.ceil(old.plain_worst * f)),
        alive=new.alive,
        # Either step's disagreement: the times kept are the shorter of two noisy estimates.
        replay_spread=max(old.replay_spread, new.replay_spread),
        # Seen to differ in any profiling step.
        varied=old.varied | new.varied,
        inputs_alone=new.inputs_alone,
    )


@dataclass(frozen=True)
class ReplayWall:
    """One block in a must-only step, as measured: which nodes its replay ran, for how long
    (wall seconds), at how many tokens of its region; whether its forward ran in steady state,
    and its wall seconds (on CPU)."""

    sequence: str
    replayed: tuple[int, ...]
    seconds: float
    tokens: int
    steady: bool = False
    forward_seconds: float | None = None


def replay_ratio(profile: RegionProfile, walls: Iterable[ReplayWall]) -> float | None:
    """Median over blocks of (measured replay wall time) / (sum of the profiled times of the nodes
    that block replayed, at its tokens), over blocks that ran the profile's op sequence; None
    when no block replayed a timed node."""
    ratios = []
    for w in walls:
        if w.sequence != profile.sequence:
            continue
        modelled = (
            sum(profile.node_time.get(i, 0.0) for i in w.replayed) * w.tokens / profile.tokens
        )
        if modelled > 0:
            ratios.append(w.seconds / modelled)
    return statistics.median(ratios) if ratios else None


def calibrated(
    profile: RegionProfile, walls: Iterable[ReplayWall], tolerance: float
) -> RegionProfile:
    """``profile`` if the sum of its replay node times agrees with the measured replay wall time
    (``replay_ratio``) within a factor ``1 + tolerance`` either way, else every node time (replay
    and forward) scaled by that ratio, with an info log: the profiling steps were disturbed
    (a busy host) or timing itself cost time. Uniform scaling keeps the plan; it fixes the
    predicted times."""
    ratio = replay_ratio(profile, walls)
    if ratio is None or 1 / (1 + tolerance) <= ratio <= 1 + tolerance:
        return profile
    logger.info(
        "TapeSAC: region %r's profiled replay node times sum to %.3g of the measured "
        "replay wall time (beyond the %.0f%% tolerance): scaling them by %.3g",
        profile.region,
        1 / ratio,
        100 * tolerance,
        ratio,
    )
    return dataclasses.replace(
        profile,
        node_time={i: t * ratio for i, t in profile.node_time.items()},
        forward_time={i: t * ratio for i, t in profile.forward_time.items()},
    )


def with_forward_paths(profile: RegionProfile, walls: Iterable[ReplayWall]) -> RegionProfile:
    """``profile`` with the share of recent blocks of its op sequence that ran in steady state,
    and their median wall time beyond the profiled forward op times (at their tokens)."""
    same = [w for w in walls if w.sequence == profile.sequence]
    if not same:
        return profile
    ops = math.fsum(profile.forward_time.values())
    excess = [
        max(0.0, w.forward_seconds - ops * w.tokens / profile.tokens)
        for w in same
        if w.steady and w.forward_seconds is not None
    ]
    share = sum(w.steady for w in same) / len(same)
    overhead = statistics.median(excess) if excess else profile.steady_overhead
    if (share, overhead) == (profile.steady_share, profile.steady_overhead):
        return profile
    return dataclasses.replace(profile, steady_share=share, steady_overhead=overhead)
