"""Hysteresis for a bucket solved again: its previous plan's choice for a block is kept unless
another option gains clearly more than the noise in the estimates that priced both.

Profiles carry noise (timing on a busy host), so near-equal options swap places between solves
and a plan would move without a reason a user could see. When a bucket that had a plan is solved
again, the previous plan's save sets join the frontier where the new times no longer put them on
it (``with_previous_sets``), and each block's previous option enters the dynamic program with a
bonus of ``spread`` times the block's largest gain (``spread``: how far the region's blocks disagreed on its replay time,
``RegionProfile.replay_spread``). Only the choice is biased: the plan's predicted gain and peak
come from the options' own values.

Python only, no torch: a timeline, menus and a plan in; menus out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from .coords import ValueName
from .menus import RegionMenu
from .peak import Option
from .peak_timeline import Timeline
from .plan import BlockKind, Plan, RegionPlan
from .points import Point


def with_previous_sets(
    points: tuple[Point, ...],
    previous: RegionPlan | None,
    point_of: Callable[[frozenset[ValueName]], Point | None],
) -> tuple[Point, ...]:
    """``points`` (a frontier, the empty set first) and after it, by bytes, each set the recorded
    blocks of ``previous`` saved that is not among them: ``point_of`` prices a set at this solve's
    tokens (None where the tape no longer has its values). Not a frontier any more: the peak
    model's menus take any points; Eq. 8's knapsack needs a frontier and is given none of this."""
    if previous is None:
        return points
    known = {p.saved for p in points}
    extra = []
    for i, saved in enumerate(previous.blocks):
        if previous.kind(i) is BlockKind.TAPE and saved and saved not in known:
            known.add(saved)
            if (point := point_of(saved)) is not None:
                extra.append(point)
    if not extra:
        return points
    return (points[0], *sorted((*points[1:], *extra), key=lambda p: (p.bytes, p.time)))


def previous_points(
    timeline: Timeline, regions: Mapping[str, RegionMenu], previous: Plan
) -> list[tuple[int, bool] | None]:
    """Per timeline block, the point of its region's menu that ``previous`` chose for it and
    whether the block offloaded; None where the plan has no such block or its choice is not on
    the menu (the frontier moved)."""
    out: list[tuple[int, bool] | None] = []
    for b in timeline.blocks:
        menu, region = regions.get(b.region), previous.regions.get(b.region)
        if menu is None or region is None or b.index >= len(region.blocks):
            out.append(None)
            continue
        kind, saved = region.kind(b.index), region.blocks[b.index]
        point = next(
            (
                i
                for i in range(len(menu.bytes))
                if menu.kind(i) is kind
                and (kind is not BlockKind.TAPE or menu.saved_names[i] == saved)
            ),
            None,
        )
        offloaded = bool(region.offloaded) and region.offloaded[b.index]
        out.append(None if point is None else (point, offloaded))
    return out


def favour_previous(
    menus: Sequence[Sequence[Option]],
    points: Sequence[tuple[int, bool] | None],
    spreads: Sequence[float],
) -> list[list[Option]]:
    """``menus`` (one per timeline block) with each block's previous option (``points``: its
    point and whether it offloaded) gaining ``spreads`` (per block) times the block's largest
    gain more."""
    out = []
    for menu, point, spread in zip(menus, points, spreads):
        bonus = spread * max(o.gain for o in menu)
        out.append(
            [
                dataclasses.replace(o, gain=o.gain + bonus) if (o.point, o.offload) == point else o
                for o in menu
            ]
        )
    return out
