"""Graphs shared by the planner tests: the worked example and random DAGs."""

from __future__ import annotations

import random

from hypothesis import assume
from hypothesis import strategies as st

from tapesac_core.plan import Graph, PlanGraph, Point, candidates
from tapesac_core.plan.peak import Option

WORKED_OPS = {
    "x1": (8, 10, []),
    "x2": (5, 6, ["x1"]),
    "x3": (9, 4, ["x1"]),
    "x4": (3, 8, ["x2"]),
    "x5": (7, 5, ["x4"]),
}


def worked_example() -> PlanGraph:
    """The five-op block of reference/worked-example.txt; backward reads x4 and x5."""
    return Graph(WORKED_OPS, {"x4", "x5"})


# The worked example's exact frontier: (bytes saved, replay time left) of each optimal save set.
WORKED_FRONTIER = [
    Point(bytes=0, time=23.0, saved=frozenset()),
    Point(bytes=5, time=16.0, saved=frozenset({"x5"})),
    Point(bytes=6, time=10.0, saved=frozenset({"x2"})),
    Point(bytes=8, time=7.0, saved=frozenset({"x4"})),
    Point(bytes=11, time=3.0, saved=frozenset({"x2", "x5"})),
    Point(bytes=13, time=0.0, saved=frozenset({"x4", "x5"})),
]


@st.composite
def plan_graphs(draw: st.DrawFn, max_candidates: int = 16) -> PlanGraph:
    """Random DAGs with leaves, multi-output nodes, views of inputs, outputs split into
    views of one storage, mandatory (S0) values and half-unit times."""
    leaves = draw(st.integers(1, 3))
    storage, sizes = list(range(leaves)), [0] * leaves
    times: list[float] = []
    deps: list[tuple[int, ...]] = []
    outs: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(3, 11))):
        reads = draw(
            st.lists(st.integers(0, len(storage) - 1), min_size=1, max_size=3, unique=True)
        )
        kind = draw(st.sampled_from(["new", "new", "new", "view", "split"]))
        mine = []
        for k in range(draw(st.sampled_from([1, 1, 1, 2, 2, 3]))):
            if kind == "view":
                storage.append(storage[reads[0]])
            elif kind == "split" and k:
                storage.append(storage[mine[0]])
            else:
                sizes.append(draw(st.integers(0, 20)))
                storage.append(len(sizes) - 1)
            mine.append(len(storage) - 1)
        times.append(draw(st.integers(0, 40)) / 2)
        deps.append(tuple(reads))
        outs.append(tuple(mine))
    produced = list(range(leaves, len(storage)))
    demand = draw(st.sets(st.sampled_from(produced), min_size=1))
    mandatory = draw(st.sets(st.sampled_from(produced), max_size=1))
    graph = PlanGraph(
        node_time=tuple(times),
        node_deps=tuple(deps),
        node_outs=tuple(outs),
        value_storage=tuple(storage),
        storage_bytes=tuple(sizes),
        value_names=tuple(f"v{v}" for v in range(len(storage))),
        demand=frozenset(demand),
        available=frozenset(range(leaves)) | mandatory,
    )
    assume(sum(len(c) == 1 for c in candidates(graph)) <= max_candidates)
    return graph


def random_options(rng: random.Random, unpacks: int, points: int) -> list[Option]:
    """A block's menu for the peak model's tests: must-only, then ``points - 1`` options, each
    keeping more bytes for more gain, with random replay, compute and forward deltas (fewer
    deltas than unpacks: no change past them)."""
    opts = [Option(bytes=0, gain=0.0, point=0)]
    for p in range(1, points):
        width = rng.randint(0, unpacks)
        opts.append(
            Option(
                bytes=opts[-1].bytes + rng.randint(1, 30),
                gain=opts[-1].gain + rng.randint(1, 9),
                point=p,
                replay=tuple(rng.randint(-40, 5) for _ in range(width)),
                compute=tuple(rng.randint(-40, 5) for _ in range(width)),
                forward=-rng.randint(0, opts[-1].bytes),
            )
        )
    return opts
