"""The planner's model: replay (Eqs. 3, 6) and block recomputation (Eqs. 4, 5) on small tapes."""

from __future__ import annotations

import dataclasses
import math

import pytest
from plan_graphs import worked_example

from tapesac_core.plan import (
    Graph,
    PlanGraph,
    block_nodes,
    block_time,
    candidates,
    replay_nodes,
    replay_time,
    saved_bytes,
)


def ids(graph: PlanGraph, *names: str) -> frozenset[int]:
    return graph.value_ids(names)


def test_worked_example_replay_and_block_times():
    g = worked_example()
    assert block_time(g, ()) == 32
    assert block_nodes(g, ()) == {0, 1, 2, 3, 4}
    assert replay_time(g, ()) == 23
    assert replay_nodes(g, ()) == {0, 1, 3, 4}  # x3 is dead: backward never reads it
    assert replay_time(g, ids(g, "x2")) == 10 and saved_bytes(g, ids(g, "x2")) == 6
    assert replay_time(g, ids(g, "x4")) == 7 and saved_bytes(g, ids(g, "x4")) == 8
    assert replay_time(g, ids(g, "x4", "x5")) == 0 and saved_bytes(g, ids(g, "x4", "x5")) == 13
    assert replay_time(g, ids(g, "x1", "x2")) == 10 and saved_bytes(g, ids(g, "x1", "x2")) == 16


def test_block_recomputation_stops_after_last_missing_value():
    g = worked_example()
    # x5 saved: the last node with an unsaved demanded output is x4's (index 3).
    assert block_nodes(g, ids(g, "x5")) == {0, 1, 2, 3}
    assert block_time(g, ids(g, "x5")) == 25
    assert replay_time(g, ids(g, "x5")) == 16
    assert block_nodes(g, ids(g, "x4", "x5")) == set()


def split_matmul() -> PlanGraph:
    """mm -> one storage viewed as q and gate; q is copied; backward reads the copy and gate.

    Values: 0 x, 1 w (leaves), 2 qg, 3 q, 4 gate (views of qg), 5 q_copy, 6 w_t (view of w).
    """
    return PlanGraph(
        node_time=(0.5, 6.0, 0.0, 1.1),
        node_deps=((1,), (0, 6), (2,), (3,)),
        node_outs=((6,), (2,), (3, 4), (5,)),
        value_storage=(0, 1, 2, 2, 2, 3, 1),
        storage_bytes=(0, 0, 16, 8),
        value_names=("x", "w", "qg", "q", "gate", "q_copy", "w_t"),
        demand=frozenset({4, 5}),
        available=frozenset({0, 1}),
    )


def test_views_share_storage_bytes():
    g = split_matmul()
    assert saved_bytes(g, ids(g, "q", "gate")) == 16
    assert saved_bytes(g, ids(g, "qg", "q", "gate", "q_copy")) == 24
    assert saved_bytes(g, ids(g, "w_t")) == 0  # a view of a parameter is kept anyway


def test_nodes_count_once_however_many_outputs_are_needed():
    g = split_matmul()
    assert replay_nodes(g, ()) == {0, 1, 2, 3}
    assert replay_time(g, ()) == math.fsum([0.5, 6.0, 0.0, 1.1])
    # Saving the gate alone removes nothing: split and mm still run for q.
    assert replay_time(g, ids(g, "gate")) == replay_time(g, ())
    assert replay_time(g, ids(g, "gate", "q_copy")) == 0


def test_candidates_are_values_multi_output_groups_and_storage_groups():
    g = split_matmul()
    assert candidates(g) == [
        ids(g, "qg"),
        ids(g, "q"),
        ids(g, "gate"),
        ids(g, "q_copy"),
        ids(g, "q", "gate"),  # the outputs of split
        ids(g, "qg", "q", "gate"),  # the values on qg's storage
    ]


def test_mandatory_values_cost_nothing_and_are_no_candidates():
    ops = {"a": (2, 4, ["x"]), "b": (3, 5, ["a"])}
    g = Graph(ops, {"a", "b"})
    mandatory = dataclasses.replace(g, available=g.available | ids(g, "b"))
    assert replay_time(mandatory, ()) == 2
    assert saved_bytes(mandatory, ids(mandatory, "b")) == 0
    assert candidates(mandatory) == [ids(mandatory, "a")]


def test_graph_front_makes_leaves_available():
    g = worked_example()
    assert g.value_names == ("x1", "x2", "x3", "x4", "x5")
    leafy = Graph({"y": (1, 2, ["x", "w"])}, {"y", "x"})
    assert leafy.available == ids(leafy, "x", "w")
    assert leafy.storage_bytes == (2, 0, 0)
    assert replay_time(leafy, ()) == 1


def test_plan_graph_is_frozen():
    g = worked_example()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.demand = frozenset()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"node_deps": ((), (3,), (1,), (2,), (4,))}, "before a node produces it"),
        ({"node_outs": ((0,), (0,), (2,), (3,), (4,))}, "is produced by nodes 0 and 1"),
        ({"node_outs": ((0,), (1,), (2,), (3,), ())}, "neither produced nor available"),
        ({"value_names": ("x1", "x1", "x3", "x4", "x5")}, "unique"),
        ({"demand": frozenset({9})}, "demand holds a value id"),
        ({"value_storage": (0, 1, 2, 3, 7)}, "storage id outside"),
        ({"storage_bytes": (10, 6, 4, 8, -5)}, "non-negative"),
        ({"node_time": (8.0, 5.0, 9.0, 3.0, float("nan"))}, "finite"),
        ({"node_time": (8.0,)}, "one entry per node"),
    ],
)
def test_invalid_graphs_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(worked_example(), **change)


def test_graph_front_rejects_bad_input():
    with pytest.raises(ValueError, match="topological order"):
        Graph({"a": (1, 1, ["b"]), "b": (1, 1, [])}, {"a"})
    with pytest.raises(ValueError, match="neither ops nor inputs"):
        Graph({"a": (1, 1, [])}, {"zz"})
    with pytest.raises(KeyError, match="unknown value names"):
        worked_example().value_ids(["nope"])
    with pytest.raises(ValueError, match="outside value_names"):
        replay_time(worked_example(), [99])
