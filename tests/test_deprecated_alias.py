"""The integrations' name for a few releases, ``tapesac_integrations``, still imports: it warns
once and every public name and module path is the very object ``tapesac_lightning`` holds. The
package the project was specified with, ``tapesac_lightning``, imports without a warning."""

import importlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

import tapesac_lightning

MODULES = (
    "accelerate",
    "cli",
    "driver",
    "hf_trainer",
    "lightning_callback",
    "lightning_strategy",
    "tracking",
)


@pytest.fixture
def fresh_alias() -> Iterator[None]:
    """Forgets the alias package and its modules, so that importing it runs it (and warns)."""
    saved = {n: m for n, m in sys.modules.items() if n.partition(".")[0] == "tapesac_integrations"}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [n for n in sys.modules if n.partition(".")[0] == "tapesac_integrations"]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_the_specified_package_imports_without_a_warning() -> None:
    code = (
        "import warnings; warnings.simplefilter('error'); import tapesac_lightning; "
        "from tapesac_lightning import TapeSACFSDPStrategy, TapeSACAccelerator, "
        "TapeSACTrainerCallback"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.usefixtures("fresh_alias")
def test_old_package_warns_and_names_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match="import from tapesac_lightning"):
        old = importlib.import_module("tapesac_integrations")
    for name in tapesac_lightning.__all__:
        assert getattr(old, name) is getattr(tapesac_lightning, name), name
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = old.NoSuchThing


@pytest.mark.usefixtures("fresh_alias")
@pytest.mark.parametrize("name", MODULES)
def test_old_module_paths_are_the_new_modules(name: str) -> None:
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module(f"tapesac_integrations.{name}")
    assert module is importlib.import_module(f"tapesac_lightning.{name}")


def test_every_module_has_its_alias() -> None:
    from pathlib import Path

    package = Path(tapesac_lightning.__file__).parent
    public = {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
    assert public == set(MODULES)
