"""The README's Python snippets run against the repository's own example model."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snippet(after: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_the_plain_pytorch_snippet_runs_and_prints_a_plan() -> None:
    code = _snippet("In plain PyTorch (runs as is")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, *table = done.stdout.splitlines()
    assert first.split()[0] in {"planned", "control"}
    assert re.match(r"TapeSAC plan for up to \d+ \(DecoderLayer\) tokens: capacity", table[0])


def test_the_lightning_snippet_parses_and_its_imports_resolve() -> None:
    tree = ast.parse(_snippet("With Lightning, one line"))
    imports = ast.Module(
        body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[]
    )
    exec(compile(imports, "README", "exec"), {})


def test_the_trainer_snippet_parses_and_its_import_resolves() -> None:
    tree = ast.parse(_snippet("Two lines: the import and the callback"))
    imports = ast.Module(
        body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[]
    )
    namespace: dict = {}
    exec(compile(imports, "README", "exec"), namespace)
    assert namespace["TapeSACTrainerCallback"].__module__ == "tapesac_lightning.trainer"
