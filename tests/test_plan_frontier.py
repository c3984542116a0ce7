"""Frontiers: exact on the worked example, joint effects, and the beam against exhaustive search."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from plan_graphs import WORKED_FRONTIER, plan_graphs, worked_example

from tapesac_core.plan import (
    Graph,
    PlanGraph,
    Point,
    exact_frontier,
    frontier,
    gap,
    replay_time,
    saved_bytes,
    solve_frontier,
)


def test_exact_frontier_of_worked_example():
    assert exact_frontier(worked_example()) == WORKED_FRONTIER


@pytest.mark.parametrize("exact_units", [0, 10])
def test_frontier_finds_every_worked_example_point(exact_units):
    result = solve_frontier(worked_example(), exact_units=exact_units)
    assert list(result.points) == WORKED_FRONTIER
    assert result.sets_evaluated > 0
    assert frontier(worked_example()) == WORKED_FRONTIER


def split_views() -> PlanGraph:
    """Figure 3 with views: one mm output viewed as query and gate; backward reads the
    query's copy and the gate, so the mm dies only when both sides are saved.

    Values: 0 x, 1 w, 2 qg, 3 query, 4 gate (views of qg), 5 query_copy.
    """
    return PlanGraph(
        node_time=(6.0, 0.0, 1.1),
        node_deps=((0, 1), (2,), (3,)),
        node_outs=((2,), (3, 4), (5,)),
        value_storage=(0, 1, 2, 2, 2, 3),
        storage_bytes=(0, 0, 16, 4),
        value_names=("x", "w", "qg", "query", "gate", "query_copy"),
        demand=frozenset({4, 5}),
        available=frozenset({0, 1}),
    )


def two_output_kernel() -> PlanGraph:
    """Figure 3 with a multi-output kernel: its outputs in separate storages are both read
    by backward; saving either alone removes nothing."""
    return PlanGraph(
        node_time=(6.0, 0.5, 0.5, 0.5),
        node_deps=((0,), (0,), (3,), (4,)),
        node_outs=((1, 2), (3,), (4,), (5,)),
        value_storage=(0, 1, 2, 3, 4, 5),
        storage_bytes=(0, 8, 8, 2, 2, 2),
        value_names=("x", "query", "gate", "p", "q", "r"),
        demand=frozenset({1, 2, 5}),
        available=frozenset({0}),
    )


def costs(points) -> list[tuple[int, float]]:
    # Sets tie when zero-time nodes (views) separate them; their costs must agree.
    return [(p.bytes, p.time) for p in points]


@pytest.mark.parametrize("exact_units", [0, 10])
def test_joint_effect_of_views_of_one_storage(exact_units):
    g = split_views()
    assert replay_time(g, g.value_ids(["gate"])) == replay_time(g, [])
    assert replay_time(g, g.value_ids(["query_copy"])) == 6.0
    points = solve_frontier(g, exact_units=exact_units).points
    assert Point(bytes=20, time=0.0, saved=frozenset({"gate", "query_copy"})) in points
    assert costs(points) == costs(exact_frontier(g))


@pytest.mark.parametrize("exact_units", [0, 10])
def test_joint_effect_of_two_outputs_of_one_node(exact_units):
    g = two_output_kernel()
    for alone in ("query", "gate"):
        assert replay_time(g, g.value_ids([alone])) == replay_time(g, [])
    points = solve_frontier(g, exact_units=exact_units).points
    assert Point(bytes=16, time=1.5, saved=frozenset({"query", "gate"})) in points
    assert costs(points) == costs(exact_frontier(g))


def check_points(graph: PlanGraph, points: list[Point]) -> None:
    """Sorted by bytes from 0, non-dominated, and every claim true on re-evaluation."""
    assert points[0].bytes == 0
    for p in points:
        saved = graph.value_ids(p.saved)
        assert saved_bytes(graph, saved) == p.bytes
        assert replay_time(graph, saved) == p.time
    for a, b in pairwise(points):
        assert a.bytes < b.bytes and a.time > b.time


def test_beam_matches_exhaustive_search_on_random_graphs():
    gaps = {"default": [], "beam": []}

    @settings(
        max_examples=300,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(plan_graphs())
    def check(graph: PlanGraph) -> None:
        exact = exact_frontier(graph)
        check_points(graph, exact)
        for label, exact_units in (("default", 10), ("beam", 0)):
            points = list(solve_frontier(graph, exact_units=exact_units).points)
            check_points(graph, points)
            gaps[label].append(gap(points, exact))
            assert gaps[label][-1] <= 0.05

    check()
    for found in gaps.values():
        assert sum(x <= 0.01 for x in found) >= 0.95 * len(found)


def test_exact_frontier_refuses_large_graphs():
    ops = {f"v{i}": (1, 1, [f"v{i - 1}"] if i else []) for i in range(21)}
    with pytest.raises(ValueError, match="use frontier"):
        exact_frontier(Graph(ops, set(ops)))


def test_frontier_rejects_bad_parameters():
    with pytest.raises(ValueError, match="beam_width"):
        frontier(worked_example(), beam_width=0)


def test_gap_measures_excess_time_at_each_budget():
    exact = [
        Point(bytes=0, time=10.0, saved=frozenset()),
        Point(bytes=5, time=4.0, saved=frozenset("a")),
    ]
    approx = [exact[0], Point(bytes=6, time=4.0, saved=frozenset("b"))]
    assert gap(exact, exact) == 0
    assert gap(approx, exact) == 1.5  # at 5 bytes: 10 against 4
