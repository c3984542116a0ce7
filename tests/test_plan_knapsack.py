"""The multiple-choice knapsack across region types and blocks, against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapesac_core.plan import KnapsackResult, Point, RegionFrontier, solve_knapsack


def region(blocks: int, *points: tuple[int, float]) -> RegionFrontier:
    return RegionFrontier(
        points=tuple(
            Point(bytes=b, time=t, saved=frozenset({f"s{b}"} if b else ())) for b, t in points
        ),
        blocks=blocks,
    )


ATTN = region(2, (0, 10.0), (4, 6.0), (8, 1.0))
MLP = region(1, (0, 20.0), (5, 12.0), (10, 5.0))


def test_best_split_of_capacity_between_regions_and_blocks():
    result = solve_knapsack({"attn": ATTN, "mlp": MLP}, capacity=13, resolution=13)
    assert result == KnapsackResult(choices={"attn": (0, 2), "mlp": (1,)}, bytes=13, gain=17.0)


def test_coarse_resolution_rounds_weights_up():
    # Units of 6.5 bytes: every non-empty point weighs 1 or 2 units of 2.
    result = solve_knapsack({"attn": ATTN, "mlp": MLP}, capacity=13, resolution=2)
    assert result == KnapsackResult(choices={"attn": (0, 0), "mlp": (2,)}, bytes=10, gain=15.0)


@pytest.mark.parametrize("capacity", [0, -5])
def test_no_capacity_saves_nothing(capacity):
    result = solve_knapsack({"attn": ATTN, "mlp": MLP}, capacity=capacity)
    assert result == KnapsackResult(choices={"attn": (0, 0), "mlp": (0,)}, bytes=0, gain=0.0)


def test_larger_sets_go_to_later_blocks():
    many = region(4, (0, 9.0), (3, 5.0), (6, 0.0))
    result = solve_knapsack({"r": many}, capacity=12, resolution=12)
    assert result.choices["r"] == (0, 0, 2, 2)


@st.composite
def instances(draw: st.DrawFn) -> tuple[dict[str, RegionFrontier], int, int]:
    regions = {}
    for name in ("a", "b", "c")[: draw(st.integers(1, 3))]:
        sizes = sorted(draw(st.sets(st.integers(1, 40), max_size=3)))
        times = sorted(
            draw(st.sets(st.integers(0, 50), min_size=len(sizes) + 1, max_size=len(sizes) + 1)),
            reverse=True,
        )
        regions[name] = region(draw(st.integers(0, 2)), *zip([0, *sizes], map(float, times)))
    capacity = draw(st.integers(0, 100))
    return regions, capacity, draw(st.sampled_from([1, 3, 7, 16, 100]))


def brute_force(regions: dict[str, RegionFrontier], capacity: int, resolution: int) -> float:
    """The best total gain over every choice per block, with the knapsack's rounded weights."""
    blocks = [r for name in sorted(regions) for r in [regions[name]] * regions[name].blocks]
    best = 0.0
    for picks in itertools.product(*(range(len(r.points)) for r in blocks)):
        weight = sum(-(-r.points[i].bytes * resolution // capacity) for r, i in zip(blocks, picks))
        if weight <= resolution:
            best = max(best, math.fsum(r.gain(i) for r, i in zip(blocks, picks)))
    return best


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(instances())
def test_knapsack_is_exact_on_rounded_weights_and_fits_true_bytes(instance):
    regions, capacity, resolution = instance
    result = solve_knapsack(regions, capacity, resolution)
    if capacity > 0:
        assert result.gain == pytest.approx(brute_force(regions, capacity, resolution))
    picked = [(regions[name], i) for name, picks in result.choices.items() for i in picks]
    assert result.bytes == sum(r.points[i].bytes for r, i in picked) <= max(capacity, 0)
    assert result.gain == math.fsum(r.gain(i) for r, i in picked)
    for name, picks in result.choices.items():
        assert len(picks) == regions[name].blocks
        assert list(picks) == sorted(picks)


@pytest.mark.parametrize(
    ("points", "blocks", "message"),
    [
        ([(1, 5.0)], 1, "start with a 0-byte point"),
        ([(0, 5.0), (4, 3.0), (4, 2.0)], 1, "rise in bytes"),
        ([(0, 5.0), (4, 6.0)], 1, "fall in time"),
        ([(0, 5.0)], -1, "blocks must be >= 0"),
    ],
)
def test_region_frontier_validation(points, blocks, message):
    with pytest.raises(ValueError, match=message):
        region(blocks, *points)


def test_resolution_must_be_positive():
    with pytest.raises(ValueError, match="resolution"):
        solve_knapsack({"attn": ATTN}, capacity=10, resolution=0)


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(instances(), st.integers(1, 60))
def test_a_larger_capacity_never_gains_less(instance, more):
    """Weights round up in units of capacity / resolution, so each falls as the capacity rises:
    a larger capacity admits every choice a smaller one did (monotone by construction)."""
    regions, capacity, resolution = instance
    smaller = solve_knapsack(regions, capacity, resolution)
    larger = solve_knapsack(regions, capacity + more, resolution)
    assert larger.gain >= smaller.gain
