"""`python -m benchmarks.moe_plans` runs from the repository root and prints, per model, every
method with its recomputed FLOPs, peak and ratio to full checkpointing, and the share of
TapeSAC's layer calls in steady state (times are not asserted: they depend on the machine)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
def test_moe_plans_prints_every_method_share_and_flops() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.moe_plans", "--models", "qwen3_moe_eager,gpt2"]
        + ["--hidden", "32", "--rounds", "2", "--reps", "1", "--warmup", "4", "--batches", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.count("HF Qwen3MoeForCausalLM, eager experts") == 1
    assert out.count("HF GPT2LMHeadModel, dropout 0.1") == 1
    rows = re.findall(r"^(none|full|tapesac_steady|tapesac_planned)\s+(\d.*)$", out, re.M)
    assert [name for name, _ in rows] == ["none", "full", "tapesac_steady", "tapesac_planned"] * 2
    for name, row in rows:
        recomputed = float(row.split()[-2])
        assert (recomputed == 0) == (name == "none"), (name, row)
    shares = re.findall(
        r"^(tapesac_\w+) layer calls in steady state, timed rounds: (.*)$", out, re.M
    )
    assert len(shares) == 4 and all(re.fullmatch(r"\d+\.\d% of \d+", s) for _, s in shares)
    assert len(re.findall(r"/ full per round: \d\.\d{3} \(IQR", out)) == 6
