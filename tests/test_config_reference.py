"""docs/configuration.md is generated from TapeSACConfig: every field has help, the page is current."""

import dataclasses
from pathlib import Path

import pytest

from tapesac_core import TapeSACConfig
from tapesac_core.config_reference import YAML_PREFIX, missing_help, render

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_help() -> None:
    assert missing_help(TapeSACConfig) == []


def test_a_field_without_help_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Settings:
        documented: int = dataclasses.field(default=1, metadata={"help": "Has its help"})
        forgotten: int = 2

    assert missing_help(Settings) == ["forgotten"]
    with pytest.raises(ValueError, match="forgotten"):
        render(Settings)


def test_the_rendered_table_has_a_row_per_field_with_its_key_type_and_default() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Settings:
        limit: float | str = dataclasses.field(metadata={"help": "Required, a | in help"})
        names: frozenset = dataclasses.field(default_factory=frozenset, metadata={"help": "Set"})

    rows = render(Settings).splitlines()
    limit = "| `limit` | `tapesac_limit` | `float \\| str` | required | Required, a \\| in help |"
    assert limit in rows
    assert "| `names` | `tapesac_names` | `frozenset` | `frozenset()` | Set |" in rows


def test_the_configuration_page_is_current() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == render(), (
        "docs/configuration.md is stale. Fix: .venv/bin/python -m tapesac_core.config_reference "
        "> docs/configuration.md"
    )


def test_the_yaml_keys_are_those_accelerate_reads() -> None:
    accelerate = pytest.importorskip("tapesac_lightning.accelerate")
    assert YAML_PREFIX == accelerate.PREFIX
    plugin = accelerate.TapeSACPlugin.from_keys(
        {f"{YAML_PREFIX}memory_limit": "30MiB", f"{YAML_PREFIX}max_set_size": 48}
    )
    assert plugin.config().max_set_size == 48
