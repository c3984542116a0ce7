"""Settings of the automatic planner: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .units import MiB, format_bytes

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


@dataclass(frozen=True, kw_only=True)
class MemoryLimit:
    """A limit on the step's peak memory: a fraction of device memory, or absolute bytes."""

    fraction: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("a memory limit is either a fraction or a number of bytes")

    @property
    def must_only(self) -> bool:
        """A limit of 0, which asks for must-only steps (nothing saved beyond S0)."""
        return self.fraction == 0 or self.bytes == 0

    def of(self, device_bytes: int) -> int:
        """The limit in bytes on a device (or host) with ``device_bytes`` of memory."""
        return self.bytes if self.bytes is not None else int(self.fraction * device_bytes)

    def __str__(self) -> str:
        return (
            f"{self.fraction:g} of device memory"
            if self.fraction is not None
            else format_bytes(self.bytes)
        )


def parse_memory_limit(value: float | int | str | MemoryLimit) -> MemoryLimit:
    """``0.9`` (fraction, 0 forces must-only), ``"20GiB"``/``"800MB"``, or an int of bytes (>= 1 MiB)."""
    if isinstance(value, MemoryLimit):
        return value
    if isinstance(value, bool):
        raise TypeError(f"memory_limit must be a fraction, a size or bytes, got {value!r}")
    if isinstance(value, float):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(
                f"memory_limit {value!r} as a float is a fraction of device memory "
                "and must lie in [0, 1]; for an absolute limit pass a size such as "
                "'20GiB' or an int of bytes"
            )
        return MemoryLimit(fraction=value)
    if isinstance(value, int):
        if value < MiB:
            raise ValueError(
                f"memory_limit {value} as an int is a number of bytes and must be at "
                "least 1 MiB (1048576); for a fraction of device memory pass a float "
                "such as 0.9, for a size a string such as '20GiB'"
            )
        return MemoryLimit(bytes=value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ValueError(
                f"cannot read memory_limit {value!r}: write a number and a unit, "
                "e.g. '20GiB', '800MB' or '1.5TiB'"
            )
        return parse_memory_limit(int(float(match.group(1)) * _UNITS[unit]))
    raise TypeError(
        f"memory_limit must be a float fraction, a size string or an int of bytes, "
        f"got {type(value).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class TapeSACConfig:
    """Everything the controller needs to decide what to save (paper §3.4, Algorithm 1)."""

    memory_limit: MemoryLimit | float | int | str
    warmup_steps: int = 2  # W: must-only steps before profiling
    profile_steps: int = 2  # R: steps timing every block (node time: median over blocks,
    # minimum over steps, see profile.region_profiles)
    control_steps: int = 1  # must-only steps before a bucket's first planned step
    control_every: int = 25  # then one must-only step per this many planned steps (0: never);
    # measured speedup compares them with planned steps of the bucket
    full_control_every: int = 0  # one step with torch.utils.checkpoint on every block per this many
    # planned steps of a bucket (0: never): measured speedup vs full
    # checkpointing; such steps may peak above must-only and are not
    # metered against the limit
    margin: float = 0.02  # safety reserve, fraction of device memory (of the limit if absolute)
    primary_bucket_factor: float = 1.1
    secondary_bucket_factor: float = 1.25
    secondary_regions: frozenset[str] = field(default_factory=frozenset)
    reprofile_factor: float = 2.0  # profile a region again when its tokens exceed this x reference
    resample_tolerance: float = 0.15  # sample memory again when tokens move this far from a sample
    meter_every: int = 25  # on CPU, one planned step of a bucket in this many is metered (not
    # timed): memory outside the blocks that grew or shrank is seen within
    # as many steps (0: a bucket's first only); accelerators meter every one
    near_limit: float = 0.99  # observed peak above this fraction of the limit raises frag;
    # it sits above 1 - margin, where plans fill the capacity to
    # (else every accurate plan would trip it)
    replay_tolerance: float = 0.2  # profiled replay vs measured replay wall time: beyond a factor
    # 1 + this either way the node times are scaled to the wall time
    speedup_band: float = 0.15  # measured / predicted speedup outside 1 ± this ...
    mismatch_windows: int = 3  # ... at this many control steps in a row: profile again
    beam_width: int = 24
    max_set_size: int = 12
    knapsack_resolution: int = 4096
    memory_model: str = "peak"  # "peak": the step's measured memory timeline and the tapes
    # predict each plan's peak (plan.peak); "sum": the paper's Eq. 8
    plain_blocks: bool = True  # the peak-aware planner may run blocks plain (not checkpointed)
    # where memory allows (False: every block is recorded, as before plain blocks existed)
    torch_checkpoint_blocks: bool = False  # the peak-aware planner may also run blocks under
    # torch.utils.checkpoint, where the bucket's full-checkpointing steps measured faster than its
    # must-only ones: torch_checkpoint_steps of each, alternating, before its first plan (run
    # only where a full-checkpointing step is predicted within the limit); the bucket is solved
    # again whenever full_control_every's steps double the full-checkpointing steps measured
    torch_checkpoint_steps: int = 3
    peak_correction: bool = True  # a metered step above the predicted peak by more than the
    # margin adds the error to the model and solves again

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_limit", parse_memory_limit(self.memory_limit))
        object.__setattr__(self, "secondary_regions", frozenset(self.secondary_regions))
        for name in (
            "warmup_steps",
            "profile_steps",
            "control_steps",
            "control_every",
            "full_control_every",
            "meter_every",
            "torch_checkpoint_steps",
        ):
            if getattr(self, name) < (1 if name == "profile_steps" else 0):
                raise ValueError(f"{name} must be >= {1 if name == 'profile_steps' else 0}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin is a fraction of device memory in [0, 1), got {self.margin}")
        if self.primary_bucket_factor <= 1.0 or self.secondary_bucket_factor <= 1.0:
            raise ValueError("bucket factors must be > 1 (e.g. 1.1 and 1.25)")
        if self.reprofile_factor <= 1.0 or not 0.0 < self.resample_tolerance < 1.0:
            raise ValueError("reprofile_factor must be > 1 and resample_tolerance in (0, 1)")
        if not 0.0 < self.near_limit <= 1.0:
            raise ValueError(f"near_limit must lie in (0, 1], got {self.near_limit}")
        if self.replay_tolerance <= 0 or self.speedup_band <= 0 or self.mismatch_windows < 1:
            raise ValueError("replay_tolerance and speedup_band must be > 0, mismatch_windows >= 1")
        if self.memory_model not in ("peak", "sum"):
            raise ValueError(f"memory_model is 'peak' or 'sum' (Eq. 8), got {self.memory_model!r}")
        if self.torch_checkpoint_blocks and self.memory_model != "peak":
            raise ValueError(
                "torch_checkpoint_blocks needs memory_model='peak' (Eq. 8 cannot price a block "
                "that recomputes its forward in backward): set one or the other"
            )
        if self.beam_width < 1 or self.max_set_size < 1 or self.knapsack_resolution < 1:
            raise ValueError("beam_width, max_set_size and knapsack_resolution must be >= 1")
