"""The controller's state as a checkpoint keeps it (``Controller.state_dict``): the plan cache,
memory samples, step times and the hidden writes found, versioned and for the model it names, so
that a resumed run needs no new profiling for known buckets."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..config import TapeSACConfig
from ..errors import TapeSACError
from ..plan.plan import BlockKind, Plan
from ..tape.verify import HiddenWrites
from .measured_times import StepTimes
from .memory_model import MemoryModel
from .plan_cache import ModelKey, plans_from_state, plans_state
from .step_report import Bucket

_STATE_VERSION = 6  # 2: plans carry the step time model; must-only steps keep their tokens
# 3: plans carry their predicted peak (the peak-aware memory model); 4: the memory model keeps
# samples at a reference static and the growth of memory outside the blocks (plans as in 3);
# 5: plans and times per bucket as (bucket indices, value) entries, not keyed "43,12"; 6: the
# model as its list of region types, not their comma-joined text

# States before version 3 hold plans with a time model that could explode (1) or bounded by Eq. 8
# alone (2): they are solved again (after profiling).
_OLDEST_USABLE = 3

logger = logging.getLogger(__name__)


def saved_state(
    model: ModelKey,
    steps: int,
    plans: Mapping[Bucket, Plan],
    memory: MemoryModel,
    times: StepTimes,
    hidden_writes: list[HiddenWrites],
) -> dict[str, Any]:
    """The state of a controller of ``model`` after ``steps`` steps."""
    return {
        "version": _STATE_VERSION,
        "model": model.to_state(),
        "steps": steps,
        "plans": plans_state(plans),
        **memory.state_dict(),
        **times.state_dict(),
        "hidden_writes": HiddenWrites.merged_state(hidden_writes),
    }


def check_model(state: Mapping[str, Any], model: ModelKey) -> None:
    """Refuse a ``state`` saved for another model than ``model``."""
    if not model.matches_state(state.get("model")):
        raise TapeSACError(
            f"TapeSAC state is for region types {state.get('model')!r}, this "
            f"model has {model.to_state()!r}: it comes from another model"
        )


def saved_plans(
    state: Mapping[str, Any], model: ModelKey, config: TapeSACConfig
) -> dict[Bucket, Plan]:
    """The plans of a state of this TapeSAC's version or an older one that ``config`` allows;
    none (said at info level) when they are too old to use."""
    found = state.get("version", 1)
    if found < _OLDEST_USABLE and state["plans"]:
        logger.info(
            "TapeSAC: state version %s is not this TapeSAC's (version %s: plans with a step "
            "time model and a predicted peak): its %d plans are solved again",
            found,
            _STATE_VERSION,
            len(state["plans"]),
        )
        return {}
    plans = plans_from_state(state["plans"], model)
    refused = {k: kind for k, p in plans.items() if (kind := _refused_kind(p, config)) is not None}
    if refused:
        logger.info(
            "TapeSAC: %d restored plans run blocks %s, which this run's settings turn off: they "
            "are solved again",
            len(refused),
            sorted(set(refused.values())),
        )
    return {k: p for k, p in plans.items() if k not in refused}


def _refused_kind(plan: Plan, config: TapeSACConfig) -> str | None:
    """How ``plan`` runs some block that ``config`` does not allow (plain, or under torch's
    checkpoint), if it does."""
    kinds = {k for region in plan.regions.values() for k in region.kinds}
    if BlockKind.TORCH_CHECKPOINT in kinds and not config.torch_checkpoint_blocks:
        return "under torch.utils.checkpoint (torch_checkpoint_blocks)"
    if BlockKind.PLAIN in kinds and not config.plain_blocks:
        return "plain (plain_blocks)"
    return None
