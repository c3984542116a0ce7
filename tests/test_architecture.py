"""The layers of ``tapesac_core`` (docs/architecture.md): a module imports only from its own layer
and the layers below it, so the folders keep saying what depends on what."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tapesac_core"

# Lowest first. The package's own __init__ (the public names, loaded lazily) stands above all.
LAYERS = ("", "plan", "measure", "tape", "blocks", "control", "report")


def _layer(module: str) -> str:
    """The layer of a dotted name in the package: its folder, "" for the base modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """The package modules ``path`` imports (line, dotted name), type-checking imports too."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("tapesac_core"):
                continue
            if node.module is None:  # from .. import units: modules of a package
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name) for a in node.names if a.name.startswith("tapesac_core")
            ]
    return found


def upward_imports(package: Path) -> list[str]:
    """Every import of a higher layer, as "file:line: what"."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent).with_suffix("")
        module = ".".join(relative.parts[:-1] if path.name == "__init__.py" else relative.parts)
        if module == package.name:
            continue  # the public names: it may import every layer
        source = _layer(module)
        for line, target in _imports(path, module):
            if target == package.name:  # the public names: above every layer
                bad.append(f"{relative}.py:{line}: {module} imports the package's public names")
            elif LAYERS.index(_layer(target)) > LAYERS.index(source):
                bad.append(f"{relative}.py:{line}: {module} ({source or 'base'}) imports {target}")
    return bad


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert upward_imports(PACKAGE) == []


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    package = tmp_path / "tapesac_core"
    (package / "tape").mkdir(parents=True)
    (package / "control").mkdir()
    (package / "tape" / "replay.py").write_text("from ..control.controller import Controller\n")
    (package / "control" / "controller.py").write_text("from ..tape.replay import Replay\n")
    (package / "units.py").write_text("from tapesac_core.tape import replay\n")
    assert upward_imports(package) == [
        "tapesac_core/tape/replay.py:1: tapesac_core.tape.replay (tape) imports "
        "tapesac_core.control.controller",
        "tapesac_core/units.py:1: tapesac_core.units (base) imports tapesac_core.tape",
    ]


def test_every_folder_of_the_package_is_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS[1:])
