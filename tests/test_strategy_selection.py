"""TapeSACFSDPStrategy's block selection and sharding, in process (no fit): ``_apply`` on a model
with a process group of one."""

import pytest
import torch
from support import process_group_of_one

pytest.importorskip("lightning")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from tapesac_lightning import TapeSACFSDPStrategy  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)) + x


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(x)


class Model(torch.nn.Module):
    """Repeated layers (a stack), a ModuleList of distinct classes, and a single head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.mixed = torch.nn.ModuleList([Layer(), Head()])
        self.head = Head()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.mixed[1](self.mixed[0](x))).sum()


def _applied(**options) -> tuple[list[str], list[str], Model]:
    """Paths checkpointed and paths sharded (the root is '') by the strategy's ``_apply``."""
    model = Model()
    strategy = TapeSACFSDPStrategy(0.5, **options)
    with process_group_of_one():
        strategy._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        strategy._apply(model)
        loss = model(torch.randn(4, 8))
        loss.backward()
    paths = [p for p, m in model.named_modules() if hasattr(m, "_tapesac")]
    sharded = [p for p, m in model.named_modules() if isinstance(m, FSDPModule)]
    return paths, sharded, model


def test_by_default_layers_repeated_in_a_module_list_are_the_blocks_and_each_is_sharded() -> None:
    paths, sharded, model = _applied()
    assert paths == ["layers.0", "layers.1", "layers.2"]  # not mixed.0: alone of its class there
    assert sharded == ["", "layers.0", "layers.1", "layers.2"]
    assert all(p.grad is not None for p in model.parameters())


def test_a_policy_chooses_the_blocks_and_auto_wrap_policy_what_is_sharded() -> None:
    paths, sharded, _ = _applied(activation_checkpointing_policy={Layer}, auto_wrap_policy={Head})
    assert paths == ["layers.0", "layers.1", "layers.2", "mixed.0"]
    assert sharded == ["", "mixed.1", "head"]
    paths, sharded, _ = _applied(
        activation_checkpointing_policy=lambda m: isinstance(m, Head),
        auto_wrap_policy=lambda m: isinstance(m, Layer),
    )
    assert paths == ["mixed.1", "head"]
    assert sharded == ["", "layers.0", "layers.1", "layers.2", "mixed.0"]


def test_deterministic_ops_reach_every_block_and_a_bad_name_fails_at_construction() -> None:
    from tapesac_core import TapeSACError, block_config

    _, _, model = _applied(deterministic_ops={"mylib::fused_norm"})
    configs = [block_config(m) for m in model.layers]
    assert all(c.deterministic_ops == {"mylib::fused_norm"} for c in configs)
    with pytest.raises(TapeSACError, match="'namespace::name'"):
        TapeSACFSDPStrategy(0.5, deterministic_ops={"fused_norm"})
