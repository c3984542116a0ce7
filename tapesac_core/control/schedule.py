"""Which kind each controller step is, and which steps meter memory or look for hidden writes:
decisions from the config, the device type and the counts the controller keeps (steps taken,
profiling steps done, each bucket's step times), returned for the controller to act on."""

from __future__ import annotations

from ..config import TapeSACConfig
from .measured_times import StepTimes
from .step_report import CONTROL, FULL, PLANNED, PROFILE, SAMPLE, WARMUP, Bucket, StepMode


class StepSchedule:
    """The step cadence of ``config`` on a ``device_type`` device ("cpu", "cuda", ...). Its one
    count of its own: each bucket's planned steps since the bucket's last metered one (on CPU one
    planned step in ``meter_every`` is metered)."""

    def __init__(self, config: TapeSACConfig, device_type: str) -> None:
        self.config = config  # only its step counts are read: a new memory limit changes nothing
        self.on_cpu = device_type == "cpu"
        self._unmetered: dict[Bucket, int] = {}
        self._unrecorded: dict[Bucket, int] = {}

    def warms_up(self, step: int) -> bool:
        """Whether step ``step`` (counted from 0) is one of the first ``warmup_steps``."""
        return step < self.config.warmup_steps

    def mode(
        self,
        key: Bucket,
        times: StepTimes,
        profile: bool,
        sample: bool,
        full_fits: bool = False,
    ) -> StepMode:
        """The mode of a step after warmup in bucket ``key``: profiling or sampling memory when
        the ranks agreed it needs to, else a new bucket's first ``control_steps`` must-only
        steps (with ``torch_checkpoint_blocks``, where a full-checkpointing step is predicted
        within the limit, ``full_fits``: at least ``torch_checkpoint_steps``, each followed by
        one under torch.utils.checkpoint, so the two are measured side by side), then one
        must-only step per ``control_every`` planned steps, one under torch.utils.checkpoint
        per ``full_control_every`` planned steps (when set), and planned steps between."""
        if profile:
            return PROFILE
        if sample:
            return SAMPLE
        controls = len(times.must_only.get(key, ()))
        config = self.config
        pairs = config.torch_checkpoint_steps if config.torch_checkpoint_blocks and full_fits else 0
        if len(times.full.get(key, ())) < min(controls, pairs):
            return FULL
        every = self.config.control_every
        if controls < max(self.config.control_steps, pairs) or (
            every and controls and times.planned_since_control(key) >= every
        ):
            return CONTROL
        full_every = self.config.full_control_every
        if full_every and (not times.full.get(key) or times.planned_since_full(key) >= full_every):
            return FULL
        return PLANNED

    def metered(self, mode: StepMode, key: Bucket, profiled: int) -> bool:
        """Memory is metered in the first profiling step (``profiled``: profiling steps done in
        the current run of them), sample steps, and planned steps: on accelerators every one
        (allocator statistics cost nothing); on CPU, where metering slows the step, a bucket's
        first and then one in ``meter_every``. Full-checkpointing steps are metered on
        accelerators: on CPU their time is what they measure."""
        if mode == PROFILE:
            return profiled == 0
        if mode == FULL:
            return not self.on_cpu
        if mode == PLANNED:
            every, since = self.config.meter_every, self._unmetered.get(key)
            return not self.on_cpu or since is None or bool(every and since >= every - 1)
        return mode == SAMPLE

    def records(self, mode: StepMode, key: Bucket) -> bool:
        """Whether every block of a planned step records, its tape compared with the one its
        steady-state calls run from (``steady.py``): a bucket's first planned step, then one in
        ``meter_every`` (on CPU, the metered ones). Other steps' blocks run from their cached
        tapes where they have one, but for the steps that time ops or probe memory."""
        if mode != PLANNED:
            return False
        every, since = self.config.meter_every, self._unrecorded.get(key)
        return since is None or bool(every and since >= every - 1)

    def verifies(self, mode: StepMode, step: int, profiled: int) -> bool:
        """Whether this step looks for writes the dispatcher cannot see (``verify.py``): the
        first step if it warms up (neither timed nor metered: the check's syncs and temporaries
        distort nothing), else the first profile step."""
        if self.config.warmup_steps > 0:
            return mode == WARMUP and step == 0
        return mode == PROFILE and profiled == 0

    def timed(self, metered: bool) -> bool:
        """Whether a planned step's seconds count: metering slows a CPU step, so a metered
        planned step there is checked, not timed."""
        return not (metered and self.on_cpu)

    def planned(self, key: Bucket, metered: bool, recorded: bool) -> None:
        """A planned step of bucket ``key`` ran, ``metered`` or not, ``recorded`` or not."""
        self._unmetered[key] = 0 if metered else self._unmetered.get(key, 0) + 1
        self._unrecorded[key] = 0 if recorded else self._unrecorded.get(key, 0) + 1

    def forget_plans(self) -> None:
        """Every bucket is solved again: its first planned step is metered (on CPU) and
        recorded again."""
        self._unmetered.clear()
        self._unrecorded.clear()

    def forget_plan(self, key: Bucket) -> None:
        """Bucket ``key`` is solved again: its first planned step is metered (on CPU) and
        recorded again."""
        self._unmetered.pop(key, None)
        self._unrecorded.pop(key, None)
