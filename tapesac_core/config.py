"""Settings of the automatic planner: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import warnings
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
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None  # __post_init__: one of the two is set
        return int(self.fraction * device_bytes)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of device memory"
        assert self.bytes is not None  # __post_init__: one of the two is set
        return format_bytes(self.bytes)


def parse_memory_limit(
    value: float | int | str | MemoryLimit, name: str = "memory_limit"
) -> MemoryLimit:
    """``0.9`` (fraction, 0 forces must-only), ``"20GiB"``/``"800MB"``, or an int of bytes
    (>= 1 MiB); ``name``: the setting, as errors name it."""
    if isinstance(value, MemoryLimit):
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a fraction, a size or bytes, got {value!r}")
    if isinstance(value, float):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(
                f"{name} {value!r} as a float is a fraction of device memory "
                "and must lie in [0, 1]; for an absolute limit pass a size such as "
                "'20GiB' or an int of bytes"
            )
        return MemoryLimit(fraction=value)
    if isinstance(value, int):
        if value < MiB:
            raise ValueError(
                f"{name} {value} as an int is a number of bytes and must be at "
                "least 1 MiB (1048576); for a fraction of device memory pass a float "
                "such as 0.9, for a size a string such as '20GiB'"
            )
        return MemoryLimit(bytes=value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ValueError(
                f"cannot read {name} {value!r}: write a number and a unit, "
                "e.g. '20GiB', '800MB' or '1.5TiB'"
            )
        return parse_memory_limit(int(float(match.group(1)) * _UNITS[unit]), name)
    raise TypeError(
        f"{name} must be a float fraction, a size string or an int of bytes, "
        f"got {type(value).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class TapeSACConfig:
    """Everything the controller needs to decide what to save (paper §3.4, Algorithm 1).

    Each field's one-line help lives in its metadata: docs/configuration.md is generated from it
    (``python -m tapesac_core.config_reference``)."""

    memory_limit: MemoryLimit | float | int | str = field(
        metadata={
            "help": "The limit on the step's peak memory: a float fraction of device memory "
            "in [0, 1] (of physical memory on CPU; 0.0 runs must-only), a size such as "
            "'20GiB' or '800MB', or an int of bytes (at least 1 MiB). Required here and by "
            "Controller; the integrations default to 0.9"
        }
    )
    warmup_steps: int = field(
        default=2, metadata={"help": "Must-only steps before profiling (W in the paper)"}
    )
    profile_steps: int = field(
        default=2,
        metadata={
            "help": "Steps that time every op of every block (R); an op's time is the median "
            "over blocks, the minimum over these steps"
        },
    )
    control_steps: int = field(
        default=1, metadata={"help": "Must-only steps before a bucket's first planned step"}
    )
    control_every: int = field(
        default=25,
        metadata={
            "help": "Then one must-only control step per this many planned steps of a bucket "
            "(0: never); the measured speedup compares planned steps with them"
        },
    )
    full_control_every: int = field(
        default=0,
        metadata={
            "help": "One step with torch.utils.checkpoint on every block per this many planned "
            "steps of a bucket (0: never), for the measured speedup vs full checkpointing; such "
            "steps may peak above must-only and are metered against the limit on accelerators "
            "only"
        },
    )
    margin: float = field(
        default=0.02,
        metadata={
            "help": "Safety reserve kept free under the limit: a fraction of device memory "
            "(of the limit when the limit is absolute)"
        },
    )
    primary_bucket_factor: float = field(
        default=1.1,
        metadata={
            "help": "Token buckets of primary regions are powers of this factor: one plan per "
            "bucket, solved for the most tokens seen in it"
        },
    )
    secondary_bucket_factor: float = field(
        default=1.25,
        metadata={"help": "The bucket factor of the regions named in secondary_regions"},
    )
    secondary_regions: frozenset[str] = field(
        default_factory=frozenset,
        metadata={
            "help": "Region types bucketed by the largest token count seen so far, with "
            "secondary_bucket_factor (e.g. an image encoder beside the text decoder); memory "
            "scales with the other regions' tokens"
        },
    )
    reprofile_factor: float = field(
        default=2.0,
        metadata={
            "help": "Profile a region again when its tokens exceed this times its reference's"
        },
    )
    resample_tolerance: float = field(
        default=0.15,
        metadata={
            "help": "Sample the step's memory again when a new bucket's tokens lie this far "
            "(a fraction) from every sample"
        },
    )
    meter_every: int = field(
        default=25,
        metadata={
            "help": "On CPU, meter (not time) one planned step of a bucket in this many (0: a "
            "bucket's first only), so memory outside the blocks that grew or shrank is seen; "
            "accelerators meter every step"
        },
    )
    near_limit: float = field(
        default=0.99,
        metadata={
            "help": "On an accelerator, an observed peak above this fraction of the limit raises "
            "the fragmentation estimate; it sits above 1 - margin, where plans fill the capacity "
            "to (a CPU meter reads live tensor bytes: nothing fragments, the rule is off)"
        },
    )
    replay_tolerance: float = field(
        default=0.2,
        metadata={
            "help": "When profiled replay time and measured replay wall time differ by more "
            "than a factor 1 + this either way, node times are scaled to the wall time"
        },
    )
    speedup_band: float = field(
        default=0.15,
        metadata={
            "help": "Measured / predicted speedup outside 1 +- this at mismatch_windows control "
            "steps in a row sends every region back to profiling"
        },
    )
    mismatch_windows: int = field(
        default=3,
        metadata={"help": "Control steps in a row outside speedup_band before profiling again"},
    )
    beam_width: int = field(
        default=24,
        metadata={"help": "Save sets kept per round of the beam search over a block's frontier"},
    )
    max_set_size: int = field(
        default=12,
        metadata={
            "help": "Most values one block's save set holds; blocks of many separate matmuls "
            "(eager MoE experts) can use more; search time grows about linearly with it"
        },
    )
    knapsack_resolution: int = field(
        default=4096,
        metadata={
            "help": "Units of the dynamic programs that pick one option per block (the peak "
            "model's span the most bytes a plan can keep, Eq. 8's the capacity); it should well "
            "exceed the number of blocks"
        },
    )
    memory_model: str = field(
        default="peak",
        metadata={
            "help": "'peak': the step's measured memory timeline and the tapes predict each "
            "plan's peak; 'sum': the paper's Eq. 8 (one micro-batch per step enforced)"
        },
    )
    plain_blocks: bool = field(
        default=True,
        metadata={
            "help": "The peak-aware planner may run blocks plain (not checkpointed) where "
            "memory allows; False records every block"
        },
    )
    torch_checkpoint_blocks: bool = field(
        default=False,
        metadata={
            "help": "The peak-aware planner may also run blocks under torch.utils.checkpoint "
            "where the bucket's full-checkpointing steps measured faster than its must-only ones. "
            "Only for blocks whose forward may run twice: torch's checkpoint runs it again in "
            "backward (a forward drawing from its own generator, replacing a buffer it read or "
            "appending to a list gets other gradients, as does a parameter written in place "
            "between forward and backward, which TapeSAC's own blocks refuse)"
        },
    )
    torch_checkpoint_steps: int = field(
        default=3,
        metadata={
            "help": "With torch_checkpoint_blocks: must-only and full-checkpointing steps of "
            "each, alternating, before a bucket's first plan (full ones only where predicted "
            "within the limit)"
        },
    )
    offload_host_limit: MemoryLimit | float | int | str = field(
        default=0.5,
        metadata={
            "help": "Host memory the values plans offload may take (the host pool's buffers, "
            "rounded up to powers of two): a fraction of the host's free memory at the first "
            "solve, or a size such as '64GiB'; 0.0 never offloads. Plans offload only where an "
            "accelerator has a link to host memory (never on CPU)"
        },
    )
    peak_correction: bool = field(
        default=True,
        metadata={
            "help": "A metered step above its predicted peak by more than the margin adds the "
            "error to the memory model and solves again"
        },
    )

    @property
    def parsed_memory_limit(self) -> MemoryLimit:
        """``memory_limit`` in the one form ``__post_init__`` leaves it in."""
        limit = self.memory_limit
        assert isinstance(limit, MemoryLimit)  # __post_init__ parsed it
        return limit

    @property
    def parsed_offload_host_limit(self) -> MemoryLimit:
        """``offload_host_limit`` in the one form ``__post_init__`` leaves it in."""
        limit = self.offload_host_limit
        assert isinstance(limit, MemoryLimit)  # __post_init__ parsed it
        return limit

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_limit", parse_memory_limit(self.memory_limit))
        object.__setattr__(
            self,
            "offload_host_limit",
            parse_memory_limit(self.offload_host_limit, "offload_host_limit"),
        )
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
        _warn_if_plans_reach_near_limit(self.parsed_memory_limit, self.margin, self.near_limit)
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


def _warn_if_plans_reach_near_limit(limit: MemoryLimit, margin: float, near_limit: float) -> None:
    """Plans fill the capacity the margin leaves, a share ``1 - margin`` of an absolute limit
    (``1 - margin / fraction`` of a fractional one). Above ``near_limit``, every metered step of
    a plan that fills it on an accelerator raises the fragmentation estimate and plans shrink
    for no reason (a CPU meter has no allocator: the rule is off there)."""
    if limit.must_only:
        return
    share = limit.fraction if limit.fraction is not None else 1.0  # margin's unit, in limits
    filled = 1 - margin / share
    if filled > near_limit:
        warnings.warn(
            f"TapeSACConfig: margin={margin:g} lets plans fill {filled:.1%} of the limit, above "
            f"near_limit={near_limit:g}: on an accelerator, every metered step of such a plan "
            f"would raise the fragmentation estimate and shrink the plans. Fix: near_limit=1.0, or "
            f"margin={(1 - near_limit) * share:g} or more",
            UserWarning,
            stacklevel=_first_frame_outside_library(),
        )


def _first_frame_outside_library() -> int:
    """The ``stacklevel`` of the first caller outside TapeSAC and ``dataclasses`` (``replace``
    builds a config too): a warning names the user's line whether they built the config, or a
    ``Controller`` or an integration built it from their keywords. Python 3.12's
    ``skip_file_prefixes`` does this; 3.11 has no such argument."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The packages' folders, not every path under ``root`` that starts "tapesac_": a user's
    # script beside them (a repository's ``tapesac_job.py``) is the user's line. "<string>": the
    # ``__init__`` that ``dataclass`` generates.
    packages = ("tapesac_core", "tapesac_lightning", "tapesac_integrations")
    internal = (
        *(os.path.join(root, p) + os.sep for p in packages),
        dataclasses.__file__,
        "<string>",
    )
    frame, level = sys._getframe(1), 1  # this function's caller is the warning's level 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level
