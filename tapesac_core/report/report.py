"""What a finished run planned and achieved, read back from what it left: a TensorBoard folder, a
Lightning checkpoint (file, or sharded folder with ``meta.pt``), or an Accelerate ``save_state``
folder. ``read_run`` gives a ``RunReport``: text for people, JSON for machines, and figures."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import metric_names as names
from ..control.step_report import from_bucket_entries
from ..errors import TapeSACError
from ..plan.plan import Plan
from ..units import format_bytes
from .figures import MeasuredPoint


@dataclass(frozen=True, kw_only=True)
class BucketReport:
    """One token bucket: its plan and the steps measured in it."""

    tokens: dict[str, int]
    plan: Plan
    planned: MeasuredPoint | None  # planned steps' seconds
    must_only: MeasuredPoint | None  # interleaved must-only control steps' seconds

    @property
    def measured_speedup(self) -> float | None:
        """Median must-only step time over median planned step time."""
        if self.planned is None or self.must_only is None:
            return None
        return self.must_only.seconds / self.planned.seconds


@dataclass(frozen=True, kw_only=True)
class LoggedPlan:
    """A plan as the integrations log it when solved, with the measured speedup its table shows."""

    plan: Plan
    measured_speedup: float | None = None

    def text(self) -> str:
        """The plan's ``explain()`` table."""
        return self.plan.explain(self.measured_speedup)

    def to_json(self) -> str:
        """As logged under ``metric_names.PLAN_JSON``: the plan's own JSON and the speedup."""
        return json.dumps({"plan": self.plan.to_json(), "measured_speedup": self.measured_speedup})

    @classmethod
    def from_json(cls, text: str) -> LoggedPlan:
        """Read what ``to_json`` wrote."""
        data = json.loads(text)
        return cls(plan=Plan.from_json(data["plan"]), measured_speedup=data["measured_speedup"])


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """A run's plans, per-bucket or per-step figures, and how it was read."""

    source: str
    kind: str  # tensorboard | lightning | accelerate
    buckets: list[BucketReport] = field(default_factory=list)
    plans_logged: list[tuple[int, LoggedPlan]] = field(default_factory=list)  # (step, plan)
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    frontier_png: bytes | None = None  # the last frontier image a run logged

    def text(self) -> str:
        """Plan tables and predicted vs measured speedups and peaks, for a terminal."""
        lines = [f"TapeSAC report of {self.source} ({self.kind})"]
        for b in self.buckets:
            lines.append("")
            lines.append(b.plan.explain())
            lines.append(_measured_line(b))
        for step, logged in self.plans_logged:
            lines += ["", f"plan logged at step {step}:", logged.text()]
        lines += [line for line in (self._speedups(), self._peaks()) if line]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The same content as plain data."""
        return {
            "source": self.source,
            "kind": self.kind,
            "buckets": [
                {
                    "tokens": b.tokens,
                    "plan": b.plan.to_json(),
                    "predicted_speedup": b.plan.predicted_speedup,
                    "measured_speedup": b.measured_speedup,
                    "planned_steps": _point_json(b.planned),
                    "must_only_steps": _point_json(b.must_only),
                }
                for b in self.buckets
            ],
            "plans_logged": [
                {"step": s, "text": p.text(), "plan": p.plan.to_json()}
                for s, p in self.plans_logged
            ],
            "scalars": {k: [list(p) for p in v] for k, v in self.scalars.items()},
        }

    def figures(self) -> dict[str, Any]:
        """Matplotlib figures by file name: speedups per bucket (checkpoints) or speedups and
        peaks over steps (TensorBoard runs)."""
        from .figures import speedup_by_bucket_figure, timeline_figure

        out = {}
        if self.buckets:
            out["speedup_by_bucket.png"] = speedup_by_bucket_figure(
                [
                    (max(b.tokens.values()), b.plan.predicted_speedup, b.measured_speedup)
                    for b in self.buckets
                ]
            )
        if self.scalars:
            out["timeline.png"] = timeline_figure(self.scalars)
        return out

    def _speedups(self) -> str:
        parts = []
        for name, what in (
            (names.PREDICTED_SPEEDUP, "predicted speedup vs must-only"),
            (names.MEASURED_SPEEDUP, "measured speedup vs must-only"),
            (names.MEASURED_SPEEDUP_VS_FULL, "measured speedup vs full checkpointing"),
        ):
            values = [v for _, v in self.scalars.get(name, [])]
            if values:
                p = MeasuredPoint.of(name, values)
                parts.append(
                    f"{what}, as logged each step: median {p.seconds:.3f}x "
                    f"(IQR {p.q1:.3f}-{p.q3:.3f}, {p.count} steps)"
                )
        return "\n".join(parts)

    def _peaks(self) -> str:
        peaks = [v for _, v in self.scalars.get(names.PEAK_MEMORY_BYTES, [])]
        limits = [v for _, v in self.scalars.get(names.MEMORY_LIMIT_BYTES, [])]
        if not peaks:
            return ""
        limit = f" against the limit {format_bytes(limits[-1])}" if limits else ""
        return f"peak memory: max {format_bytes(max(peaks))} over {len(peaks)} metered steps{limit}"


def read_run(path: str | Path) -> RunReport:
    """Read a TensorBoard folder, a Lightning checkpoint or an Accelerate ``save_state`` folder."""
    path = Path(path)
    if not path.exists():
        raise TapeSACError(
            f"{path} does not exist. Fix: pass a TensorBoard run folder, a Lightning "
            "checkpoint or an Accelerate save_state folder"
        )
    if path.is_dir() and list(path.rglob("events.out.tfevents.*")):
        return _from_tensorboard(path)
    if path.is_file():
        return _from_state(
            path,
            "lightning",
            _lightning_state(torch.load(path, map_location="cpu", weights_only=False)),
        )
    if (path / "meta.pt").is_file():
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
        return _from_state(path, "lightning", _lightning_state(meta))
    for pickle in sorted(path.glob("custom_checkpoint_*.pkl")):
        state = torch.load(pickle, map_location="cpu", weights_only=False)
        if isinstance(state, Mapping) and "plans" in state:
            return _from_state(path, "accelerate", state)
    raise TapeSACError(
        f"{path} holds no TapeSAC state: no TensorBoard events, no Lightning "
        "checkpoint with TapeSAC's callback state, no Accelerate "
        "custom_checkpoint_*.pkl with a plan cache"
    )


def _lightning_state(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    state = checkpoint.get("callbacks", {}).get(names.STATE_KEY)
    if not state:
        raise TapeSACError(
            "the Lightning checkpoint has no TapeSAC state: was it written by a run "
            "with TapeSACFSDPStrategy?"
        )
    return state


def _from_state(path: Path, kind: str, state: Mapping[str, Any]) -> RunReport:
    """Buckets of a controller's ``state_dict``: plans and the step times it kept."""
    buckets = []
    plans = from_bucket_entries(state["plans"])
    planned_times = from_bucket_entries(state["planned_times"])
    must_only_times = from_bucket_entries(state["must_only_times"])
    for key in sorted(plans):
        plan = Plan.from_json(plans[key])
        planned, must = planned_times.get(key), must_only_times.get(key)
        buckets.append(
            BucketReport(
                tokens={r: p.tokens for r, p in plan.regions.items()},
                plan=plan,
                planned=MeasuredPoint.of("planned", planned) if planned else None,
                must_only=MeasuredPoint.of("must-only", must) if must else None,
            )
        )
    return RunReport(source=str(path), kind=kind, buckets=buckets)


def _from_tensorboard(path: Path) -> RunReport:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    # A logger folder may hold several runs (version_0, version_1, ...): the newest.
    runs: dict[Path, list[Path]] = {}
    for events in path.rglob("events.out.tfevents.*"):
        runs.setdefault(events.parent, []).append(events)
    newest = max(runs, key=lambda d: max(e.stat().st_mtime for e in runs[d]))
    scalars: dict[str, list[tuple[int, float]]] = {}
    plans, png = [], None
    for events in sorted(runs[newest]):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags["scalars"]:
            if tag.startswith(names.PREFIX):
                scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        if names.PLAN_JSON_EVENTS in tags["tensors"]:
            plans += [
                (e.step, LoggedPlan.from_json(make_ndarray(e.tensor_proto).item().decode()))
                for e in acc.Tensors(names.PLAN_JSON_EVENTS)
            ]
        if names.FRONTIER_IMAGE in tags["images"]:
            png = acc.Images(names.FRONTIER_IMAGE)[-1].encoded_image_string
    if not scalars:
        raise TapeSACError(
            f"the TensorBoard events under {path} hold no tapesac/* scalars: was "
            "the run trained with TapeSAC and a TensorBoard logger?"
        )
    source = str(newest) + (
        f" (the newest of {len(runs)} runs under {path})" if len(runs) > 1 else ""
    )
    return RunReport(
        source=source,
        kind="tensorboard",
        plans_logged=plans,
        scalars={k: sorted(v) for k, v in scalars.items()},
        frontier_png=png,
    )


def _measured_line(b: BucketReport) -> str:
    if b.planned is None or b.must_only is None:  # no measured_speedup
        return (
            f"measured: no speedup yet ({'no' if b.planned is None else b.planned.count} "
            f"planned and {'no' if b.must_only is None else b.must_only.count} must-only "
            "steps kept for this bucket)"
        )
    return (
        f"measured speedup vs must-only {b.measured_speedup:.3f}x: planned steps median "
        f"{b.planned.seconds * 1e3:.1f} ms (IQR {b.planned.q1 * 1e3:.1f}-{b.planned.q3 * 1e3:.1f}, "
        f"{b.planned.count} steps), must-only median {b.must_only.seconds * 1e3:.1f} ms "
        f"({b.must_only.count} steps)"
    )


def _point_json(p: MeasuredPoint | None) -> dict[str, float] | None:
    return (
        None if p is None else {"median_s": p.seconds, "q1_s": p.q1, "q3_s": p.q3, "count": p.count}
    )


# ---------------------------------------------------------------------- a run's own steps

_MUST_ONLY_MODES = ("control", "warmup")


@dataclass(frozen=True, kw_only=True)
class Speedup:
    """Measured speedup of planned steps over control steps of their own token bucket: per
    planned step, the median control step time of its bucket over its time; the median of those
    ratios with quartiles, over ``count`` planned steps, against ``controls`` control steps."""

    median: float
    q1: float
    q3: float
    count: int
    controls: int

    def text(self, against: str) -> str:
        return (
            f"measured speedup vs {against}: {self.median:.3f}x median over {self.count} "
            f"planned steps (IQR {self.q1:.3f}-{self.q3:.3f}), against {self.controls} "
            f"interleaved control steps of their buckets"
        )


def measured_speedup(
    steps: list[Mapping[str, Any]], control_modes: tuple[str, ...]
) -> Speedup | None:
    """``Speedup`` of a run's step records (``mode``, ``bucket``, ``time`` in seconds, ``peak``)
    over its control steps in ``control_modes``. The run's first step (one-time costs) and
    metered steps (metering slows a step on CPU) are left out; None without a pair."""
    timed = [s for s in steps[1:] if s.get("peak") is None]
    controls: dict[tuple, list[float]] = {}
    for s in timed:
        if s["mode"] in control_modes:
            controls.setdefault(tuple(s["bucket"]), []).append(s["time"])
    ratios = [
        statistics.median(controls[tuple(s["bucket"])]) / s["time"]
        for s in timed
        if s["mode"] == "planned" and tuple(s["bucket"]) in controls
    ]
    if not ratios:
        return None
    point = MeasuredPoint.of("ratio", ratios)
    used = {tuple(s["bucket"]) for s in timed if s["mode"] == "planned"}
    return Speedup(
        median=point.seconds,
        q1=point.q1,
        q3=point.q3,
        count=point.count,
        controls=sum(len(v) for k, v in controls.items() if k in used),
    )


def run_summary(
    steps: list[Mapping[str, Any]],
    limit: int,
    plan: Plan | None,
    headroom: tuple[int, int] | None = None,
    measured: float | None = None,
) -> str:
    """A run's closing summary from its own step records: step counts by mode, measured
    speedups vs must-only and vs full checkpointing (medians with spread and counts), the
    predicted speedup, peak against the limit (and, given ``headroom`` = (must-only peak, peak
    with everything useful saved) of the final plan's bucket, where the limit sits between
    them), and the plan in effect at the end (with the controller's ``measured`` speedup of its
    bucket)."""
    modes = [s["mode"] for s in steps]
    lines = [
        f"TapeSAC: {len(steps)} steps: {modes.count('planned')} planned, "
        f"{modes.count('control')} must-only control, {modes.count('full')} "
        f"full-checkpointing control, {len(steps) - sum(modes.count(m) for m in ('planned', 'control', 'full'))} "
        "warm-up/profiling/sampling"
    ]
    for modes_, against in (
        (_MUST_ONLY_MODES, "must-only"),
        (("full",), "full checkpointing (torch.utils.checkpoint)"),
    ):
        speedup = measured_speedup(steps, modes_)
        lines.append(
            speedup.text(against)
            if speedup
            else f"measured speedup vs {against}: none (no timed planned step shares a "
            "bucket with such control steps)"
        )
    predicted = [s["predicted"] for s in steps if s["mode"] == "planned" and s.get("predicted")]
    if predicted:
        lines.append(
            f"predicted speedup vs must-only: {statistics.median(predicted):.3f}x median "
            f"over {len(predicted)} planned steps"
        )
    peaks = [s["peak"] for s in steps if s.get("peak") is not None]
    if peaks:
        lines.append(
            f"peak memory {format_bytes(max(peaks))} (max over {len(peaks)} metered steps) "
            f"against the limit {format_bytes(limit)}; full-checkpointing control steps "
            "are metered on accelerators only (they may peak above must-only)"
        )
    if headroom is not None and headroom[1] > headroom[0]:
        lines.append(_headroom_line(limit, *headroom))
    if plan is not None:
        lines += ["plan in effect at the end:", plan.explain(measured)]
    return "\n".join(lines)


def _headroom_line(limit: int, low: int, high: int) -> str:
    """Where the limit sits between the must-only peak and the peak with everything useful
    saved; outside that range in words (a share above 100% reads as a fault)."""
    ends = (
        f"the must-only peak {format_bytes(low)} and the peak with everything useful saved "
        f"{format_bytes(high)} (predicted, final plan's bucket)"
    )
    if limit >= high:
        return f"the limit is above everything useful: it sits over both {ends}"
    if limit <= low:
        return f"the limit is at or below the must-only step: it sits under both {ends}"
    return (
        f"the limit sits {100 * (limit - low) / (high - low):.0f}% of the way from the "
        f"must-only peak {format_bytes(low)} to the peak with everything useful "
        f"saved {format_bytes(high)} (predicted, final plan's bucket)"
    )
