"""Measuring a sample step's memory timeline (the peak-aware model's input,
``plan.peak_timeline``).

A ``StepProbe`` reads a meter's ``mark()`` (peak since the previous mark, bytes in use now) at
each block event: forward start and end, before and after each unpack (its replay), when the
block's saved values are freed (the block object dies with autograd's last reference to it), and
when a storage of the block that outlived its forward is freed (``FREED``: attention weights the
caller drops after the next block, keys and values a cache keeps until the model returns).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._compat import current_autograd_node
from ..plan.peak_timeline import (
    FORWARD_END,
    FORWARD_START,
    FREED,
    RELEASE,
    UNPACK_END,
    UNPACK_START,
    Event,
    EventKind,
    Timeline,
    TimelineBlock,
    timeline_of,
)


class StepProbe:
    """Collects the events of one step; ``close`` ends it (later events are ignored)."""

    def __init__(self, mark: Callable[[], tuple[int, int]]) -> None:
        self._mark = mark
        self._when_freed = _free_watch(mark)
        self._watches: list[weakref.ref] = []  # where the meter cannot tell of frees itself
        self.events: list[Event] = []
        self.closed = False
        self.lingering: dict[int, tuple[int, ...]] = {}  # per block, values that outlived it

    def start(self) -> None:
        """The step starts: the first segment is measured from now."""
        self._mark()

    def event(
        self, kind: EventKind, block: int, vid: int | None = None, node: int | None = None
    ) -> None:
        if self.closed:
            return
        peak, current = self._mark()
        self.events.append(
            Event(kind=kind, block=block, peak=peak, current=current, vid=vid, node=node)
        )

    def watch(self, block: object, index: int) -> BlockProbe:
        """Start watching ``block`` (the ``index``-th of the step): its forward starts now; a
        RELEASE event when the object dies (autograd dropped its last reference)."""
        self.event(FORWARD_START, index)
        weakref.finalize(block, self.event, RELEASE, index)
        return BlockProbe(self, index)

    def linger(self, index: int, values: list[tuple[int, Any]]) -> None:
        """Block ``index``'s forward ended with these (value id, storage) alive that it does not
        hold: a FREED event when each storage is freed."""
        watched = []
        for vid, storage in values:
            freed = functools.partial(self.event, FREED, index, vid)
            if self._when_freed is None:
                # Runs before the meter counts the free: the segment after it then starts with
                # the storage counted, which can only make that segment read higher.
                self._watches.append(weakref.ref(storage, _calling(freed)))
            elif not self._when_freed(storage, freed):
                continue  # the meter does not count it: nothing of it was measured
            watched.append(vid)
        self.lingering[index] = tuple(watched)

    def close(self) -> int:
        """End the step: the peak since the last event."""
        peak, _ = self._mark()
        self.closed = True
        return peak

    def timeline(self, traces: list, end_peak: int, *, tokens: int, static: int) -> Timeline:
        """The timeline of the step whose blocks ``traces`` (``BlockTrace`` in forward order) are."""
        unpacks: list[list[int]] = [[] for _ in traces]
        groups: list[list[int]] = [[] for _ in traces]
        last: list[int | None] = [None] * len(traces)
        for e in self.events:
            if e.kind == UNPACK_START and e.block < len(traces):
                # Consecutive unpacks by one autograd node call form a group.
                same = e.node is not None and e.node == last[e.block]
                groups[e.block].append(
                    groups[e.block][-1] if same and groups[e.block] else len(groups[e.block])
                )
                last[e.block] = e.node
                assert e.vid is not None  # BlockProbe.unpack gives every unpack its value's id
                unpacks[e.block].append(e.vid)
        per_region: dict[str, int] = {}
        blocks: list[TimelineBlock] = []
        for t, order, group in zip(traces, unpacks, groups):
            region = t.tape.region
            blocks.append(
                TimelineBlock(
                    region=region,
                    index=per_region.get(region, 0),
                    sequence=t.tape.fingerprint,
                    unpacks=tuple(order),
                    taken=frozenset(t.alive_taken),
                    groups=tuple(group),
                    lingering=self.lingering.get(len(blocks), ()),
                )
            )
            per_region[region] = per_region.get(region, 0) + 1
        return timeline_of(
            self.events,
            blocks,
            tokens=tokens,
            static=static,
            end_peak=end_peak,
            names=[t.tape.name for t in traces],
        )


class BlockProbe:
    """One block's side of the probe."""

    __slots__ = ("probe", "index")

    def __init__(self, probe: StepProbe, index: int) -> None:
        self.probe, self.index = probe, index

    def forward_end(self, lingering: Sequence[tuple[int, Any]] = ()) -> None:
        """The forward ended; ``lingering``: (value id, storage) of the values that outlived it
        (``StepProbe.linger``)."""
        self.probe.event(FORWARD_END, self.index)
        if lingering:
            self.probe.linger(self.index, list(lingering))

    def unpack(self, vid: int, take: Callable[[], Any]) -> Any:
        # The autograd node unpacking (alive while it runs): its saved values are unpacked
        # together, then it computes with all of them.
        node = current_autograd_node()
        self.probe.event(UNPACK_START, self.index, vid, None if node is None else id(node))
        out = take()
        self.probe.event(UNPACK_END, self.index, vid)
        return out


def _calling(callback: Callable[[], Any]) -> Callable[[Any], None]:
    """A weak reference's callback that calls ``callback``."""

    def fire(_: Any) -> None:
        callback()

    return fire


def _free_watch(mark: Callable[..., Any]) -> Callable[[Any, Callable[[], Any]], bool] | None:
    """The ``when_freed`` of the meter whose ``mark`` the probe reads, where it has one: it
    calls back once it has counted the free, so the next segment starts without the storage."""
    return getattr(getattr(mark, "__self__", None), "when_freed", None)
