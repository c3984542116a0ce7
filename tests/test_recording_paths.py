"""The recorder's fast path records what its checking path records (``tapesac_core.tape.recorder``).

Plain ops and simple views take a fast path through ``Recorder.__torch_dispatch__`` that skips
the steps of ``_record`` that cannot apply to them. Each test records the same call of a real
block through the fast path and through the checking path (every op through ``_record``: with
``Recorder.fast_path`` off, or while timing every op, as profiling steps do), and compares the
two tapes node by node and value by value, what the block holds and why, and, after backward,
what replay ran and the gradients."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from blocks import Case, case
from support import assert_bitwise

import tapesac_core
from tapesac_core.plan.plan import Plan, RegionPlan
from tapesac_core.tape.recorder import Recorder
from tapesac_core.tape.tape import Node, Tape
from tapesac_core.tensors import Slot, layout_of

Tensor = torch.Tensor


@dataclass
class Recording:
    """One recorded call of a block: its tape and what it held after forward (cloned), what
    backward did, and how many ops took the checking path (``Recorder._record``)."""

    tape: Tape
    held: dict[int, Tensor]
    handles: list[int]
    exits: list[Any]
    anchored: set[int]
    planned_seen: set[tuple]
    saved: frozenset[int]
    replayed: list[int]
    unpacked: set[int]
    alive_taken: set[int]
    result: tuple
    checked_ops: int


def _plan(c: Case, kind: str) -> Any:
    """A plan for the case's block: none, coordinates, or a solved plan with anchors."""
    if kind == "must_only":
        return {}
    if kind == "every":
        return {c.region: set(c.coords)}
    if kind == "half":
        return {c.region: set(c.coords[::2])}
    # Half the values by coordinate, the other half by anchored coordinate only: both ways of
    # holding, and every node counted within its submodule (the anchors' ``k``).
    tape = c.must_only
    anchors = frozenset(tape.anchor(tape.find(coord)) for coord in c.coords[1::2])
    return Plan(
        model=("m",),
        capacity=0,
        base=0,
        saved_bytes=0,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
        regions={
            c.region: RegionPlan(
                sequence=tape.fingerprint,
                blocks=(frozenset(c.coords[::2]),),
                tokens=16,
                anchors=(anchors,),
                modules={m: tape.module_fingerprints[m] for m, *_ in anchors},
            )
        },
    )


@contextmanager
def _counting_checked_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many ops reach ``Recorder._record`` inside."""
    count = [0]
    record = Recorder._record

    def counted(self: Recorder, func: Any, info: Any, args: tuple, kwargs: dict) -> Any:
        count[0] += 1
        return record(self, func, info, args, kwargs)

    with monkeypatch.context() as m:
        m.setattr(Recorder, "_record", counted)
        yield count


def _record(c: Case, plan: Any, path: str, monkeypatch: pytest.MonkeyPatch) -> Recording:
    """Record one step of ``c`` under ``plan`` through ``path``: "fast" (as ever), "checked"
    (``Recorder.fast_path`` off) or "timed" (``trace(time_nodes=True)``)."""
    with _counting_checked_ops(monkeypatch) as count, monkeypatch.context() as m:
        if path == "checked":
            m.setattr(Recorder, "fast_path", False)
        c.module.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # as the case's reference step
        with (
            tapesac_core.use_plan(plan),
            tapesac_core.trace(record=True, time_nodes=path == "timed") as blocks,
        ):
            loss = c.loss()
            (trace,) = blocks
            block = trace.block()
            assert block is not None
            held = {v: t.clone() for v, t in block.held.items()}
            handles, exits = list(block.handles), list(block.exits)
            anchored, seen = set(block.anchored), set(block.planned_seen)
            del block
            loss.backward()
        grads = {n: p.grad.clone() for n, p in c.module.named_parameters() if p.grad is not None}
        c.module.zero_grad(set_to_none=True)
    return Recording(
        tape=trace.tape,
        held=held,
        handles=handles,
        exits=exits,
        anchored=anchored,
        planned_seen=seen,
        saved=trace.saved,
        replayed=list(trace.replayed),
        unpacked=set(trace.unpacked),
        alive_taken=set(trace.alive_taken),
        result=(loss.detach(), grads),
        checked_ops=count[0],
    )


def _plain(a: Any) -> Any:
    """Recorded arguments comparable with ``==`` (slots by position)."""
    if type(a) is Slot:
        return ("slot", a.i)
    if type(a) in (list, tuple):
        return (type(a).__name__, tuple(_plain(x) for x in a))
    if type(a) is dict:
        return tuple((k, _plain(v)) for k, v in a.items())
    return a


def _node(n: Node) -> tuple:
    rng = None if n.rng is None else (id(n.rng[0]), n.rng[1].tolist())
    return (
        n.index,
        n.op,
        n.name,
        n.k,
        _plain(n.args),
        _plain(n.kwargs),
        n.inputs,
        n.deps,
        n.outs,
        n.writes,
        n.extra,
        rng,
        n.rebuild,
        n.module,
    )


def assert_same_recording(fast: Recording, checked: Recording) -> None:
    """The two recordings of one call agree node by node, value by value, in what the block
    held (and why), in what autograd packed, and in what backward replayed and computed."""
    a, b = fast.tape, checked.tape
    assert len(a.nodes) == len(b.nodes), (len(a.nodes), len(b.nodes))
    for x, y in zip(a.nodes, b.nodes):
        assert _node(x) == _node(y), f"node {x.index}: {_node(x)} != {_node(y)}"
    assert len(a.values) == len(b.values), (len(a.values), len(b.values))
    for v, w in zip(a.values, b.values):
        assert tuple(v) == tuple(w), f"value {v.vid}: {tuple(v)} != {tuple(w)}"
    assert a.storage_bytes == b.storage_bytes
    assert dict(a.mandatory) == dict(b.mandatory)
    assert a.planned == b.planned
    assert a.demand == b.demand
    assert (a.outputs, a.returned, a.host_sync) == (b.outputs, b.returned, b.host_sync)
    assert fast.held.keys() == checked.held.keys()
    for vid, t in fast.held.items():
        u = checked.held[vid]
        assert layout_of(t) == layout_of(u) and torch.equal(t, u), vid
    assert fast.saved == checked.saved
    assert fast.handles == checked.handles
    assert fast.exits == checked.exits
    assert fast.anchored == checked.anchored
    assert fast.planned_seen == checked.planned_seen
    assert fast.replayed == checked.replayed
    assert fast.unpacked == checked.unpacked
    assert fast.alive_taken == checked.alive_taken
    assert_bitwise(fast.result, checked.result)


CASES = [
    ("dense", "must_only"),
    ("moe", "must_only"),
    ("inplace", "must_only"),
    ("dense", "every"),
    ("inplace", "every"),
    ("moe", "half"),
    ("dense", "anchored"),
    ("moe", "anchored"),
]


@pytest.mark.parametrize("checked_path", ["checked", "timed"])
@pytest.mark.parametrize("kind, plan", CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_the_fast_path_records_what_the_checking_path_records(
    kind: str, plan: str, checked_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = case(kind)
    fast = _record(c, _plan(c, plan), "fast", monkeypatch)
    checked = _record(c, _plan(c, plan), checked_path, monkeypatch)
    assert_same_recording(fast, checked)
    assert_bitwise(c.ref, fast.result)
    # Both paths ran: some ops took the fast one, and on the checking path every op was checked.
    assert fast.checked_ops < checked.checked_ops
    assert checked.checked_ops >= sum(n.op is not None for n in checked.tape.nodes)
    if plan != "must_only":
        assert fast.saved and (fast.tape.planned or fast.anchored)


def test_a_fast_path_that_skips_planned_values_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison sees a drift: here a fast path that never holds what the plan names."""
    c = case("dense")
    plan = _plan(c, "every")
    checked = _record(c, plan, "checked", monkeypatch)
    record, add_node = Recorder._record, Recorder._add_node
    checking = [False]

    def record_checked(self: Recorder, *args: Any) -> Any:
        checking[0] = True
        try:
            return record(self, *args)
        finally:
            checking[0] = False

    def add_node_forgetting_the_plan(self: Recorder, *args: Any) -> int:
        if checking[0]:
            return add_node(self, *args)
        coords, self.block.plan_coords = self.block.plan_coords, frozenset()
        try:
            return add_node(self, *args)
        finally:
            self.block.plan_coords = coords

    with monkeypatch.context() as m:
        m.setattr(Recorder, "_record", record_checked)
        m.setattr(Recorder, "_add_node", add_node_forgetting_the_plan)
        drifted = _record(c, plan, "fast", monkeypatch)
    assert_bitwise(c.ref, drifted.result)  # still exact: it replays what it did not hold
    with pytest.raises(AssertionError):
        assert_same_recording(drifted, checked)
