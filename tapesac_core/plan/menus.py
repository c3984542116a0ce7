"""Each block's choices for the peak model: its region's frontier points as options
(``RegionMenu``, ``menus_of``), with how each moves the block's own forward, replay and release
simulated on the region's tape.

Python, no torch: frontiers and a timeline in, options out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .model import PlanGraph, storages_bytes
from .peak import Option
from .peak_timeline import Timeline
from .plan import BlockKind
from .simulate import ReplayMemory, forward_memory, replay_memory


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
    # Where sizes depend on data (tokens routed to an expert), the replay bytes a save set moves
    # on the reference block need not be what it moves on another: on the storages of
    # ``data_sized`` (None: every storage) a recorded block is credited none of what its set
    # removes, and charged what it adds at ``data_factor`` times the reference's sizes (the
    # worst profiled block's); on the others the tape's own sizes hold (``_at_worst_sizes``).
    # None: the tape predicts its blocks.
    data_factor: float | None = None
    data_sized: frozenset[int] | None = None

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
        if self.data_factor is not None and self.data_factor < 1:
            raise ValueError(f"data_factor bounds sizes from above: >= 1, got {self.data_factor}")

    def kind(self, point: int) -> BlockKind:
        return self.kinds[point] if self.kinds else BlockKind.TAPE

    @functools.cached_property
    def saved_names(self) -> tuple[frozenset, ...]:
        """Per point, its save set by the graph's value names (as a plan records it)."""
        names = self.graph.value_names
        return tuple(frozenset(names[v] for v in s) for s in self.saved)

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
        # Must-only with the data-sized storages at no bytes (data-dependent regions only).
        fixed_base = None
        if base is not None and self.data_factor is not None:
            fixed_base = replay_memory(self._fixed_sizes, (), unpacks, taken, groups)
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
                elif fixed_base is not None:
                    option = self._at_worst_sizes(option, s, unpacks, taken, groups, fixed_base)
                if self.kind(i) is BlockKind.TORCH_CHECKPOINT:
                    option = self._recomputed_at_first_unpack(option, s, base)
            elif self.kind(i) is BlockKind.TORCH_CHECKPOINT:
                option = dataclasses.replace(option, forward=0)
            out.append(option)
        return out

    @functools.cached_property
    def _fixed_sizes(self) -> PlanGraph:
        """The graph with its data-sized storages (``data_sized``; None: all) at no bytes."""
        sized, sizes = self.data_sized, self.graph.storage_bytes
        fixed = tuple(0 if sized is None or s in sized else b for s, b in enumerate(sizes))
        return dataclasses.replace(self.graph, storage_bytes=fixed)

    def _at_worst_sizes(
        self,
        option: Option,
        saved: frozenset[int],
        unpacks: Sequence[int],
        taken: Iterable[int],
        groups: Sequence[int],
        fixed_base: ReplayMemory,
    ) -> Option:
        """A recorded ``option`` of a block whose sizes depend on data. Per unpack, its replay
        delta on the storages sized by the inputs alone, as simulated; whatever its delta on
        the reference block adds beyond that (the data-sized storages' part) charged at
        ``data_factor``, and never credited. Never below either delta."""
        factor, scale = self.data_factor, self.scale
        assert factor is not None
        fixed = (
            replay_memory(self._fixed_sizes, saved, unpacks, taken, groups) if saved else fixed_base
        )

        def worst(
            reference: Sequence[int], on_fixed: Sequence[int], must: Sequence[int]
        ) -> tuple[int, ...]:
            out = []
            for x, y, y0 in zip(reference, on_fixed, must):
                f = math.ceil((y - y0) * scale)
                out.append(f + max(0, math.ceil((x - f) * factor)))
            return tuple(out)

        return dataclasses.replace(
            option,
            replay=worst(option.replay, fixed.replay, fixed_base.replay),
            compute=worst(option.compute, fixed.compute, fixed_base.compute),
        )

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
