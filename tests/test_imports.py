"""Optional libraries stay optional: each check runs a fresh interpreter in which some installed
packages are made unimportable, as if not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import sample_plan

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = {"lightning", "accelerate", "tensorboard", "matplotlib", "yaml"}

# Runs first in the child: a finder that reports the blocked packages (and their submodules) as
# not installed, the way an import of a missing package fails.
_BLOCK = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED], "imported at startup"
sys.meta_path.insert(0, _NotInstalled())
"""


def run_without(blocked: set[str], code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` (``sys.argv[1:]`` = ``args``) in a fresh interpreter, from the repository
    root with tests/ importable, where the packages ``blocked`` cannot be imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    program = f"BLOCKED = {sorted(blocked)!r}\n{_BLOCK}\n{textwrap.dedent(code)}"
    done = subprocess.run(
        [sys.executable, "-c", program, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_planner_imports_and_solves_without_torch() -> None:
    run_without(
        {"torch"},
        """
        import tapesac_core.plan
        from plan_graphs import WORKED_FRONTIER, worked_example
        from tapesac_core.plan import RegionFrontier, solve_frontier, solve_knapsack

        points = solve_frontier(worked_example()).points
        assert list(points) == WORKED_FRONTIER
        # Two blocks sharing 17 bytes: one saves {x2, x5} (11 bytes, 20 removed), the other
        # {x2} (6 bytes, 13 removed).
        regions = {"block": RegionFrontier(points=tuple(points), blocks=2)}
        result = solve_knapsack(regions, capacity=17, resolution=17)
        assert (result.bytes, result.gain, sorted(result.choices["block"])) == (17, 33.0, [2, 4])
        """,
    )


def test_core_runs_without_the_integrations_libraries() -> None:
    run_without(
        INTEGRATIONS,
        """
        import importlib.util

        import torch

        import tapesac_core
        import tapesac_core.blocks.running  # the function's module, imported before the name is used

        assert tapesac_core.checkpoint is tapesac_core.blocks.running.checkpoint  # the function
        assert importlib.util.find_spec("tapesac_core.checkpoint") is None  # no module of its name
        assert set(tapesac_core.__all__) <= set(dir(tapesac_core))
        for name in tapesac_core.__all__:
            getattr(tapesac_core, name)
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        x = torch.randn(3, 4, requires_grad=True)
        (want,) = torch.autograd.grad(block(x).sum(), x)
        tapesac_core.checkpoint_module(block)
        (got,) = torch.autograd.grad(block(x).sum(), x)
        assert torch.equal(got, want)
        """,
    )


def test_integrations_import_their_library_when_used() -> None:
    run_without(
        set(),
        """
        import sys

        import tapesac_lightning
        from tapesac_lightning import TapeSACAccelerator

        assert TapeSACAccelerator.__module__ == "tapesac_lightning.accelerate"
        assert "accelerate" in sys.modules and "lightning" not in sys.modules
        """,
    )


def test_integrations_without_their_library_name_the_extra() -> None:
    done = run_without(
        {"lightning", "accelerate"},
        """
        import tapesac_lightning
        from tapesac_lightning.cli import main

        for name in tapesac_lightning.__all__:
            try:
                getattr(tapesac_lightning, name)
            except ImportError as e:
                print(name, e)
        try:
            main(["launch", "train.py"])
        except ImportError as e:
            print("launch", e)
        """,
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for name, extra in (
        ("TapeSACAccelerator", "accelerate"),
        ("TapeSACPlugin", "accelerate"),
        ("TapeSACCallback", "lightning"),
        ("TapeSACFSDPStrategy", "lightning"),
        ("launch", "accelerate"),
    ):
        assert f"needs {extra}, which is not installed" in lines[name], done.stdout
        assert f"Fix: pip install 'tapesac[{extra}]'" in lines[name], done.stdout


def _save_state(folder: Path) -> None:
    """An Accelerate save_state folder as TapeSAC leaves it: the controller's plan cache."""
    state = {
        "plans": {"4096": sample_plan().to_json()},
        "planned_times": {"4096": [0.10, 0.12, 0.11]},
        "must_only_times": {"4096": [0.13, 0.14]},
    }
    torch.save(state, folder / "custom_checkpoint_0.pkl")


@pytest.mark.parametrize("command", ["report", "bench"])
def test_cli_commands_run_without_accelerate_and_yaml(command: str, tmp_path: Path) -> None:
    _save_state(tmp_path)
    args = [command, str(tmp_path), "--json"] if command == "report" else [command, "--help"]
    done = run_without(
        {"accelerate", "yaml"},
        """
        import sys

        from tapesac_lightning.cli import main

        main(sys.argv[1:])
        """,
        *args,
    )
    if command == "report":
        result = json.loads(done.stdout)
        assert result["kind"] == "accelerate"
        assert [b["plan"] for b in result["buckets"]] == [sample_plan().to_json()]
    else:
        assert "usage: tapesac bench" in done.stdout
