"""Eqs. 3-6 have one implementation, the planner's (``plan.model``), which ``Tape.replay_nodes``,
``block_nodes``, ``replay_time`` and ``block_time`` call: both fronts against brute force (the
equations as written, from the tape's own fields) on random tapes."""

import math
import random
from collections import Counter

from support import brute_force_block, brute_force_replay

from tapesac_core.plan import block_nodes, block_time, replay_nodes, replay_time
from tapesac_core.plan.tape_graph import graph_of
from tapesac_core.tape.tape import (
    COLLECTIVE,
    EXTERNAL,
    INPUT,
    NO_PRODUCER,
    OP,
    PARAM,
    Node,
    Tape,
    Value,
)

OPS = ("aten.mm.default", "aten.add.Tensor", "aten.sin.default")


def random_tape(rng: random.Random) -> Tape:
    """Inputs, parameters and maybe an external tensor (mandatory, as the recorder holds it);
    nodes reading up to three earlier values (repeats allowed), with zero to three outputs, the
    first sometimes a view of the first input read; some outputs mandatory; a random demand."""
    values: list[Value] = []
    storage_bytes: list[int] = []
    mandatory: dict[int, str] = {}

    def new(node: int, j: int, kind: str, sid: int | None = None, name=None) -> int:
        if sid is None:
            sid = len(storage_bytes)
            storage_bytes.append(rng.randrange(64))
        values.append(Value(len(values), node, j, sid, 0, None, 0, kind, name))
        return len(values) - 1

    for i in range(rng.randint(1, 3)):
        new(-1, 0, INPUT, name=i)
    for i in range(rng.randint(0, 2)):
        new(-1, 0, PARAM, name=f"w{i}")
    if rng.random() < 0.5:
        mandatory[new(-1, 0, EXTERNAL)] = NO_PRODUCER
    nodes: list[Node] = []
    calls: Counter[str] = Counter()
    for index in range(rng.randint(1, 14)):
        deps = rng.choices(range(len(values)), k=rng.randint(1, 3))
        view = rng.random() < 0.2
        outs = [
            new(index, j, OP, sid=values[deps[0]].sid if view and j == 0 else None)
            for j in range(rng.choice([0, 1, 1, 1, 2, 3]))
        ]
        mandatory |= {v: COLLECTIVE for v in outs if rng.random() < 0.1}
        name = rng.choice(OPS)
        nodes.append(
            Node(
                index, None, name, calls[name], (), {}, deps, deps, outs, (), (), None, False, None
            )
        )
        calls[name] += 1
    produced = [v.vid for v in values if v.node >= 0]
    demand = frozenset(rng.sample(produced, rng.randint(0, len(produced))))
    return Tape("random", "random", nodes, values, storage_bytes, demand, mandatory, frozenset())


def test_eqs_3_to_6_on_tapes_and_planner_graphs_match_brute_force_on_random_tapes() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tape = random_tape(rng)
        times = {n.index: rng.random() for n in tape.nodes}
        graph = graph_of(tape, times)
        for _ in range(4):
            saved = set(rng.sample(range(len(tape.values)), rng.randint(0, len(tape.values))))
            replay, block = brute_force_replay(tape, saved), brute_force_block(tape, saved)
            assert tape.replay_nodes(saved) == sorted(replay_nodes(graph, saved)) == replay
            assert tape.block_nodes(saved) == sorted(block_nodes(graph, saved)) == block
            assert set(replay) <= set(block)  # Eq. 7: replay runs no node block recomputation skips
            # Eqs. 6 and 5: the nodes' summed times, exactly rounded (the same in any order).
            rp, blk = math.fsum(times[n] for n in replay), math.fsum(times[n] for n in block)
            assert tape.replay_time(saved, times) == replay_time(graph, saved) == rp
            assert tape.block_time(saved, times) == block_time(graph, saved) == blk
