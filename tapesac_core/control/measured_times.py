"""What the controller measures of step times: each bucket's recent control and planned steps,
the speedups they give (and why one is missing), and the check of measured against predicted
speedups."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..measure.step_time import StepTime, outside_per_token
from ..plan.plan import Plan
from .profile import RegionProfile
from .solve import modelled_replay
from .step_report import Bucket, bucket_entries, from_bucket_entries

logger = logging.getLogger(__name__)

_WINDOW = 25  # recent step times per bucket that speed comparisons use


@dataclass(frozen=True, kw_only=True)
class BucketTimes:
    """A bucket's recent step seconds: must-only control, full-checkpointing control, planned."""

    must_only: tuple[float, ...]
    full: tuple[float, ...]
    planned: tuple[float, ...]


class StepTimes:
    """Recent step seconds per bucket and the speedups they measure: the median control step
    over the median planned step, against must-only and full-checkpointing control steps."""

    def __init__(self) -> None:
        self.must_only: dict[Bucket, list[float]] = {}
        self.planned: dict[Bucket, list[float]] = {}
        self.full: dict[Bucket, list[float]] = {}
        # (bucket, tokens, seconds) of recent must-only steps: the time outside replay
        self.must_only_steps: list[tuple[Bucket, dict[str, int], float]] = []
        self._planned_since_control: dict[Bucket, int] = {}
        self._planned_since_full: dict[Bucket, int] = {}

    def of(self, key: Bucket) -> BucketTimes:
        return BucketTimes(
            must_only=tuple(self.must_only.get(key, ())),
            full=tuple(self.full.get(key, ())),
            planned=tuple(self.planned.get(key, ())),
        )

    def add_must_only(self, key: Bucket, tokens: Mapping[str, int], seconds: float) -> None:
        _append(self.must_only, key, seconds)
        self.must_only_steps = [*self.must_only_steps[1 - _WINDOW :], (key, dict(tokens), seconds)]
        self._planned_since_control[key] = 0

    def add_full(self, key: Bucket, seconds: float) -> None:
        _append(self.full, key, seconds)
        self._planned_since_full[key] = 0

    def add_planned(self, key: Bucket, seconds: float | None) -> None:
        """A planned step; ``seconds`` None when it was metered (metering slows a CPU step)."""
        self._planned_since_control[key] = self._planned_since_control.get(key, 0) + 1
        self._planned_since_full[key] = self._planned_since_full.get(key, 0) + 1
        if seconds is not None:
            _append(self.planned, key, seconds)

    def forget_planned(self, key: Bucket | None = None) -> None:
        """Planned steps measured plans about to be replaced: bucket ``key``'s, else all."""
        if key is None:
            self.planned.clear()
        else:
            self.planned.pop(key, None)

    def planned_since_control(self, key: Bucket) -> int:
        return self._planned_since_control.get(key, 0)

    def planned_since_full(self, key: Bucket) -> int:
        return self._planned_since_full.get(key, 0)

    def speedup(self, key: Bucket, vs_full: bool = False) -> float | None:
        """Median control step seconds (must-only, or full checkpointing) over median planned."""
        control = (self.full if vs_full else self.must_only).get(key)
        planned = self.planned.get(key)
        if not control or not planned:
            return None
        return statistics.median(control) / statistics.median(planned)

    def unmeasured_reason(self, key: Bucket, planned: bool) -> str | None:
        """Why the bucket has no measured speedup yet (None when it has one); ``planned``: the
        bucket has a plan."""
        if self.must_only.get(key) and self.planned.get(key):
            return None
        if not planned:
            return "no plan yet for this token bucket (warming up, profiling or sampling memory)"
        if not self.must_only.get(key):
            return "no must-only control step timed in this token bucket yet"
        return (
            "no planned step timed in this token bucket yet (on CPU a bucket's first planned "
            "step is metered for memory, not timed)"
        )

    def modelled_must_only(
        self,
        key: Bucket,
        edges: Mapping[str, int],
        profiles: Mapping[str, RegionProfile],
        primary: Callable[[Mapping[str, int]], int],
    ) -> float:
        """Modelled must-only step seconds at this bucket: the time outside replay plus the
        modelled replay at the bucket's tokens. Outside replay is the median over recent
        must-only steps of (step − its modelled replay) per primary token (``outside_per_token``)
        times the bucket's: this bucket's own steps when it has three, else all of them."""
        replay = modelled_replay(profiles, edges)
        own = [s for s in self.must_only_steps if s[0] == key]
        steps = own if len(own) >= 3 else self.must_only_steps
        rate = outside_per_token(
            (seconds, modelled_replay(profiles, tokens), primary(tokens))
            for _, tokens, seconds in steps
        )
        if rate is None:
            return 1.0 + replay
        return StepTime.model(rate * primary(edges), replay).must_only

    def state_dict(self) -> dict[str, Any]:
        return {
            "must_only_times": bucket_entries(self.must_only),
            "planned_times": bucket_entries(self.planned),
            "full_times": bucket_entries(self.full),
            "must_only_steps": [[list(k), t, s] for k, t, s in self.must_only_steps],
        }

    def load_state_dict(
        self, state: Mapping[str, Any], edges: Callable[[Bucket], dict[str, int]]
    ) -> None:
        """``edges`` stands in for the tokens of must-only steps of version 1 states (kept none)."""
        self.must_only = from_bucket_entries(state["must_only_times"])
        self.planned = from_bucket_entries(state["planned_times"])
        self.full = from_bucket_entries(state.get("full_times", []))  # absent in early states
        self.must_only_steps = [
            (tuple(k), t, s) for k, t, s in state.get("must_only_steps", [])
        ] or [(k, edges(k), s) for k, v in self.must_only.items() for s in v]


class SpeedupWatch:
    """Measured against predicted speedup at each control step: off by more than ``band``
    (relative) at ``windows`` control steps in a row, every region is profiled again, at most
    ``max_reprofiles`` times (profiling again cannot fix a model that is off for other reasons)."""

    def __init__(self, band: float, windows: int, max_reprofiles: int = 2) -> None:
        self.band, self.windows, self.max_reprofiles = band, windows, max_reprofiles
        self._mismatches: dict[Bucket, int] = {}  # control steps in a row off the band
        self.reprofiles = 0

    def profile_again(self, key: Bucket, measured: float | None, plan: Plan) -> bool:
        if measured is None:
            return False
        if abs(measured / plan.predicted_speedup - 1) <= self.band:
            self._mismatches.pop(key, None)
            return False
        self._mismatches[key] = self._mismatches.get(key, 0) + 1
        if self._mismatches[key] < self.windows:
            return False
        self._mismatches.clear()
        if self.reprofiles >= self.max_reprofiles:
            logger.info(
                "TapeSAC: bucket %s measured %.3fx vs predicted %.3fx; already profiled "
                "again %d times, keeping the plan",
                key,
                measured,
                plan.predicted_speedup,
                self.reprofiles,
            )
            return False
        self.reprofiles += 1
        logger.info(
            "TapeSAC: bucket %s measured %.3fx vs predicted %.3fx, beyond %.0f%% for %d "
            "control windows: profiling again\n%s",
            key,
            measured,
            plan.predicted_speedup,
            100 * self.band,
            self.windows,
            plan.explain(measured_speedup=measured),
        )
        return True


def _append(times: dict[Bucket, list[float]], key: Bucket, seconds: float) -> None:
    recent = times.setdefault(key, [])
    recent.append(seconds)
    del recent[:-_WINDOW]
