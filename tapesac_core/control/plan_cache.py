"""The plan cache: each token bucket's solved plan, kept until the bucket is solved again, and as a
controller's state carries it (each plan as JSON, for the model its ``ModelKey`` names)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..plan.plan import Plan
from .measured_times import StepTimes
from .schedule import StepSchedule
from .step_report import Bucket, bucket_entries, from_bucket_entries
from .token_buckets import TokenBuckets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelKey:
    """The model a controller's plans and saved state are for: its region types, sorted."""

    regions: tuple[str, ...]

    def to_state(self) -> list[str]:
        """As a state dict holds it (written as JSON by the HF Trainer)."""
        return list(self.regions)

    def matches_state(self, value: Any) -> bool:
        """Whether a state's ``"model"`` is this key: its region types, or the comma-joined text
        a state before version 6 held (compared as written, not split)."""
        if isinstance(value, str):
            return value == ",".join(self.regions)
        return isinstance(value, (list, tuple)) and tuple(value) == self.regions


def solved_for(plan: Plan) -> dict[str, int]:
    """Per region, the token counts ``plan`` was solved for."""
    return {r: p.tokens for r, p in plan.regions.items()}


class PlanCache:
    """Each token bucket's plan, solved when a planned step (or ``plan_for``) first needs it and
    kept until the bucket is solved again. Forgetting a plan forgets what was measured of it: its
    planned steps' times, and the schedule's count of its metered and recorded steps."""

    def __init__(self, schedule: StepSchedule, times: StepTimes) -> None:
        self.plans: dict[Bucket, Plan] = {}
        # Each forgotten bucket's last plan, until it is solved again: the choices the new
        # solve keeps unless a change clearly gains (``plan.hysteresis``).
        self.previous: dict[Bucket, Plan] = {}
        self.schedule = schedule
        self.times = times

    def store(self, key: Bucket, plan: Plan, edges: Mapping[str, int]) -> None:
        """Bucket ``key``'s plan, just solved for token counts ``edges``."""
        self.plans[key] = plan
        self.previous.pop(key, None)
        logger.info("TapeSAC solved bucket %s (tokens %s):\n%s", key, edges, plan.explain())

    def outgrown(self, key: Bucket, tokens: Mapping[str, int]) -> Plan | None:
        """Bucket ``key``'s plan when ``tokens`` are more than it was solved for in some region;
        None when they are not, or the bucket has no plan."""
        plan = self.plans.get(key)
        if plan is None or all(tokens[r] <= p.tokens for r, p in plan.regions.items()):
            return None
        return plan

    def solve_again(self, key: Bucket, why: str) -> None:
        """Bucket ``key`` is solved again at its next planned step, for ``why``; its planned
        steps' times, of the old plan, are dropped."""
        logger.info("TapeSAC: bucket %s is solved again: %s", key, why)
        self.previous[key] = self.plans.pop(key)
        self.schedule.forget_plan(key)
        self.times.forget_planned(key)

    def forget(self, *, keep_previous: bool = True) -> None:
        """Every bucket is solved again (and its first planned step metered again on CPU), each
        favouring the plan it replaces where ``keep_previous`` (the same limit, solved again
        for noise or memory corrections); a new limit's plans owe nothing to the old ones."""
        if keep_previous:
            self.previous.update(self.plans)
        else:
            self.previous.clear()
        self.plans.clear()
        self.schedule.forget_plans()

    def restore(self, plans: dict[Bucket, Plan], buckets: TokenBuckets) -> None:
        """The plans of a resumed run (``saved_plans``): the bucket of each plan of every
        region has seen the tokens it was solved for."""
        self.plans, self.previous = plans, {}
        for key, plan in plans.items():
            if set(plan.regions) == set(buckets.regions):
                buckets.restore(key, solved_for(plan))


def plans_state(plans: Mapping[Bucket, Plan]) -> list[tuple[list[int], str]]:
    """Each bucket's plan as JSON."""
    return bucket_entries({k: p.to_json() for k, p in plans.items()})


def plans_from_state(entries: Any, model: ModelKey) -> dict[Bucket, Plan]:
    """The plans ``plans_state`` wrote (or a state's from before version 5), for ``model``."""
    return {
        k: Plan.from_json(v, model=model.regions) for k, v in from_bucket_entries(entries).items()
    }
