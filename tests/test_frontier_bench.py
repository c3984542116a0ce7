"""The frontier benchmark end to end on a tiny model: every method gives a measured row, the
JSON parses, the plots and the markdown section are written; a torch.compile failure is a row."""

import ast
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import frontier
from benchmarks.figures import method_frontier_figure, normalised_frontier_figure
from tapesac_core.units import MiB

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {
    "none",
    "full",
    "full_no_stop",
    "tt_torch",
    "attn_torch",
    "tt_tapesac",
    "attn_tapesac",
    "tapesac_must",
}
BUDGETS = {"compile@0", "compile@0.1", "compile@0.3", "compile@0.5", "compile@0.8"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.bench
def test_every_method_gives_a_measured_row_and_outputs_are_written(tmp_path: Path) -> None:
    markdown = tmp_path / "RESULTS.md"
    markdown.write_text("# title\n\nhand-written analysis stays\n")
    result = frontier.main(
        [
            "--size",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--fractions",
            "0.5,1",
            "--compile-backend",
            "aot_eager_decomp_partition",
            "--out-dir",
            str(tmp_path),
            "--markdown",
            str(markdown),
        ]
    )
    rows = {r["method"]: r for r in result["rows"]}
    assert BASELINES | BUDGETS <= set(rows)
    planned = [
        r for r in rows.values() if r["family"] == "tapesac" and r["method"] != "tapesac_must"
    ]
    assert planned and all(r["limit_bytes"] is not None for r in planned)
    # Figure 9's 10% point is planned: its own row, or merged into an identical plan's note.
    fig9 = int(
        rows["full"]["peak_bytes"] + 0.1 * (rows["none"]["peak_bytes"] - rows["full"]["peak_bytes"])
    )
    own = rows.get("tapesac@fig9=0.1")
    assert (own is not None and own["limit_bytes"] == fig9) or any(
        "the plan at tapesac@fig9=0.1" in r["note"] for r in planned
    )
    for name, r in rows.items():
        if r["error"] is not None:
            assert r["family"] == "compile" and r["error"].strip(), (
                name
            )  # failure rows: compile only
            continue
        assert r["peak_bytes"] > 0 and r["n"] == 2 and r["median_s"] > 0, name
        assert r["backward_flops"] > 0 and r["recomputed_flops"] is not None, name
        assert r["memory_share"] is not None and "time_share" in r, name
    assert rows["none"]["recomputed_flops"] == 0 and rows["full"]["recomputed_flops"] > 0
    assert rows["full"]["memory_share"] == 0 and rows["none"]["memory_share"] == 1
    # The same saved set, replayed: TapeSAC recomputes no more than torch's block recomputation.
    assert rows["tt_tapesac"]["recomputed_flops"] <= rows["tt_torch"]["recomputed_flops"]
    # TapeSAC must-only recomputes no more than full checkpointing (it skips dead nodes).
    assert rows["tapesac_must"]["recomputed_flops"] <= rows["full_no_stop"]["recomputed_flops"]

    data = json.loads((tmp_path / "frontier_dense_tiny.json").read_text())
    assert data["rows"] == json.loads(json.dumps(result["rows"], default=str))
    assert data["command"].startswith("python -m benchmarks.frontier --size tiny")
    for png in ("frontier_dense_tiny_time_vs_memory.png", "frontier_dense_tiny_normalised.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG
    assert all(len(r["round_s"]) == 2 for r in rows.values() if r["error"] is None)
    text = markdown.read_text()
    assert text.startswith("# title\n\nhand-written analysis stays\n")
    assert "- **none** (" in text and ", 2 rounds)." in text
    assert "<!-- frontier dense:tiny -->" in text and "| tapesac_must |" in text
    assert "against each baseline" in text and "frontier_dense_tiny_normalised.png" in text
    # A second run replaces its own section and keeps the rest.
    frontier.update_markdown(markdown, "dense:tiny", "replaced")
    again = markdown.read_text()
    assert "replaced" in again and "| tapesac_must |" not in again and "analysis stays" in again


def test_each_baseline_none_included_is_compared_per_round_too() -> None:
    def row(method: str, family: str, peak: int, rounds: list[float | None]) -> dict:
        times = sorted(t for t in rounds if t is not None)
        return {
            "method": method,
            "family": family,
            "error": None,
            "peak_bytes": peak,
            "recomputed_flops": 0,
            "median_s": statistics.median(times),
            "q1_s": times[0],
            "q3_s": times[-1],
            "round_s": rounds,
        }

    # Drift from round to round (1 s to 5 s) moves both medians, and a round whose step failed
    # (None, left out of the pairs) moves one: the medians' ratio says ahead, while within each
    # round TapeSAC's step is 1.02x none's.
    result = {
        "rows": [
            row("none", "none", 100, [4.0, 1.0, 3.0, 2.0, 5.0]),
            row("tapesac@1", "tapesac", 100, [4.08, 1.02, 3.06, 2.04, None]),
        ]
    }
    (line,) = frontier.comparisons(result)
    assert line.startswith("- **none** (") and "by time ahead" in line
    assert "tapesac@1" in line and "(baseline / TapeSAC = 1.176" in line  # 3.0 s / 2.55 s
    assert "per round 0.980, IQR 0.980-0.980, 4 rounds" in line


@pytest.mark.slow
@pytest.mark.bench
def test_a_torch_compile_failure_is_a_row_with_the_exception_text(tmp_path: Path) -> None:
    result = frontier.main(
        [
            "--size",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--budgets",
            "0.5",
            "--families",
            "none,full,compile",
            "--compile-backend",
            "no_such_backend",
            "--out-dir",
            str(tmp_path),
        ]
    )
    rows = {r["method"]: r for r in result["rows"]}
    assert "no_such_backend" in rows["compile@0.5"]["error"]
    assert rows["none"]["error"] is None and rows["full"]["n"] == 1


@pytest.mark.slow
@pytest.mark.bench
def test_a_save_set_cap_other_than_the_default_gets_its_own_files_and_section(
    tmp_path: Path,
) -> None:
    markdown = tmp_path / "RESULTS.md"
    result = frontier.main(
        [
            "--size",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--fractions",
            "1",
            "--families",
            "none,full,tapesac",
            "--max-set-size",
            "2",
            "--out-dir",
            str(tmp_path),
            "--markdown",
            str(markdown),
        ]
    )
    assert result["max_set_size"] == 2
    assert (tmp_path / "frontier_dense_tiny_set2.json").is_file()
    text = markdown.read_text()
    assert "<!-- frontier dense:tiny:set2 -->" in text and "max_set_size 2" in text
    planned = [
        r for r in result["rows"] if r["family"] == "tapesac" and r["method"] != "tapesac_must"
    ]
    assert planned and all(r["peak_bytes"] > 0 for r in planned)


@pytest.mark.slow
@pytest.mark.bench
def test_plans_with_torch_checkpoint_blocks_get_their_own_files_and_section(
    tmp_path: Path,
) -> None:
    markdown = tmp_path / "RESULTS.md"
    result = frontier.main(
        [
            *("--size", "tiny", "--steps", "1", "--warmup", "0", "--fractions", "1"),
            *("--families", "none,full,tapesac", "--torch-checkpoint-blocks"),
            *("--torch-checkpoint-steps", "4"),
            *("--out-dir", str(tmp_path), "--markdown", str(markdown)),
        ]
    )
    planning = result["tapesac_planning"]
    # Four must-only and four full-checkpointing steps (torch_checkpoint_steps) measured before
    # the probe planned.
    assert planning["torch_checkpoint_blocks"] is True
    assert len(planning["must_only_steps_s"]) == len(planning["full_steps_s"]) == 4
    assert (tmp_path / "frontier_dense_tiny_torch_checkpoint.json").is_file()
    text = markdown.read_text()
    assert "<!-- frontier dense:tiny:torch_checkpoint -->" in text
    assert "4 full-checkpointing steps" in text
    planned = [r for r in result["rows"] if r["method"].startswith("tapesac@")]
    assert planned and all("per block: DecoderLayer " in r["note"] for r in planned)


@pytest.mark.bench
def test_tapesac_bench_runs_the_harness_from_the_checkout(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "tapesac_lightning.cli", "bench", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: tapesac bench" in out.stdout and "--compile-backend" in out.stdout


def test_tapesac_help_lists_every_command_with_its_line() -> None:
    from tapesac_lightning.cli import parser

    text = parser().format_help()
    for command, line in (
        ("launch", "Accelerate's launcher"),
        ("report", "a finished run's plans"),
        ("bench", "TapeSAC against every checkpointing baseline"),
    ):
        assert f"    {command}  " in text and line in text, text


def test_comparison_figures_have_titled_axes_with_units() -> None:
    points = [
        {
            "label": "full",
            "family": "full",
            "peak": 10 * MiB,
            "seconds": 0.1,
            "q1": 0.09,
            "q3": 0.11,
        },
        {
            "label": "tapesac@1",
            "family": "tapesac",
            "peak": 12 * MiB,
            "seconds": 0.09,
            "q1": 0.08,
            "q3": 0.1,
        },
        {
            "label": "tapesac_must",
            "family": "tapesac",
            "peak": 10 * MiB,
            "seconds": 0.095,
            "q1": 0.09,
            "q3": 0.1,
        },
    ]
    (axes,) = method_frontier_figure(points, title="t").axes
    assert axes.get_xlabel() == "measured step peak memory (MiB)"
    assert axes.get_ylabel() == "median step time (ms)" and axes.get_title() == "t"
    norm = [
        {
            "label": "x",
            "family": "tapesac",
            "memory_share": 0.2,
            "flop_share": 0.5,
            "time_share": 0.4,
            "time_q1": 0.3,
            "time_q3": 0.5,
        }
    ]
    (axes,) = normalised_frontier_figure(norm).axes
    assert "%" in axes.get_xlabel() and "%" in axes.get_ylabel() and axes.get_title()


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_gpu_check_script_passes_on_cpu_at_tiny_size(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_SIZE="tiny",
        GPU_CHECK_INSTALL="0",
        OMP_NUM_THREADS="1",
        PYTHON=sys.executable,
    )
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "check")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = (tmp_path / "check" / "summary.txt").read_text()
    for stage in (
        "0_versions",
        "2_correctness",
        "2b_readiness",
        "3_timing",
        "3b_host",
        "4_limit",
        "4b_mixed",
        "4c_offload",
        "5_frontier",
    ):
        assert f"{stage}: PASS" in summary
    assert json.loads((tmp_path / "check" / "2_correctness.json").read_text())["must-only"][
        "bitwise_equal"
    ]
    readiness = json.loads((tmp_path / "check" / "2b_readiness.json").read_text())
    assert readiness["1_leak_bytes"] == 0 and readiness["2_random_custom_op_bitwise"]
    assert (
        readiness["8_moe_bitwise_deterministic"]
        and len(set(readiness["3_fragmentation_estimates"])) <= 2
    )
    mixed = json.loads((tmp_path / "check" / "4b_mixed.json").read_text())
    assert (
        mixed["bitwise_equal"] and mixed["plan"] == ["plain", 2] and mixed["recorded_blocks"] == 1
    )
    host = json.loads((tmp_path / "check" / "3b_host.json").read_text())
    assert host["steady_calls_steady"] and host["recorded_calls_recorded"]
    assert set(host["host_us_per_op"]) == {
        "none",
        "torch_checkpoint",
        "tapesac_recorded",
        "tapesac_steady",
    }
    assert all(v > 0 for v in host["host_us_per_op"].values()) and host["kernel_us_per_op"] > 0
    assert (tmp_path / "check" / "frontier" / "frontier_dense_tiny.json").is_file()
    offload = json.loads((tmp_path / "check" / "4c_offload.json").read_text())
    assert offload["link_bytes_per_s"]["set_by_hand"]  # CPU: no host link to measure
    assert offload["planned_peaks"] and all(
        p <= offload["limit_bytes"] for p in offload["planned_peaks"]
    )
    assert offload["speedup_vs_full_save_on_cpu"]["rounds"] == 3


# ---------------------------------------------------------------------- the public API only

OWN = {"self", "cls"}  # an object's own privates
# Other libraries' privates read on purpose, (file, name): each a workaround with no public way.
ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_or_torch(node: ast.expr) -> bool:
    """``self``/``cls``, or a path from the ``torch`` module (torch's privates are torch's)."""
    if isinstance(node, ast.Name) and node.id in OWN:
        return True
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "torch"


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private name the code reaches on another object: ``x._name``,
    ``getattr(x, "_name")`` (and hasattr, setattr, delattr), ``from tapesac_... import _name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if _private(node.attr) and not _own_or_torch(node.value):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_BUILTINS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if _private(name.value) and not _own_or_torch(node.args[0]):
                    found.append((node.lineno, name.value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tapesac_"):
            parts = node.module.split(".")[1:] + [a.name for a in node.names]
            found += [(node.lineno, p) for p in parts if _private(p)]
    return sorted(found)


def test_the_private_access_check_flags_our_privates_and_passes_own_and_torch_ones() -> None:
    # As benchmarks/sweep.py did, and as a harness calling the Controller's internals would.
    code = (
        "for m in plain.modules():\n"
        "    if hasattr(m, '_tapesac'):\n"
        "        m.forward = m._tapesac_forward\n"
        "controller._forget_plans()\n"
        "from tapesac_core.checkpoint import _wrap, checkpoint_modules\n"
        "from tapesac_core._internal import x\n"
    )
    assert private_accesses(code) == [
        (2, "_tapesac"),
        (3, "_tapesac_forward"),
        (4, "_forget_plans"),
        (5, "_wrap"),
        (6, "_internal"),
    ]
    fine = (
        "self._driver = cls._make(x.__class__)\n"
        "torch._functorch.config.patch(activation_memory_budget=0.5)\n"
        "getattr(module, '__version__', None)\n"
        "from .logging import Publisher\n"
    )
    assert private_accesses(fine) == []


def test_benchmarks_examples_and_integrations_use_only_public_tapesac_names() -> None:
    """The integrations' workarounds for other libraries live in ``tapesac_lightning/_compat.py``
    (``test_integration_compat`` holds them to that)."""
    found = []
    for folder in ("benchmarks", "examples", "tapesac_lightning"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "tapesac_lightning/_compat.py":
                continue
            rel = path.relative_to(ROOT).as_posix()
            found.extend(
                f"{rel}:{line} {name}" for line, name in private_accesses(path.read_text())
            )
    assert not found, "private names reached on other objects:\n" + "\n".join(found)
