"""`python -m benchmarks.steady_state` runs from the repository root and prints every method:
TapeSAC must-only recomputes the same FLOPs recorded or in steady state, and no more than full
checkpointing (times are not asserted: they depend on the machine)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
def test_steady_state_prints_every_method_and_their_ratios() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.steady_state", "--model", "dense", "--size", "small"]
        + ["--dropout", "0.1", "--rounds", "2", "--reps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rows = {
        m.group(1): m.group(2).split()
        for m in re.finditer(
            r"^(none|full|tapesac_recorded|tapesac_steady)\s+(\d.*)$", run.stdout, re.M
        )
    }
    assert set(rows) == {"none", "full", "tapesac_recorded", "tapesac_steady"}
    gflop = {name: float(row[-2]) for name, row in rows.items()}
    # Replay skips ops whose outputs backward never reads; torch's checkpoint reruns them.
    assert gflop["none"] == 0 < gflop["tapesac_steady"] == gflop["tapesac_recorded"]
    assert gflop["tapesac_steady"] <= gflop["full"]
    assert "tapesac_steady / full per round" in run.stdout
    assert "dropout 0.1" in run.stdout
