"""Splitting one capacity among region types and their blocks: a multiple-choice
knapsack (paper Eq. 8, Algorithm 1 line 6), with per-block points (§3.4.3)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from .points import Point

# One choice of a block, on the discretized capacity: (weight in units, gain, point index).
_Choice = tuple[int, float, int]


@dataclass(frozen=True, kw_only=True)
class RegionFrontier:
    """A region type's Pareto frontier (bytes rising, time falling, first point at 0 bytes)
    and how many blocks of the type the plan covers."""

    points: tuple[Point, ...]
    blocks: int

    def __post_init__(self) -> None:
        if not self.points or self.points[0].bytes != 0:
            raise ValueError("a region frontier must start with a 0-byte point (the empty set)")
        if any(a.bytes >= b.bytes or a.time <= b.time for a, b in pairwise(self.points)):
            raise ValueError(
                "region frontier points must rise in bytes and fall in time: pass frontier()'s list"
            )
        if self.blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {self.blocks}")

    def gain(self, index: int) -> float:
        """Replay time point `index` removes per block, against the 0-byte point."""
        return self.points[0].time - self.points[index].time


@dataclass(frozen=True, kw_only=True)
class KnapsackResult:
    """Per region, the point index of each block in forward order; total bytes and gain."""

    choices: Mapping[str, tuple[int, ...]]
    bytes: int
    gain: float


def solve_knapsack(
    regions: Mapping[str, RegionFrontier], capacity: int, resolution: int = 1024
) -> KnapsackResult:
    """Pick one point per block, maximizing total gain within `capacity` bytes.

    Exact by dynamic programming over `resolution` capacity units, each block's bytes
    rounded up to whole units, so the plan always fits in true bytes; rounding can
    waste up to one unit per block, so `resolution` should well exceed the block count.
    Within a region, larger sets go to later blocks (their backward runs first).
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    names = sorted(regions)
    if capacity <= 0:
        return _result(regions, {name: [0] * regions[name].blocks for name in names})
    # Blocks in DP order with their menus. Sorted by weight, the j-th of m blocks leaves
    # m - j blocks at least as heavy, so it can only take weights up to resolution/(m - j).
    order: list[tuple[str, list[_Choice]]] = []
    for name in names:
        menu, m = _menu(regions[name], capacity, resolution), regions[name].blocks
        for j in range(m):
            usable = [c for c in menu if c[0] * (m - j) <= resolution]
            if len(usable) > 1:
                order.append((name, usable))
    layers = [[0.0] * (resolution + 1)]
    for _, menu in order:
        layers.append(_layer(layers[-1], menu))
    picks = _backtrack(layers, [menu for _, menu in order])
    chosen = {name: [0] * regions[name].blocks for name in names}
    for name in names:
        mine = sorted(i for (owner, _), i in zip(order, picks) if owner == name)
        chosen[name][len(chosen[name]) - len(mine) :] = mine
    return _result(regions, chosen)


def _menu(region: RegionFrontier, capacity: int, resolution: int) -> list[_Choice]:
    """The region's choices that fit, bytes rounded up to units; of the points that round
    to one weight only the last, which gains most."""
    best: dict[int, _Choice] = {}
    for i, point in enumerate(region.points):
        weight = -(-point.bytes * resolution // capacity)
        if weight <= resolution:
            best[weight] = (weight, region.gain(i), i)
    return list(best.values())


def _layer(prev: list[float], menu: list[_Choice]) -> list[float]:
    """Best gain within each capacity after one more block, which takes one menu choice."""
    cur = prev[:]  # menu[0] is the empty set: weight 0, gain 0
    for weight, gain, _ in menu[1:]:
        cur[weight:] = [a if a >= (t := b + gain) else t for a, b in zip(cur[weight:], prev)]
    return cur


def _backtrack(layers: list[list[float]], menus: list[list[_Choice]]) -> list[int]:
    """The point index each block took in the best plan, first block first."""
    c, picks = len(layers[0]) - 1, []
    for j in range(len(menus), 0, -1):
        prev, cur = layers[j - 1], layers[j]
        weight, _, index = next(
            m for m in menus[j - 1] if m[0] <= c and prev[c - m[0]] + m[1] == cur[c]
        )
        picks.append(index)
        c -= weight
    return picks[::-1]


def _result(
    regions: Mapping[str, RegionFrontier], chosen: Mapping[str, list[int]]
) -> KnapsackResult:
    points = [(regions[name], i) for name, picks in chosen.items() for i in picks]
    return KnapsackResult(
        choices={name: tuple(picks) for name, picks in chosen.items()},
        bytes=sum(r.points[i].bytes for r, i in points),
        gain=math.fsum(r.gain(i) for r, i in points),
    )
