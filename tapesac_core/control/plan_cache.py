"""The plan cache as a controller's state carries it: each bucket's solved plan as JSON, for the
model its ``ModelKey`` names."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..plan.plan import Plan
from .step_report import Bucket, bucket_entries, from_bucket_entries

logger = logging.getLogger(__name__)

# States before version 3 hold plans with a time model that could explode (1) or bounded by Eq. 8
# alone (2): they are solved again (after profiling).
_OLDEST_USABLE = 3


@dataclass(frozen=True)
class ModelKey:
    """The model a controller's plans and saved state are for: its region types, sorted."""

    regions: tuple[str, ...]

    @property
    def fingerprint(self) -> str:
        """The form a plan carries it in (``Plan.model``): the region types comma-joined."""
        return ",".join(self.regions)

    def to_state(self) -> list[str]:
        """As a state dict holds it (written as JSON by the HF Trainer)."""
        return list(self.regions)

    def matches_state(self, value: Any) -> bool:
        """Whether a state's ``"model"`` is this key: its region types, or the comma-joined text
        a state before version 6 held (compared as written, not split)."""
        if isinstance(value, str):
            return value == self.fingerprint
        return isinstance(value, (list, tuple)) and tuple(value) == self.regions


def plans_state(plans: Mapping[Bucket, Plan]) -> list[tuple[list[int], str]]:
    """Each bucket's plan as JSON."""
    return bucket_entries({k: p.to_json() for k, p in plans.items()})


def plans_from_state(state: Mapping[str, Any], model: ModelKey, version: int) -> dict[Bucket, Plan]:
    """The plans of a state of this TapeSAC's ``version`` or an older one; none (said at info
    level) when they are too old to use."""
    found = state.get("version", 1)
    if found < _OLDEST_USABLE and state["plans"]:
        logger.info(
            "TapeSAC: state version %s is not this TapeSAC's (version %s: plans with a step "
            "time model and a predicted peak): its %d plans are solved again",
            found,
            version,
            len(state["plans"]),
        )
        return {}
    return {
        k: Plan.from_json(v, model=model.fingerprint)
        for k, v in from_bucket_entries(state["plans"]).items()
    }
