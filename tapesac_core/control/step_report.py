"""The kinds of controller step and what one step did: the seam between the controller and
whatever logs, reports or plots its steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..enums import TextEnum
from ..plan.plan import Plan
from ..tape.block import BlockTrace

Bucket = tuple[int, ...]  # one bucket index per region type, in the controller's region order
V = TypeVar("V")


def bucket_entries(by_bucket: Mapping[Bucket, V]) -> list[tuple[list[int], V]]:
    """``by_bucket`` as a state dict holds it: one ``([43, 12], value)`` per bucket (a state may
    be written as JSON, whose keys are only strings)."""
    return [(list(key), value) for key, value in by_bucket.items()]


def from_bucket_entries(entries: Any) -> dict[Bucket, Any]:
    """The mapping ``bucket_entries`` wrote, or a state's from before version 5."""
    if isinstance(entries, Mapping):
        return {_legacy_bucket(name): value for name, value in entries.items()}
    return {tuple(key): value for key, value in entries}


def _legacy_bucket(name: str) -> Bucket:
    """States before version 5 keyed buckets by name, ``"43,12"``: read so that a run resumed
    from one keeps its plans and times."""
    return tuple(int(x) for x in name.split(","))


class StepMode(TextEnum):
    """What a controller step runs (compares equal to, and is written as, ``"planned"`` etc.)."""

    WARMUP = "warmup"  # must-only, before anything is measured
    PROFILE = "profile"  # must-only, every op of every block timed
    SAMPLE = "sample"  # must-only, metered: the step's memory at new token counts
    CONTROL = "control"  # must-only, timed: what planned steps' speedups are measured against
    PLANNED = "planned"  # the bucket's plan
    FULL = "full"  # every block under torch.utils.checkpoint (opt-in: full_control_every)

    @property
    def must_only(self) -> bool:
        """Whether the step's blocks save only what backward must keep."""
        return self not in (StepMode.PLANNED, StepMode.FULL)


# Short names of the modes, for the controller and its schedule (and their callers).
WARMUP, PROFILE, SAMPLE = StepMode.WARMUP, StepMode.PROFILE, StepMode.SAMPLE
CONTROL, PLANNED, FULL = StepMode.CONTROL, StepMode.PLANNED, StepMode.FULL


@dataclass(kw_only=True)
class StepReport:
    """What one step did, for logs: its mode, plan, time, memory and replay counts."""

    step: int
    mode: StepMode
    tokens: dict[str, int]  # agreed by all ranks (the largest): they set the bucket
    bucket: Bucket
    plan: Plan | None = None
    time: float = 0.0  # seconds, synchronised with the device
    peak: int | None = None  # bytes, when the step was metered
    limit: int = 0  # the memory limit in bytes
    # Bytes blocks kept beyond S0 (all blocks, all micro-batches): recorded blocks' as they kept
    # them, plain blocks' as their plan sizes them for the step's tokens.
    saved_bytes: int = 0
    replayed_nodes: int = 0
    over_budget: int = 0  # planned values not kept: over their block's bytes
    blocks: int = 0
    steady_blocks: int = 0  # blocks run from a cached tape, their checks passed
    diverged_blocks: int = 0  # blocks whose checks failed: their backward ran the forward again
    predicted_speedup: float | None = None
    measured_speedup: float | None = None  # vs must-only control steps of the bucket
    measured_speedup_vs_full: float | None = None  # vs full-checkpointing control steps
    measured_reason: str | None = None  # why measured_speedup is None
    torch_checkpointed: int = 0  # blocks run under torch.utils.checkpoint (full steps, or the plan)
    plain_blocks: int = 0  # blocks the plan ran as without checkpointing (not in ``blocks``)
    offloaded_bytes: int = 0  # bytes the plan's offloading blocks copied to host memory
    copy_time: float = 0.0  # seconds their copies add after overlap, as the plan models them
    predicted_peak: int | None = None  # bytes the plan's memory model predicts for the step
    local_tokens: dict[str, int] = field(default_factory=dict)  # this rank's own batch
    block_traces: list[BlockTrace] = field(default_factory=list, repr=False)

    def count_blocks(self, blocks: list[BlockTrace]) -> None:
        """The step's blocks: how many, what they replayed, kept beyond S0 and could not keep."""
        self.block_traces = blocks
        self.blocks = len(blocks)
        self.steady_blocks = sum(b.steady for b in blocks)
        self.diverged_blocks = sum(b.diverged is not None for b in blocks)
        self.replayed_nodes = sum(len(b.replayed) for b in blocks)
        self.over_budget = sum(b.over_budget for b in blocks)
        self.saved_bytes = sum(
            b.tape.bytes_of(b.saved) - b.tape.bytes_of(b.saved & set(b.tape.mandatory))
            for b in blocks
        )
