"""Controller's constructor: a limit and settings, or a whole config, never both."""

import pytest
import torch

import tapesac_core
from tapesac_core import Controller, TapeSACConfig


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(Block(), Block())
    tapesac_core.checkpoint_modules(model, {Block})
    return model


@pytest.mark.parametrize(
    "given, named",
    [
        ({"memory_limit": "30MiB"}, "memory_limit"),
        ({"warmup_steps": 5}, "warmup_steps"),
        ({"memory_limit": 0.5, "max_set_size": 48}, "memory_limit, max_set_size"),
    ],
)
def test_a_config_with_a_limit_or_settings_is_an_error_naming_the_fix(given, named) -> None:
    config = TapeSACConfig(memory_limit=0.9)
    with pytest.raises(TypeError, match=f"got config= and {named}. Fix: pass only config="):
        Controller(_model(), config=config, **given)


def test_a_config_alone_or_a_limit_alone_is_taken() -> None:
    config = TapeSACConfig(memory_limit="30MiB", warmup_steps=5)
    assert Controller(_model(), config=config).config is config
    built = Controller(_model(), "30MiB", warmup_steps=5).config
    assert built == config


def test_neither_a_limit_nor_a_config_is_an_error() -> None:
    with pytest.raises(TypeError, match="needs memory_limit"):
        Controller(_model())
