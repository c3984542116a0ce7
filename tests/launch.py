"""Jobs on two CPU processes for the end-to-end tests: the Lightning job (tests/lightning_app.py),
`tapesac launch` of an Accelerate or Trainer script, `tapesac report`, and ``torch.multiprocessing``
workers joined in one gloo group.

A launch costs 15-40 s, most of it starting processes and importing libraries: tests that check
different things on the same job share one launch through a module-scoped fixture.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds, per launch

# --------------------------------------------------------------------------- Lightning


def _lightning_command(out: Path, args: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "tests" / "lightning_app.py"),
        "--out",
        str(out),
        "--logdir",
        str(out / "runs"),
        *args,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(outputs: list[tuple[str, str]]) -> str:
    return "\n".join(f"--- rank {r}:\n{o[-3000:]}{e[-3000:]}" for r, (o, e) in enumerate(outputs))


def lightning_fit(out: Path, *args: str, launcher: str = "external") -> list[list[dict]]:
    """Run the Lightning job on 2 CPU processes; each rank's per-step records.

    ``launcher="lightning"``: as a user runs it, one process whose Lightning launcher starts rank
    1 once its own imports are done (rank 1 then imports everything again). ``"external"``: both
    ranks started at once, as torchrun would (``LOCAL_RANK`` and ``MASTER_PORT`` set), which saves
    one process's start (about 8 s). The strategy runs the same either way.
    """
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        "OMP_NUM_THREADS": "1",
    }
    command = _lightning_command(out, args)
    if launcher == "lightning":
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert done.returncode == 0, _failure([(done.stdout, done.stderr)])
    else:
        assert launcher == "external", launcher
        port = str(_free_port())
        ranks = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env={
                    **env,
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "NODE_RANK": "0",
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        _wait_all(ranks)
    return [json.loads((out / f"rank{r}.json").read_text())["steps"] for r in range(2)]


def _wait_all(processes: list[subprocess.Popen]) -> None:
    """Wait for every process; once one fails (or time runs out) stop the others, which would
    otherwise wait in a collective for the failed one; fail naming each one's output."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in processes):
            failed = any(p.returncode not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate() for p in processes]
    codes = [p.returncode for p in processes]
    assert codes == [0] * len(processes), f"return codes {codes}\n" + _failure(outputs)


# ------------------------------------------------------------------- Accelerate, Trainer


def tapesac_launch(
    yaml_path: Path,
    *args: str,
    check: bool = True,
    script: tuple[str, ...] = ("-m", "examples.train_accelerate"),
) -> subprocess.CompletedProcess:
    """``tapesac launch --config_file YAML SCRIPT ARGS`` from the repository root."""
    from tapesac_lightning.accelerate import SETTINGS_ENV

    env = {k: v for k, v in os.environ.items() if k != SETTINGS_ENV}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable,
        "-m",
        "tapesac_lightning.cli",
        "launch",
        "--config_file",
        str(yaml_path),
        # Accelerate's default port is one fixed number: two launches at once (xdist workers)
        # would both bind it, and the second one's rendezvous fails with EADDRINUSE.
        "--main_process_port",
        str(_free_port()),
        *script,
        *args,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def tapesac_report(run: Path, *options: str) -> str:
    """What ``tapesac report RUN OPTIONS`` prints."""
    done = subprocess.run(
        [sys.executable, "-m", "tapesac_lightning.cli", "report", str(run), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------ torch.multiprocessing


def join_group_of_two(rank: int, folder: str) -> None:
    """Join the 2-rank gloo group through a file store in ``folder`` (no TCP port to race other
    processes for)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank, world_size=2
    )


def spawn_two(worker: Callable[[int, str], Any], name: str = "rank") -> list[Any]:
    """Run ``worker(rank, folder)`` on 2 processes; each writes ``folder/{name}{rank}.json``,
    returned in rank order."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(folder,), nprocs=2, join=True)
        return [json.loads(Path(folder, f"{name}{rank}.json").read_text()) for rank in range(2)]


def spawn_two_for_each(
    worker: Callable[[int, str], Any], names: list[str]
) -> dict[str, list[Any] | Exception]:
    """Run ``worker(rank, folder)`` on 2 processes once for several tests: for each of
    ``names`` in turn it writes ``folder/{name}{rank}.json``. Each name's results in rank order,
    or, for the names the workers did not reach, the error that stopped them (to raise in the
    tests that read them)."""
    error: Exception | None = None
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.spawn(worker, args=(folder,), nprocs=2, join=True)
        except Exception as e:  # raised in each test whose results are missing
            error = e
        results: dict[str, list[Any] | Exception] = {}
        for name in names:
            paths = [Path(folder, f"{name}{rank}.json") for rank in range(2)]
            if all(p.is_file() for p in paths):
                results[name] = [json.loads(p.read_text()) for p in paths]
            else:
                results[name] = error or RuntimeError(f"the workers wrote no results for {name}")
    return results
