"""Planner speed and quality: frontier time on a 2,000-node tape-like graph, the peak-aware
solve (replay simulated per frontier point, then the DP over blocks) on a timeline of that graph
repeated as 48 blocks, and the gap between the beam-search frontier and the exact one on random
small graphs.

Run: python -m benchmarks.planner_speed [--nodes 2000] [--graphs 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
from functools import partial
from pathlib import Path

from benchmarks.common import median_seconds
from tapesac_core.plan import (
    PlanGraph,
    Point,
    RegionFrontier,
    candidates,
    exact_frontier,
    gap,
    solve_frontier,
    solve_knapsack,
)
from tapesac_core.plan.menus import RegionMenu, menus_of
from tapesac_core.plan.peak import predict
from tapesac_core.plan.peak_dp import solve_peak
from tapesac_core.plan.peak_timeline import Segment, Timeline, TimelineBlock

ROOT = Path(__file__).resolve().parents[1]


class Tape:
    """Builds a PlanGraph node by node: values, storages, demand."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.deps: list[tuple[int, ...]] = []
        self.outs: list[tuple[int, ...]] = []
        self.storage: list[int] = []
        self.sizes: list[int] = []
        self.names: list[str] = []
        self.demand: set[int] = set()
        self.available: set[int] = set()

    def value(self, name: str, size: int | None = None, view_of: int | None = None) -> int:
        """A new value in a new storage of `size` bytes, or in the storage of `view_of`."""
        if view_of is None:
            self.sizes.append(size or 0)
            self.storage.append(len(self.sizes) - 1)
        else:
            self.storage.append(self.storage[view_of])
        self.names.append(f"{name}#{len(self.names)}")
        return len(self.names) - 1

    def leaf(self, name: str) -> int:
        v = self.value(name, 0)
        self.available.add(v)
        return v

    def op(
        self,
        name: str,
        t: float,
        deps: list[int],
        outs: list[int | None],
        demanded: bool = False,
        view_of: int | None = None,
    ) -> list[int]:
        """A node of time `t`; each out is a size in bytes, or None for a view of `view_of`
        (or, without it, of the node's first output)."""
        values: list[int] = []
        for size in outs:
            base = view_of if view_of is not None else values[0] if values else None
            values.append(self.value(name, size, base if size is None else None))
        self.times.append(t)
        self.deps.append(tuple(deps))
        self.outs.append(tuple(values))
        if demanded:
            self.demand.update(values)
        return values

    def graph(self) -> PlanGraph:
        return PlanGraph(
            node_time=tuple(self.times),
            node_deps=tuple(self.deps),
            node_outs=tuple(self.outs),
            value_storage=tuple(self.storage),
            storage_bytes=tuple(self.sizes),
            value_names=tuple(self.names),
            demand=frozenset(self.demand),
            available=frozenset(self.available),
        )


def transformer_block(tape: Tape, x: int, rng: random.Random) -> int:
    """One decoder layer as eager PyTorch records it: norms, a query/gate projection split
    into views, q/k norms, RoPE, attention, a gated MLP, weight transposes and reshapes;
    backward demand roughly as autograd saves it."""

    def op(
        name: str,
        t: float,
        deps: list[int],
        outs: list[int | None],
        demanded: bool = False,
        view_of: int | None = None,
    ) -> list[int]:
        return tape.op(name, t * rng.uniform(0.8, 1.25), deps, outs, demanded, view_of)

    def view(name: str, base: int, demanded: bool = False) -> int:
        return op(name, 0.002, [base], [None], demanded, view_of=base)[0]

    def linear(name: str, a: int, size: int, t: float) -> int:
        weight = tape.leaf(name + ".weight")
        return op(name, t, [view("view", a, True), view("t", weight, True)], [size])[0]

    def rmsnorm(a: int, size: int) -> int:
        """Eager RMSNorm: float32 copy, pow, mean, eps, rsqrt, scale, cast back, weight."""
        (wide,) = op("to", 0.05, [a], [2 * size], demanded=True)
        (ms,) = op("mean", 0.03, op("pow", 0.05, [wide], [2 * size]), [small])
        (r,) = op("rsqrt", 0.01, op("add", 0.01, [ms], [small]), [small], demanded=True)
        (y,) = op("to", 0.05, op("mul", 0.05, [wide, r], [2 * size]), [size], demanded=True)
        return op("mul", 0.05, [y, tape.leaf("norm.weight")], [size])[0]

    def rope(a: int, size: int) -> int:
        """Eager RoPE: a * cos + rotate_half(a) * sin; backward reads only cos and sin."""
        first, second = view("slice", a), view("slice", a)
        (rotated,) = op("cat", 0.03, [op("neg", 0.02, [second], [size // 2])[0], first], [size])
        cos, sin = tape.leaf("cos"), tape.leaf("sin")
        return op(
            "add",
            0.03,
            op("mul", 0.03, [a, cos], [size]) + op("mul", 0.03, [rotated, sin], [size]),
            [size],
        )[0]

    h, f, small = 8 << 20, 32 << 20, 64 << 10
    n1 = rmsnorm(x, h)
    qg = linear("q_gate_proj", n1, 2 * h, 1.2)
    q, gate = op("split", 0.004, [view("view", qg)], [None, None], view_of=qg)
    qn = rmsnorm(view("view", q), h)
    kv = linear("kv_proj", n1, h, 0.6)
    k, v = op("split", 0.004, [kv], [None, None], view_of=kv)
    kn = rmsnorm(k, h // 2)
    qt, kt, vt = (view("transpose", a, True) for a in (rope(qn, h), rope(kn, h // 2), v))
    att, _lse = op("attention", 3.0, [qt, kt, vt], [h, 256 << 10], demanded=True)
    (ac,) = op("contiguous", 0.1, [view("transpose", att)], [h])
    (sg,) = op("sigmoid", 0.08, [gate], [h], demanded=True)
    (gated,) = op("mul", 0.08, [ac, sg], [h])
    tape.demand.add(ac)
    (h1,) = op("add", 0.08, [x, linear("o_proj", gated, h, 0.6)], [h])
    n2 = rmsnorm(h1, h)
    up = linear("up_proj", n2, f, 2.0)
    gu = linear("gate_proj", n2, f, 2.0)
    (act,) = op("silu", 0.3, [gu], [f])
    (m,) = op("mul", 0.3, [act, up], [f])
    tape.demand.update([gu, act, up])
    if rng.random() < 0.5:
        m, mask = op("dropout", 0.3, [m], [f, f // 4])
        tape.demand.add(mask)
    (out,) = op("add", 0.08, [h1, linear("down_proj", m, h, 2.0)], [h])
    return out


def tape_like_graph(n_nodes: int, seed: int = 0) -> PlanGraph:
    """Transformer-like blocks chained until the tape has about `n_nodes` nodes."""
    rng = random.Random(seed)
    tape = Tape()
    x = tape.leaf("input")
    while len(tape.times) < n_nodes:
        x = transformer_block(tape, x, rng)
    return tape.graph()


def random_small_graph(rng: random.Random, max_candidates: int = 16) -> PlanGraph:
    """A random DAG with multi-output nodes, shared storages, leaves and S0 values."""
    while True:
        tape = Tape()
        values = [tape.leaf("in") for _ in range(rng.randint(1, 3))]
        for i in range(rng.randint(3, 12)):
            deps = rng.sample(values, min(len(values), rng.randint(1, 3)))
            n_out = rng.choices([1, 2, 3], [0.75, 0.2, 0.05])[0]
            kind = rng.random()
            base = deps[0] if kind < 0.2 else None  # a view of an input
            outs = [None if base is not None else rng.randint(1, 20) for _ in range(n_out)]
            if kind > 0.8:  # outputs that are views of one new storage (a split matmul)
                outs[1:] = [None] * (n_out - 1)
            new = tape.op(f"n{i}", float(rng.randint(1, 20)), deps, outs, view_of=base)
            values += new
        for v in values:
            if v not in tape.available and rng.random() < 0.35:
                tape.demand.add(v)
            elif v not in tape.available and rng.random() < 0.03:
                tape.available.add(v)
        graph = tape.graph()
        if graph.demand and sum(len(c) == 1 for c in candidates(graph)) <= max_candidates:
            return graph


def peak_timeline(graph: PlanGraph, blocks: int) -> Timeline:
    """A must-only step of ``blocks`` copies of ``graph`` in one micro-batch: forwards rising by
    1 MB each, the loss, then each block's window (a replay and a compute segment per unpack
    of its demanded values, latest first) 5 MB above its forward end."""
    unpacks = tuple(sorted(graph.demand - graph.available, reverse=True))
    mb = 10**6
    segs = [Segment(peak=10**9 + i * mb, first=0, last=i, phase="forward") for i in range(blocks)]
    segs.append(Segment(peak=10**9 + blocks * mb, first=0, last=blocks - 1))
    for j in reversed(range(blocks)):
        segs += [
            Segment(peak=10**9 + (j + 5) * mb, first=0, last=j, phase=phase, own=j, unpack=u)
            for u in range(len(unpacks))
            for phase in ("replay", "compute")
        ]
    return Timeline(
        tokens=1,
        static=0,
        segments=tuple(segs),
        blocks=tuple(
            TimelineBlock(region="r", index=i, sequence="s", unpacks=unpacks) for i in range(blocks)
        ),
    )


def knapsack_instance(rng: random.Random) -> dict[str, RegionFrontier]:
    """4 region types x 64 blocks x 40-point frontiers."""
    regions = {}
    for name in ("attention", "linear_attention", "moe", "vision"):
        sizes = sorted(rng.sample(range(1, 1 << 30), 39))
        times = sorted(rng.sample(range(1, 10**6), 40), reverse=True)
        points = [
            Point(bytes=b, time=t / 1000, saved=frozenset({str(b)} if b else ()))
            for b, t in zip([0, *sizes], times)
        ]
        regions[name] = RegionFrontier(points=tuple(points), blocks=64)
    return regions


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_speed", description=__doc__)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--graphs", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    graph = tape_like_graph(args.nodes)
    n_cand = sum(len(c) == 1 for c in candidates(graph))
    print(
        f"tape: {len(graph.node_time)} nodes, {len(graph.value_names)} values "
        f"({len(graph.available)} available), {len(graph.demand)} demanded, "
        f"{n_cand} candidate values, {len(graph.storage_bytes)} storages"
    )
    frontier_s, result = median_seconds(lambda: solve_frontier(graph), args.runs)
    print(
        f"frontier: median {frontier_s:.3f} s over {args.runs} runs, {result.sets_evaluated} sets "
        f"evaluated, {result.walks} tape walks, {len(result.points)} points"
    )

    menu = RegionMenu(
        sequence="s",
        graph=graph,
        bytes=tuple(p.bytes for p in result.points),
        gains=tuple(result.points[0].time - p.time for p in result.points),
        saved=tuple(graph.value_ids(p.saved) for p in result.points),
    )
    timeline = peak_timeline(graph, blocks=48)
    menus_s, menus = median_seconds(lambda: menus_of(timeline, {"r": menu}), args.runs)
    print(
        f"peak model: replay simulated for {len(result.points)} points x "
        f"{len(timeline.blocks[0].unpacks)} unpacks: median {menus_s:.3f} s"
    )
    spread = timeline.peak + 12 * result.points[len(result.points) // 2].bytes
    dp_s, picks = median_seconds(lambda: solve_peak(timeline, menus, spread), args.runs)
    print(
        f"peak model: DP over {len(timeline.blocks)} blocks x {len(menu.bytes)} options, "
        f"{len(timeline.segments)} segments: median {dp_s:.3f} s, predicted peak "
        f"{predict(timeline, [m[c] for m, c in zip(menus, picks)]).peak / spread:.1%} of capacity"
    )
    print(
        f"peak-aware solve in all (frontier + replay simulated + DP): "
        f"{frontier_s + menus_s + dp_s:.3f} s"
    )

    regions = knapsack_instance(random.Random(0))
    full = sum(r.blocks * r.points[-1].bytes for r in regions.values())
    for share in (0.05, 0.3, 0.7):
        seconds, plan = median_seconds(
            partial(solve_knapsack, regions, int(full * share)), args.runs
        )
        print(
            f"knapsack 4 x 64 x 40, capacity {share:.0%} of all: median {seconds:.3f} s, "
            f"{plan.bytes / (full * share):.1%} of capacity used"
        )

    rng = random.Random(1)
    graphs = [random_small_graph(rng) for _ in range(args.graphs)]
    exact = [exact_frontier(g) for g in graphs]
    for label, exact_units in (("beam + polish only", 0), ("frontier() default", 10)):
        gaps = sorted(
            gap(solve_frontier(g, exact_units=exact_units).points, e) for g, e in zip(graphs, exact)
        )
        print(
            f"gap to exact, {label}, {len(gaps)} graphs: exact on {sum(x == 0 for x in gaps)}, "
            f"<=1% on {sum(x <= 0.01 for x in gaps) / len(gaps):.1%}, "
            f">5% on {sum(x > 0.05 for x in gaps)}, median {statistics.median(gaps):.4f}, "
            f"p95 {gaps[int(0.95 * (len(gaps) - 1))]:.4f}, max {gaps[-1]:.4f}"
        )


if __name__ == "__main__":
    main()
