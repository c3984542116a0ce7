"""Helpers every benchmark shares: where a run happened (machine, commit), the order of
interleaved rounds, quartiles, how bytes are written in tables, and the no-op dispatch modes
that price any Python-level recorder."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tapesac_core.units import MiB

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def machine(device: torch.device) -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        info["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    info["cpus"] = os.cpu_count()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def git_commit() -> str:
    """The checked-out commit, marked when the code a result depends on has local changes."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # The outputs the harnesses write are not code: only changes elsewhere make a run unrepeatable.
    code = git(
        "status",
        "--porcelain",
        "--",
        "tapesac_core",
        "benchmarks",
        ":!benchmarks/results",
        ":!benchmarks/RESULTS.md",
    )
    return commit + (" + local changes" if code else "")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` starting at round ``r``'s place: each round of an interleaved comparison starts
    with the next item, so no item always runs first (or right after the same other one)."""
    items = list(items)
    return items[r % len(items) :] + items[: r % len(items)]


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (inclusive method, so within the samples; one
    sample is all three)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def iqr(xs: Sequence[float]) -> float:
    """Interquartile range, of ``quartiles``."""
    q1, _, q3 = quartiles(xs)
    return q3 - q1


def median_seconds(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """The median wall time of ``runs`` calls of ``fn``, and its last result."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def mib(n: int | None) -> str:
    """Bytes as MiB in a table, "-" for none."""
    return "-" if n is None else f"{n / MiB:.2f}"


def pct(share: float | None) -> str:
    """A share as a whole percentage in a table, "-" for none."""
    return "-" if share is None else f"{share:.0%}"


class OpCounter(TorchDispatchMode):
    """Counts the aten op calls that reach the dispatcher, except those named in ``skip``."""

    def __init__(self, skip: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.skip = skip
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if str(func) not in self.skip:
            self.count += 1
        return func(*args, **(kwargs or {}))


class NoOpMode(TorchDispatchMode):
    """Only calls the op: what any Python dispatch mode costs, as torch wraps it
    (``torch._disable_dynamo`` around ``__torch_dispatch__``)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


class BareNoOpMode(NoOpMode):
    """The same without the wrapper that keeps Dynamo out (TapeSAC's Recorder opts out of it):
    the floor of a dispatcher-level recorder."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # Defined again: the inherited one is already wrapped (torch wraps it per class).
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))
