"""A solved plan: per region type, the coordinates each block saves, as versioned JSON data."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..units import format_bytes
from .coords import Anchor, Coord

PLAN_VERSION = 6  # 2: the predicted peak and the memory model that predicted it; 3: plain blocks;
# 4: a kind per block (recorded, plain or under torch.utils.checkpoint); 5: the model as a list of
# its region types (was their comma-joined text); 6: blocks that offload to host memory.
# Version 1 plans (Eq. 8, no predicted peak) are read for reports; versions 2 to 5 are used as they
# are (2 has no plain blocks, 3 names them with a flag per block, none before 6 offloads).
_READABLE = (1, 2, 3, 4, 5, 6)


class BlockKind(Enum):
    """How one block of a plan runs."""

    TAPE = "tape"  # recorded: keeps S0 and its planned values, replays the rest in backward
    PLAIN = "plain"  # as without checkpointing: autograd keeps everything it saves
    TORCH_CHECKPOINT = "torch_checkpoint"  # torch.utils.checkpoint(use_reentrant=False)


@dataclass(frozen=True, kw_only=True)
class Saved:
    """One saved value of a region's reference block, for ``explain``."""

    coord: Coord
    module: str | None
    bytes: int
    time_removed: float  # seconds of replay per block this value removes with the rest of its set


@dataclass(frozen=True, kw_only=True)
class RegionPlan:
    """What one region type saves: a coordinate set per block, in forward order."""

    sequence: str  # fingerprint of the reference op sequence
    blocks: tuple[frozenset[Coord], ...]
    tokens: int  # token count the sizes are for (the most its bucket has seen)
    saved: tuple[Saved, ...] = ()  # the largest set, described for explain()
    note: str = ""  # e.g. why some blocks run must-only
    block_bytes: tuple[int, ...] = ()  # bytes each block's set may keep (the knapsack's weights)
    anchors: tuple[frozenset[Anchor], ...] = ()  # each block's set anchored on submodules
    modules: Mapping[str, str] = field(default_factory=dict)  # their op digests in the reference
    kinds: tuple[BlockKind, ...] = ()  # per block, how it runs (empty: every block recorded)
    # Per block, whether it copies what it holds to host memory after its forward and back
    # ahead of its backward (``tape/offload.py``; empty: none does).
    offloaded: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.offloaded and len(self.offloaded) != len(self.blocks):
            raise ValueError(
                f"one offload flag per block: {len(self.blocks)} blocks, {len(self.offloaded)} flags"
            )
        bad = [i for i, o in enumerate(self.offloaded) if o and self.kind(i) is not BlockKind.TAPE]
        if bad:
            raise ValueError(f"only recorded blocks offload: block {bad[0]} is {self.kind(bad[0])}")

    def kind(self, block: int) -> BlockKind:
        return self.kinds[block % len(self.kinds)] if self.kinds else BlockKind.TAPE

    def plain_bytes(self, tokens: int) -> int:
        """Bytes the plain blocks keep beyond must-only on a batch of ``tokens`` (scaled from
        the plan's; blocks under torch's checkpoint keep nothing of their forward)."""
        kept = sum(b for i, b in enumerate(self.block_bytes) if self.kind(i) is BlockKind.PLAIN)
        return round(kept * tokens / self.tokens)

    def block_entries(self) -> list[int | str]:
        """Per block, the values it saves, or how it runs when not recorded ("plain", "torch
        checkpoint"): the plan table's column."""
        return [_KIND_NAMES.get(self.kind(i), len(b)) for i, b in enumerate(self.blocks)]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A plan for one token bucket, with its predictions."""

    model: tuple[str, ...]  # the model's region types, sorted
    regions: Mapping[str, RegionPlan]
    capacity: int  # bytes the step may use (Eq. 9)
    base: int  # must-only step peak at the bucket's tokens
    saved_bytes: int  # bytes the plan keeps beyond S0, all blocks
    predicted_speedup: float  # vs must-only
    predicted_speedup_vs_full: float  # vs torch's block recomputation of everything
    version: int = PLAN_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)
    step_time: float = 0.0  # modelled must-only step, seconds (0: unknown)
    replay_time: float = 0.0  # its modelled replay, seconds
    memory_model: str = "sum"  # "sum" (Eq. 8) or "peak" (the timeline model)
    predicted_peak: int = 0  # the step peak the memory model predicts (0: unknown)
    peak_at: str = ""  # where in the step it falls
    static: int = 0  # of the peak, what does not scale with tokens
    offloaded_bytes: int = 0  # bytes the offloading blocks copy to host memory, all blocks
    copy_time: float = 0.0  # modelled seconds their copies add to the step after overlap
    # Where no plan fits: blocks that could not offload, the link too slow (``too_slow``).
    offload_refused: int = 0

    def peak_at_tokens(self, base: int, factor: float) -> int:
        """The predicted peak for a step of the bucket whose must-only peak is ``base`` and whose
        tokens are ``factor`` times the plan's (it is solved for the bucket's tokens, where its
        must-only peak is ``self.base``): that must-only peak as measured, plus what the plan adds
        to it scaled with tokens (saved values and replay temporaries grow with them, §3.4.1).
        Scaling the addition with the must-only peak's growth instead under-predicts: that
        peak also holds memory that does not grow with tokens (gradients, routing tables)."""
        if not self.predicted_peak:
            return self.predicted_peak
        return round(base + (self.predicted_peak - self.base) * factor)

    def plain_bytes(self, tokens: Mapping[str, int]) -> int:
        """Bytes the plan's plain blocks keep beyond must-only on a batch of ``tokens`` per
        region: with the recorded blocks' saved bytes, what the plan keeps (``explain``)."""
        return sum(p.plain_bytes(tokens[r]) for r, p in self.regions.items() if r in tokens)

    def coordinates(self) -> dict[str, list[frozenset[Coord]]]:
        """The form ``use_plan`` takes: per region, one coordinate set per block."""
        return {r: list(p.blocks) for r, p in self.regions.items()}

    def budgets(self) -> dict[str, list[int]]:
        """Per region, the bytes each block's set may keep beyond S0 (at ``tokens``)."""
        return {r: list(p.block_bytes) for r, p in self.regions.items() if p.block_bytes}

    def anchors(self) -> dict[str, tuple[list[frozenset[Anchor]], Mapping[str, str]]]:
        """Per region, each block's set anchored on submodules, and the submodules' op digests:
        what a block whose op sequence differs from the reference's can still match."""
        return {r: (list(p.anchors), p.modules) for r, p in self.regions.items() if p.anchors}

    def offloading(self) -> dict[str, list[bool]]:
        """Per region with a block that offloads, whether each block does."""
        return {r: list(p.offloaded) for r, p in self.regions.items() if any(p.offloaded)}

    def block_kinds(self) -> dict[str, list[BlockKind]]:
        """Per region with a block not recorded, how each block runs."""
        return {r: list(p.kinds) for r, p in self.regions.items() if _unrecorded(p.kinds)}

    def sequences(self) -> dict[str, str]:
        """Per region, the op-sequence fingerprint the coordinates are valid for."""
        return {r: p.sequence for r, p in self.regions.items()}

    @property
    def empty(self) -> bool:
        """True when every block is recorded and saves nothing beyond the mandatory set."""
        return not any(b for p in self.regions.values() for b in p.blocks) and not any(
            _unrecorded(p.kinds) or any(p.offloaded) for p in self.regions.values()
        )

    def to_json(self) -> str:
        """Versioned JSON (never pickle)."""
        return json.dumps(
            {
                "version": self.version,
                "model": list(self.model),
                "capacity": self.capacity,
                "base": self.base,
                "saved_bytes": self.saved_bytes,
                "predicted_speedup": self.predicted_speedup,
                "predicted_speedup_vs_full": self.predicted_speedup_vs_full,
                "notes": list(self.notes),
                "step_time": self.step_time,
                "replay_time": self.replay_time,
                "memory_model": self.memory_model,
                "predicted_peak": self.predicted_peak,
                "peak_at": self.peak_at,
                "static": self.static,
                **(
                    {"offloaded_bytes": self.offloaded_bytes, "copy_time": self.copy_time}
                    if self.offloaded_bytes
                    else {}
                ),
                **({"offload_refused": self.offload_refused} if self.offload_refused else {}),
                "regions": {
                    r: {
                        "sequence": p.sequence,
                        "tokens": p.tokens,
                        "note": p.note,
                        "blocks": [sorted(map(list, b)) for b in p.blocks],
                        "block_bytes": list(p.block_bytes),
                        "anchors": [sorted(map(list, b)) for b in p.anchors],
                        "modules": dict(p.modules),
                        **({"kinds": [k.value for k in p.kinds]} if p.kinds else {}),
                        **({"offloaded": list(p.offloaded)} if p.offloaded else {}),
                        "saved": [
                            {
                                "coord": list(s.coord),
                                "module": s.module,
                                "bytes": s.bytes,
                                "time_removed": s.time_removed,
                            }
                            for s in p.saved
                        ],
                    }
                    for r, p in self.regions.items()
                },
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(
        cls,
        text: str,
        *,
        model: Sequence[str] | None = None,
        regions: Mapping[str, str] | None = None,
    ) -> Plan:
        """Read a plan; ``model`` (region types) and ``regions`` (name -> op-sequence fingerprint)
        check it fits."""
        data = json.loads(text)
        if data.get("version") not in _READABLE:
            raise ValueError(
                f"plan file has version {data.get('version')!r}; this TapeSAC reads "
                f"version {PLAN_VERSION}. Solve the plan again (delete the plan cache)"
            )
        solved_for = _model(data["model"])
        if model is not None and solved_for != tuple(model):
            raise ValueError(
                f"plan was solved for a model of region types {', '.join(solved_for)}, not "
                f"{', '.join(model)}: it comes from another model. Solve the plan again"
            )
        plan = cls(
            model=solved_for,
            capacity=data["capacity"],
            base=data["base"],
            saved_bytes=data["saved_bytes"],
            predicted_speedup=data["predicted_speedup"],
            predicted_speedup_vs_full=data["predicted_speedup_vs_full"],
            notes=tuple(data["notes"]),
            step_time=float(data.get("step_time", 0.0)),
            replay_time=float(data.get("replay_time", 0.0)),
            version=data["version"],
            memory_model=str(data.get("memory_model", "sum")),
            predicted_peak=int(data.get("predicted_peak", 0)),
            peak_at=str(data.get("peak_at", "")),
            static=int(data.get("static", 0)),
            offloaded_bytes=int(data.get("offloaded_bytes", 0)),
            copy_time=float(data.get("copy_time", 0.0)),
            offload_refused=int(data.get("offload_refused", 0)),
            regions={
                r: RegionPlan(
                    sequence=p["sequence"],
                    tokens=p["tokens"],
                    note=p["note"],
                    blocks=tuple(frozenset(_coord(c) for c in b) for b in p["blocks"]),
                    block_bytes=tuple(int(b) for b in p.get("block_bytes", ())),
                    anchors=tuple(frozenset(_anchor(a) for a in b) for b in p.get("anchors", ())),
                    modules=dict(p.get("modules", {})),
                    kinds=_kinds(p),
                    offloaded=tuple(bool(o) for o in p.get("offloaded", ())),
                    saved=tuple(
                        Saved(
                            coord=_coord(s["coord"]),
                            module=s["module"],
                            bytes=s["bytes"],
                            time_removed=s["time_removed"],
                        )
                        for s in p["saved"]
                    ),
                )
                for r, p in data["regions"].items()
            },
        )
        if regions is not None and plan.sequences() != dict(regions):
            raise ValueError(
                f"plan covers regions {plan.sequences()}, the model has {dict(regions)}: "
                "the region set or a block's op sequence changed. Solve the plan again"
            )
        return plan

    def explain(self, measured_speedup: float | None = None) -> str:
        """A readable table per region type: what is saved, its bytes and the replay time it
        removes (outputs of one op saved together remove that op's time once: it is shown on
        the first of them); the header gives the bucket, the predicted speedup, its step model,
        and ``measured_speedup`` (the controller's, must-only vs planned steps of the bucket)
        when given."""
        tokens = ", ".join(f"{p.tokens} ({r})" for r, p in sorted(self.regions.items()))
        measured = (
            "" if measured_speedup is None else f"; measured {measured_speedup:.3f}x vs must-only"
        )
        model = (
            f"; must-only step modelled {self.step_time * 1e3:.3f} ms, of which replay "
            f"{self.replay_time * 1e3:.3f} ms"
            if self.step_time > 0
            else ""
        )
        # Offloaded blocks' saved values count among those saved, on the host between copies.
        offloads = (
            f" (offloads about {format_bytes(self.offloaded_bytes)} to host memory)"
            if self.offloaded_bytes
            else ""
        )
        lines = [
            f"TapeSAC plan for up to {tokens} tokens: capacity {format_bytes(self.capacity)}, "
            f"must-only peak {format_bytes(self.base)}, saves {format_bytes(self.saved_bytes)} "
            f"more{offloads}; predicted speedup {self.predicted_speedup:.3f}x vs must-only, "
            f"{self.predicted_speedup_vs_full:.3f}x vs full recomputation{measured}{model}"
        ]
        if self.predicted_peak:
            how = (
                "Eq. 8: every saved byte at once"
                if self.memory_model == "sum"
                else "peak-aware timeline model"
            )
            lines.append(
                f"predicted step peak {format_bytes(self.predicted_peak)} ({how}), "
                f"at {self.peak_at or 'the start of backward'}"
            )
        if self.offload_refused:
            lines.append(
                f"offloading refused for {self.offload_refused} blocks: the link to host memory "
                "is too slow (their copies would wait longer than the compute that hides them)"
            )
        if self.offloaded_bytes:
            lines.append(
                f"offloads about {format_bytes(self.offloaded_bytes)} a step to host memory; its "
                f"copies add {self.copy_time * 1e3:.3f} ms after overlap with compute (both "
                "modelled; tapesac/offloaded_bytes is what a step copied)"
            )
        for region, p in sorted(self.regions.items()):
            offloaded = [str(i) for i, o in enumerate(p.offloaded) if o]
            lines.append(
                f"region {region} ({len(p.blocks)} blocks at {p.tokens} tokens; values "
                f"saved per block: [{', '.join(map(str, p.block_entries()))}]"
                + (f"; blocks offloaded: [{', '.join(offloaded)}]" if offloaded else "")
                + ")"
                + (f" - {p.note}" if p.note else "")
            )
            lines.extend(_table(p.saved))
        lines.extend(self.notes)
        return "\n".join(lines)


def _table(saved: tuple[Saved, ...]) -> list[str]:
    """Rows of saved values, columns as wide as their longest entry."""
    if not saved:
        return []
    rows, previous = [], None
    for s in saved:
        op, k, j = s.coord
        time = "(same op)" if (op, k) == previous else f"{s.time_removed * 1e3:.3f} ms"
        rows.append(
            (
                f"{op} #{k} out {j}",
                s.module or "-",
                format_bytes(s.bytes),
                time,
            )
        )
        previous = (op, k)
    header = ("coordinate", "module", "bytes", "time removed")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    return [
        f"  {c:{widths[0]}s}  {m:{widths[1]}s}  {b:>{widths[2]}s}  {t:>{widths[3]}s}"
        for c, m, b, t in (header, *rows)
    ]


_KIND_NAMES = {BlockKind.PLAIN: "plain", BlockKind.TORCH_CHECKPOINT: "torch checkpoint"}


def _unrecorded(kinds: tuple[BlockKind, ...]) -> bool:
    return any(k is not BlockKind.TAPE for k in kinds)


def _kinds(region: Mapping) -> tuple[BlockKind, ...]:
    """Per block, how it runs: version 4's kinds, version 3's plain flags, none before."""
    if "kinds" in region:
        return tuple(BlockKind(k) for k in region["kinds"])
    return tuple(BlockKind.PLAIN if b else BlockKind.TAPE for b in region.get("plain", ()))


def _anchor(a: list) -> Anchor:
    return Anchor(str(a[0]), str(a[1]), int(a[2]), int(a[3]))


def _model(value: str | list[str]) -> tuple[str, ...]:
    """A plan's region types. Versions before 5 wrote them comma-joined: read so that plan files
    already on disk keep loading."""
    return tuple(value.split(",")) if isinstance(value, str) else tuple(value)


def _coord(c: list) -> Coord:
    return Coord(str(c[0]), int(c[1]), int(c[2]))
