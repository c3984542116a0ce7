"""`python -m benchmarks.host_overhead` runs from the repository root and prints every
configuration and every ratio (times and ratio targets are not asserted: they depend on the
machine)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (
    "eager",
    "noop_mode",
    "noop_bare",
    "torch_ckpt",
    "torch_sac",
    "tapesac_recorded",
    "tapesac_steady",
)


@pytest.mark.bench
@pytest.mark.parametrize("block", ["tiny", "qwen3_layer"])
def test_host_overhead_prints_every_configuration_and_every_ratio(block: str) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.host_overhead",
            "--block",
            block,
            "--rounds",
            "2",
            "--reps",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    counted = re.search(r"(\d+) aten ops a forward", run.stdout)
    assert counted and int(counted.group(1)) > 0, run.stdout  # a Qwen3 layer's: 87 in 5.25
    rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines() if line}
    number = r"-?\d+\.\d+"
    for name in CONFIGS:
        forward, step = rows[name][0], rows[name][3]  # each followed by its IQR "[lo, hi]"
        assert re.fullmatch(number, forward) and re.fullmatch(number, step), rows[name]
    for ratio in (
        "forward tapesac_steady/torch_ckpt",
        "step tapesac_steady/torch_ckpt",
        "forward tapesac_recorded/torch_ckpt",
        "step tapesac_recorded/torch_ckpt",
        "forward tapesac_recorded/noop_mode",
    ):
        assert re.search(rf"ratio {ratio}: {number}", run.stdout), ratio
