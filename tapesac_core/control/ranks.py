"""What the ranks of a process group agree on each step, so that all of them run one plan: the
largest token counts and flags, the smallest memory budget, and rank 0's solved plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import TapeSACError
from ..plan.plan import Plan
from .budget import Correction
from .plan_cache import ModelKey


class StepAgreement(NamedTuple):
    """What every rank runs a step with: whether it profiles and whether it samples memory (any
    rank's need), the memory correction to apply, whether any rank's memory outside the blocks
    moved, and whether any rank's profiles changed since the plans were solved."""

    profile: bool
    sample: bool
    correction: Correction
    moved: bool
    solve_again: bool = False


class RankAgreement:
    """Collectives over ``group`` (None: the default group) on ``device``'s backend; without an
    initialised group of more than one rank every call returns this rank's own values."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device

    @property
    def distributed(self) -> bool:
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def largest(self, numbers: Sequence[int]) -> list[int]:
        """Each number's largest value over the ranks."""
        if not self.distributed:
            return list(numbers)
        dist = torch.distributed
        t = torch.tensor(list(numbers), dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]

    def largest_tokens(self, tokens: Mapping[str, int], regions: Sequence[str]) -> dict[str, int]:
        """Each region's largest token count over the ranks: all ranks run the bucket of the
        largest token counts."""
        return dict(zip(regions, self.largest([tokens[r] for r in regions])))

    def every(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return not self.largest([int(not flag)])[0]

    def smallest(self, number: int) -> int:
        """The smallest value of ``number`` over the ranks."""
        return -self.largest([-number])[0]

    def step_agreement(
        self, profile: bool, sample: bool, pending: Correction, solve_again: bool = False
    ) -> StepAgreement:
        """Whether a step profiles and samples memory (``profile``, ``sample``: this rank's
        need), and the correction ``pending`` (what this rank's last metered step asked) with
        the largest fragmentation and model error any rank's asked; whether plans are solved
        again (``solve_again``: this rank's profiles changed), any rank's need."""
        profiled, sampled, fragmentation, model_error, moved, again = self.largest(
            [
                int(profile),
                int(sample),
                pending.fragmentation,
                pending.model_error,
                int(pending.outside_growth is not None),
                int(solve_again),
            ]
        )
        # The largest any rank asked; the memory outside the blocks stays this rank's own.
        agreed = dataclasses.replace(pending, fragmentation=fragmentation, model_error=model_error)
        return StepAgreement(bool(profiled), bool(sampled), agreed, bool(moved), bool(again))

    def plan_of_rank_0(self, solve: Callable[[], Plan], model: ModelKey) -> Plan:
        """Rank 0 solves; every rank gets the plan it broadcasts. A failure on rank 0 is raised on
        every rank (the others would otherwise wait in the broadcast)."""
        if not self.distributed:
            return solve()
        dist = torch.distributed
        payload: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                payload = [solve().to_json()]
            except Exception as e:
                payload = [{"error": f"{type(e).__name__}: {e}"}]
        dist.broadcast_object_list(
            payload,
            src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
            group=self.group,
            device=self._collective_device(),
        )
        if isinstance(payload[0], dict):
            raise TapeSACError(f"TapeSAC: solving the plan failed on rank 0: {payload[0]['error']}")
        return Plan.from_json(payload[0], model=model.regions)

    def _collective_device(self) -> torch.device:
        """Where this group's collectives take their tensors: the CPU for gloo, else the
        controller's device (the current CUDA device may be another one: several devices in
        one process, or a rank that never called ``torch.cuda.set_device``)."""
        if self.device.type == "cpu" or torch.distributed.get_backend(self.group) == "gloo":
            return torch.device("cpu")
        return self.device
