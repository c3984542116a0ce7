"""`python -m benchmarks.plan_stability` runs from the repository root: every limit gets a row
and each run's share of recomputation eliminated lies in [0, 1] (shares depend on measured op
times, so only their range is asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
def test_plan_stability_prints_each_limits_runs() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.plan_stability",
            "--hidden",
            "64",
            "--runs",
            "2",
            "--shares",
            "0.1,0.5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if re.match(r"\| [\d.]+ MiB", line)]
    assert len(rows) == 2
    for row in rows:
        shares = [float(s) / 100 for s in re.findall(r"(-?[\d.]+)%", row.split("|")[2])]
        assert len(shares) == 2 and all(0 <= s <= 1 for s in shares)
