"""From a recorded tape and measured node times to the planner's model of a block.

Duck-typed on the tape (``nodes``, ``values``, ``storage_bytes``, ``demand``,
``always_available``, ``coord``, ``anchor``, ``module_fingerprints``, ``token_independent``),
so this module stays free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .coords import Anchor, Coord, Unproduced, ValueName
from .model import PlanGraph


@dataclass(frozen=True, kw_only=True)
class TapeGraph(PlanGraph[ValueName]):
    """The planner's model of a recorded block, with what a solved plan records of its values
    beyond their coordinates, so that solving needs nothing of the tape itself."""

    anchors: tuple[Anchor | None, ...]  # per value, its anchored coordinate (None: no producer)
    module_digests: Mapping[str, str]  # per submodule path, the digest of the ops it issued
    token_independent: frozenset[int]  # values whose size does not grow with tokens

    def produced(self, v: int) -> tuple[Coord, Anchor]:
        """The coordinate and the anchored coordinate of an op's output (what a plan keeps)."""
        name, anchor = self.value_names[v], self.anchors[v]
        assert isinstance(name, Coord) and anchor is not None, f"value {v} has no producer"
        return name, anchor


def graph_of(
    tape: Any, node_time: Mapping[int, float], savable: frozenset[int] | None = None
) -> TapeGraph:
    """The planner's model of ``tape``: node times in seconds (nodes without a time cost 0);
    ``savable``: the values a plan may keep (None: any).

    Nodes that must-only replay never runs have no measured time; no save set makes them run.
    Storages are counted per (storage, epoch): a value kept from before an in-place write into
    its storage is kept on a copy.
    """
    storage_of: dict[tuple[int, int], int] = {}
    storage_bytes: list[int] = []
    value_storage = []
    for v in tape.values:
        key = (v.sid, v.epoch)
        if key not in storage_of:
            storage_of[key] = len(storage_bytes)
            storage_bytes.append(tape.storage_bytes[v.sid])
        value_storage.append(storage_of[key])
    names = tuple(_name(tape, v) for v in tape.values)
    # A storage's last content (epoch) is what Python frees; earlier ones end at their last read.
    last_epoch: dict[int, int] = {}
    for sid, epoch in storage_of:
        last_epoch[sid] = max(epoch, last_epoch.get(sid, epoch))
    freed = getattr(tape, "freed", {})
    storage_freed = tuple(
        freed.get(sid, len(tape.nodes)) if last_epoch[sid] == epoch else -1
        for sid, epoch in storage_of
    )
    return TapeGraph(
        node_time=tuple(float(node_time.get(n.index, 0.0)) for n in tape.nodes),
        node_deps=tuple(tuple(dict.fromkeys(n.deps)) for n in tape.nodes),
        node_outs=tuple(tuple(n.outs) for n in tape.nodes),
        value_storage=tuple(value_storage),
        storage_bytes=tuple(storage_bytes),
        value_names=names,
        demand=frozenset(tape.demand),
        available=frozenset(tape.always_available),
        savable=savable,
        storage_freed=storage_freed,
        anchors=tuple(tape.anchor(v.vid) for v in tape.values),
        module_digests=dict(tape.module_fingerprints),
        token_independent=tape.token_independent,
    )


def _name(tape: Any, v: Any) -> ValueName:
    coord = tape.coord(v.vid)
    return Unproduced(v.kind, v.name, v.vid) if coord is None else coord
