"""The integrations' old package name, ``tapesac_lightning``, still imports: it warns once and
every public name and old module path is the very object ``tapesac_integrations`` holds."""

import importlib
import sys
from collections.abc import Iterator

import pytest

import tapesac_integrations


@pytest.fixture
def fresh_alias() -> Iterator[None]:
    """Forgets the alias package and its modules, so that importing it runs it (and warns)."""
    saved = {n: m for n, m in sys.modules.items() if n.partition(".")[0] == "tapesac_lightning"}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [n for n in sys.modules if n.partition(".")[0] == "tapesac_lightning"]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.mark.usefixtures("fresh_alias")
def test_old_package_warns_and_names_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match="import from tapesac_integrations"):
        old = importlib.import_module("tapesac_lightning")
    for name in tapesac_integrations.__all__:
        assert getattr(old, name) is getattr(tapesac_integrations, name), name
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = old.NoSuchThing


@pytest.mark.usefixtures("fresh_alias")
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("strategy", "lightning_strategy"),
        ("callback", "lightning_callback"),
        ("trainer", "hf_trainer"),
        ("accelerate", "accelerate"),
        ("cli", "cli"),
        ("driver", "driver"),
    ],
)
def test_old_module_paths_are_the_new_modules(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module(f"tapesac_lightning.{old}")
    assert module is importlib.import_module(f"tapesac_integrations.{new}")


@pytest.mark.usefixtures("fresh_alias")
def test_old_import_statement_gives_the_same_class() -> None:
    with pytest.warns(DeprecationWarning):
        from tapesac_lightning.strategy import TapeSACFSDPStrategy as Old
    from tapesac_integrations.lightning_strategy import TapeSACFSDPStrategy

    assert Old is TapeSACFSDPStrategy
