"""Offload as a block's third choice (issue 42): beside keeping or recomputing, a block may copy
what it holds to host memory after its forward and back ahead of its backward.

What it costs. The copy out runs while the next block in forward order computes its forward, the
copy back while the next block computes its backward window (the mechanism starts it at that
block's first unpack, ``tape/offload.py``); the part of each copy those windows cannot hide is
time added to the step. The copy out must be done by the end of the next block's forward, where
the peak model takes the block's memory as gone (``peak.near``), so what it cannot hide is waited
for there too. Each direction has its own bandwidth, measured (``Link``).

What it saves is the peak model's (``peak.Option.away``): away from its segments, the block holds
nothing on the device of what it alone holds, not even must-only (its inputs among it once the
next block has started); what something else holds too stays, and is counted so.

Python, no torch: menus, windows and a link in, menus out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .peak import Option


@dataclass(frozen=True, kw_only=True)
class Link:
    """Bandwidth between device and host memory, in bytes per second each way, as measured."""

    to_host: float
    to_device: float

    def __post_init__(self) -> None:
        for name in ("to_host", "to_device"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"Link.{name} must be a positive bandwidth in bytes/s, got {value}"
                )


@dataclass(frozen=True, kw_only=True)
class CopyWindow:
    """What surrounds one block's copies: the bytes offloading takes off it must-only (its S0
    and inputs that it alone holds, ``RegionProfile.offloaded_bytes``) and the seconds of the
    next block's forward and backward window, which hide its copy out and its copy back."""

    held: int
    next_forward: float
    next_backward: float

    def __post_init__(self) -> None:
        if self.held < 0 or self.next_forward < 0 or self.next_backward < 0:
            raise ValueError(f"a copy window needs bytes and seconds >= 0, got {self}")


def exposed_copy_time(nbytes: int, link: Link, window: CopyWindow) -> float:
    """Seconds copying ``nbytes`` out and back adds to the step: what the next block's forward
    does not hide of the copy out, and what its backward window does not hide of the copy back."""
    out = nbytes / link.to_host
    back = nbytes / link.to_device
    return max(0.0, out - window.next_forward) + max(0.0, back - window.next_backward)


# Options offered offloaded per block: the DP keeps one layer per offloading option of the block
# before (``peak_dp.solve_peak``), so their number multiplies its work.
OFFLOADED_POINTS = 4

# Seconds an offloading option gains less than the same option kept, beyond its exposed copy
# time: a tie-break, so that a block offloads only where that gains (the DP prefers fewer bytes
# among equal gains, and an offloaded option's copies hidden whole would tie with keeping).
TIE_BREAK = 1e-9


def too_slow(nbytes: int, link: Link, window: CopyWindow) -> bool:
    """Whether copying ``nbytes`` out and back would leave the step waiting on the link longer
    than the windows meant to hide the copies compute: such an offload is refused (the step
    would more than double around the block)."""
    return exposed_copy_time(nbytes, link, window) > window.next_forward + window.next_backward


# Host bytes a copied byte may take in the pool, at most: its buffers are powers of two.
POOL_ROUNDING = 2


def with_offload(
    menus: Sequence[Sequence[Option]],
    windows: Sequence[CopyWindow | None],
    link: Link | None,
    host_room: int | None = None,
) -> list[list[Option]]:
    """Each block's menu with, after its options, some of them offloaded (must-only and up to
    ``OFFLOADED_POINTS - 1`` more, spread over the menu up to its largest): the same bytes and
    replay, the gain less the exposed copy time (and ``TIE_BREAK``); not those ``too_slow``. A
    block without a window (none after it in its micro-batch to hide its copies), and every
    block without a link (no separate host memory, as on CPU), keeps its menu as it is. With
    ``host_room`` (bytes of host memory offloading may take), blocks offload in forward order
    while the most their options copy, at ``POOL_ROUNDING``, fits it all together: the earliest
    blocks, whose values wait longest for their backward."""
    if len(windows) != len(menus):
        raise ValueError(f"one window per menu: {len(menus)} menus, {len(windows)} windows")
    if link is None:
        return [list(m) for m in menus]
    out = []
    room = host_room
    for menu, window in zip(menus, windows):
        kept = [o for o in menu if not o.offload]
        moved = []
        if window is not None:
            moved = [
                dataclasses.replace(
                    o,
                    offload=True,
                    held=window.held,
                    gain=o.gain
                    - exposed_copy_time(o.bytes + window.held, link, window)
                    - TIE_BREAK,
                )
                for o in _spread(kept, OFFLOADED_POINTS)
                if not too_slow(o.bytes + window.held, link, window)
            ]
        if moved and room is not None:
            most = POOL_ROUNDING * max(o.bytes + o.held for o in moved)
            room = room - most if most <= room else -1
            if room < 0:
                moved = []
        out.append(kept + moved)
    return out


def refused_as_slow(windows: Sequence[CopyWindow | None], link: Link | None) -> int:
    """How many blocks could not offload even what they hold must-only: the link is
    ``too_slow`` for it."""
    if link is None:
        return 0
    return sum(w is not None and too_slow(w.held, link, w) for w in windows)


def _spread(options: Sequence[Option], count: int) -> list[Option]:
    """The first option, the last, and others evenly between: ``count`` at most."""
    if len(options) <= count:
        return list(options)
    last = len(options) - 1
    return [options[round(k * last / (count - 1))] for k in range(count)]
