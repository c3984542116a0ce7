"""Torch's private names live in ``tapesac_core/_compat.py`` alone, and the torch versions
``pyproject.toml`` allows are those the suite has run on (``CHECKED_ON``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from tapesac_core._compat import CHECKED_ON

ROOT = Path(__file__).resolve().parent.parent
# Private attributes of torch's objects the code used before they moved into _compat.
TORCH_ATTRIBUTES = {"_op", "_opname", "_schema", "_get_fsdp_state", "_should_skip_dynamo"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_privates(source: str) -> list[tuple[int, str]]:
    """(line, what) for each torch-private name ``source`` reaches: ``torch._C...``, an import
    from a private torch module, or a known private attribute of torch's objects."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if _root(node) == "torch" and _private(node.attr):
                found.append((node.lineno, node.attr))
            elif node.attr in TORCH_ATTRIBUTES:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(_private(part) for part in node.module.split(".")):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and node.value in TORCH_ATTRIBUTES:
            found.append((node.lineno, node.value))  # getattr(x, "_get_fsdp_state")
    return sorted(found)


def test_the_check_finds_each_kind_of_torch_private() -> None:
    code = (
        "from torch.utils._pytree import tree_leaves\n"
        "torch._C._current_graph_task_id()\n"
        "schema = op._schema\n"
        'getattr(module, "_get_fsdp_state", None)\n'
        "self._own = torch.nn.Linear\n"
    )
    assert torch_privates(code) == [
        (1, "torch.utils._pytree"),
        (2, "_C"),
        (2, "_current_graph_task_id"),
        (3, "_schema"),
        (4, "_get_fsdp_state"),
    ]


def test_torch_privates_are_reached_only_in_compat() -> None:
    found = []
    for package in ("tapesac_core", "tapesac_lightning"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "_compat.py":
                continue
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{line} {what}" for line, what in torch_privates(path.read_text())]
    assert not found, "torch-private names outside tapesac_core/_compat.py:\n" + "\n".join(found)


def test_pyproject_allows_the_torch_versions_checked_and_no_later_one() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    (requirement,) = re.findall(r'"torch(>=[^"]+)"', text)
    checked = sorted(tuple(int(n) for n in v.split(".")) for v in CHECKED_ON)
    lowest, highest = checked[0], checked[-1]
    assert requirement == f">={lowest[0]}.{lowest[1]},<{highest[0]}.{highest[1] + 1}"


def test_the_suite_runs_on_a_torch_version_compat_was_checked_on() -> None:
    assert ".".join(torch.__version__.split(".")[:2]) in CHECKED_ON, (
        f"torch {torch.__version__} is not in tapesac_core._compat.CHECKED_ON {CHECKED_ON}: "
        "run the suite on it, then add it there and move the bound in pyproject.toml"
    )
