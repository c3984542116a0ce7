"""Pricing torch's checkpoint in plans (``torch_checkpoint_blocks``): what a block gains under
torch.utils.checkpoint comes from measured steps, full checkpointing against must-only. A bucket
measures full-checkpointing control steps before its first plan while one is predicted within the
limit, and its plan is solved again each time its measured full-checkpointing steps double the
number the plan priced torch's checkpoint from."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from ..config import TapeSACConfig
from .measured_times import StepTimes
from .memory_model import MemoryModel
from .profile import RegionProfile
from .solve import torch_checkpoint_gains, torch_checkpoint_peak
from .step_report import Bucket


class TorchCheckpointPricing:
    """Torch's checkpoint priced from the step ``times`` measure under ``config`` (only its
    torch-checkpoint and search settings are read: a new memory limit changes nothing)."""

    def __init__(self, config: TapeSACConfig, times: StepTimes) -> None:
        self.config = config
        self.times = times
        # Per bucket, the full-checkpointing steps its plan priced torch's checkpoint from.
        self._priced_from: dict[Bucket, int] = {}
        # Per bucket, why its last step that could have measured full checkpointing did not.
        self._unmeasured: dict[Bucket, str] = {}

    def measures_full(self, key: Bucket, planned: bool) -> bool:
        """Whether bucket ``key`` still measures full checkpointing against must-only, where it
        is predicted to fit: before its first plan (``planned``: it has one), until
        ``torch_checkpoint_steps`` are measured."""
        return (
            self.config.torch_checkpoint_blocks
            and not planned
            and len(self.times.of(key).full) < self.config.torch_checkpoint_steps
        )

    def full_peak(
        self,
        profiles: Mapping[str, RegionProfile],
        edges: Mapping[str, int],
        memory: MemoryModel,
        primary: int,
    ) -> int | None:
        """The predicted peak of a full-checkpointing step at token counts ``edges`` (``primary``
        the count memory scales with) from the memory model's timeline; None without one, or
        when its blocks do not match the profiles."""
        timeline = memory.timeline(primary)
        if timeline is None:
            return None
        return torch_checkpoint_peak(profiles, edges, timeline, memory.base(primary), self.config)

    def gains(
        self,
        key: Bucket,
        profiles: Mapping[str, RegionProfile],
        edges: Mapping[str, int],
        must_only_seconds: float,
    ) -> dict[str, float] | None:
        """Per region, the seconds a block of bucket ``key`` gains under torch's checkpoint at
        ``edges`` (``torch_checkpoint_gains``) from the bucket's median must-only and
        full-checkpointing steps; None when not asked for or not both measured."""
        times = self.times.of(key)
        if not (self.config.torch_checkpoint_blocks and times.full and times.must_only):
            return None
        return torch_checkpoint_gains(
            profiles,
            edges,
            statistics.median(times.must_only),
            statistics.median(times.full),
            must_only_seconds,
        )

    def note(self, key: Bucket) -> str | None:
        """What ``explain()`` says of torch's checkpoint in bucket ``key``'s plan: the measured
        steps it was priced from, or why it was not measured; None when not asked for."""
        if not self.config.torch_checkpoint_blocks:
            return None
        times = self.times.of(key)
        if not (times.full and times.must_only):
            why = self._unmeasured.get(key, "no full-checkpointing step ran before its first plan")
            if self.config.torch_checkpoint_steps == 0:
                why = "torch_checkpoint_steps is 0"
            return f"torch.utils.checkpoint was not measured for this bucket: {why}"
        full, must_only = statistics.median(times.full), statistics.median(times.must_only)
        verdict = (
            "faster: its blocks may run under it where the capacity allows"
            if full < must_only
            else "not faster: no block runs under it"
        )
        return (
            f"torch.utils.checkpoint: full-checkpointing steps measured {full * 1e3:.1f} ms "
            f"(median of {len(times.full)}) against must-only's {must_only * 1e3:.1f} ms "
            f"(median of {len(times.must_only)}), {verdict}"
        )

    def unmeasured(self, key: Bucket, why: str) -> None:
        """Bucket ``key`` could have measured a full-checkpointing step now and did not: ``why``."""
        self._unmeasured[key] = why

    def priced(self, key: Bucket) -> None:
        """Bucket ``key``'s plan was just solved, priced from its full-checkpointing steps
        measured now."""
        self._priced_from[key] = len(self.times.of(key).full)

    def reprice(self, key: Bucket, planned: bool) -> str | None:
        """Why bucket ``key``'s plan (``planned``: it has one) is solved again, or None: it priced
        torch's checkpoint from half the full-checkpointing steps measured now, or fewer
        (``full_control_every`` steps keep coming). A few single steps misprice it on a busy
        host, and the measured times keep the last 25, so a plan is solved again at most a few
        times. Every rank counts the same steps. A plan restored from a checkpoint counts from
        the steps measured at its first check."""
        if not self.config.torch_checkpoint_blocks or not planned:
            return None
        measured = len(self.times.of(key).full)
        priced = self._priced_from.setdefault(key, measured)
        if measured > priced and measured >= max(2 * priced, self.config.torch_checkpoint_steps):
            return (
                f"it has {measured} full-checkpointing steps measured, its plan priced torch's "
                f"checkpoint from {priced}"
            )
        return None

    def forget(self) -> None:
        """Plans were restored from a checkpoint: each counts from the steps measured at its
        first check."""
        self._priced_from.clear()
