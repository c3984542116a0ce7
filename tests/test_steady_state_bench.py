"""`python -m benchmarks.steady_state` runs from the repository root and prints every method:
TapeSAC must-only recomputes the same FLOPs recorded or in steady state, and no more than full
checkpointing (times are not asserted: they depend on the machine)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.steady_state import flops, methods
from benchmarks.workload import SIZES, build_model

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


@pytest.mark.parametrize("function_down", [False, True])
def test_replay_skips_a_last_gemm_that_torch_checkpoint_recomputes(function_down) -> None:
    """With each MLP's down projection an autograd.Function, which saves after its GEMM, torch's
    checkpoint recomputes that GEMM and replay does not: 2 x tokens x intermediate x hidden FLOPs
    per block apart. With nn.Linear autograd saves before the GEMM and torch's early stop ends
    there: both recompute the same FLOPs. Gradients are bitwise in every method."""
    base, block, seq, batch = build_model("dense", "tiny", 0.0)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    runs = methods(base, block, function_down=function_down)
    grads = {}
    for name, (model, context) in runs.items():
        for _ in range(2):  # the second call of a TapeSAC block runs in steady state
            with context():
                loss = model.loss(ids)
                loss.backward()
            named = model.named_parameters()
            grads[name] = [loss.detach()] + [p.grad.clone() for _, p in named]
            model.zero_grad(set_to_none=True)
    assert all(all(torch.equal(a, b) for a, b in zip(got, grads["none"])) for got in grads.values())
    count = {name: flops(model, context, ids) for name, (model, context) in runs.items()}
    shape = SIZES["tiny"][0]
    down = 2 * batch * seq * shape["intermediate_size"] * shape["hidden_size"]
    skipped = shape["num_layers"] * down if function_down else 0
    assert count["full"] - count["tapesac_steady"] == skipped
    assert count["tapesac_steady"] == count["tapesac_recorded"] > count["none"]
