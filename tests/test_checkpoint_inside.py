"""A checkpoint (or other saved-tensor hooks) running inside a TapeSAC block is an error naming the
fix: autograd would hand what it saves there to those hooks, and the block would save and replay
nothing of it, silently. Without the checks each case below trains without error."""

import copy
import logging

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from support import assert_bitwise, step
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

import tapesac_core
from tapesac_core import TapeSACError
from tapesac_core.blocks.trace_scope import torch_checkpointing


class Mlp(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


class Layer(torch.nn.Module):
    """A residual block whose MLP call is chosen by the test: how users nest checkpoints."""

    def __init__(self, call_mlp=None) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = Mlp()
        self.call_mlp = call_mlp or (lambda mlp, h: mlp(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.call_mlp(self.mlp, self.norm(x))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, requires_grad=True)


def _non_reentrant(mlp, h):
    return torch_checkpoint.checkpoint(mlp, h, use_reentrant=False)


def _offloaded(mlp, h):
    with torch.autograd.graph.save_on_cpu():
        return mlp(h)


@pytest.mark.parametrize(
    "call_mlp, what",
    [
        (_non_reentrant, "torch.utils.checkpoint"),
        (_offloaded, "saved-tensor hooks of torch.autograd.graph"),
    ],
)
def test_saved_tensor_hooks_inside_a_block_are_an_error_naming_it(call_mlp, what) -> None:
    layer = tapesac_core.checkpoint_module(Layer(call_mlp))
    with pytest.raises(TapeSACError) as error:
        layer(_x())
    message = str(error.value)
    assert what in message and "block 'Layer' (around Layer.mlp" in message, message
    assert "Fix: remove that checkpoint" in message


def test_checkpoint_wrapper_on_a_submodule_of_a_block_is_an_error() -> None:
    layer = Layer()
    layer.mlp = checkpoint_wrapper(layer.mlp, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    tapesac_core.checkpoint_module(layer)
    with pytest.raises(TapeSACError, match=r"torch.utils.checkpoint \(or a wrapper of it"):
        layer(_x())


def _reentrant(mlp, h):
    return torch_checkpoint.checkpoint(mlp, h, use_reentrant=True)


def test_a_reentrant_checkpoint_inside_a_block_is_an_error_at_its_first_forward() -> None:
    # Its forward runs under no_grad, where no saved-tensor hook shows it: the graph does.
    layer = tapesac_core.checkpoint_module(Layer(_reentrant))
    with pytest.raises(
        TapeSACError, match=r"a reentrant checkpoint \(.*\) runs inside TapeSAC block 'Layer'"
    ):
        layer(_x())


@pytest.mark.parametrize(
    "call_mlp", [_non_reentrant, _reentrant], ids=["non_reentrant", "reentrant"]
)
def test_a_checkpoint_put_inside_a_steady_state_block_gets_no_wrong_gradient(
    call_mlp, caplog
) -> None:
    """Steady-state calls run without the submodule hooks that refuse it: the call diverges
    from its tape (a warning), recomputes in backward, and the next call, recorded, refuses it."""
    torch.manual_seed(0)
    layer = Layer()
    reference = copy.deepcopy(layer)
    tapesac_core.checkpoint_module(layer)
    x = _x()
    for _ in range(2):  # recorded, then steady
        layer(x).sum().backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer.call_mlp = call_mlp
    with caplog.at_level(logging.WARNING, logger="tapesac_core"):
        with tapesac_core.trace() as blocks:
            got = step(layer, lambda: layer(x).sum())
    got_x, x.grad = x.grad, None
    ref = step(reference, lambda: reference(x).sum())
    assert blocks[0].diverged
    assert_bitwise(ref, got)
    assert torch.equal(got_x, x.grad)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'Layer'" in warnings[0], warnings
    with pytest.raises(TapeSACError, match="Fix: remove that checkpoint"):
        layer(x)


def test_full_checkpointing_steps_and_plain_blocks_raise_nothing() -> None:
    layer = tapesac_core.checkpoint_module(Layer())
    with tapesac_core.trace() as blocks:
        layer(_x()).sum().backward()
    assert blocks and blocks[0].tape.nodes  # recorded, nothing refused
    with torch_checkpointing() as names:  # torch's own recompute runs the submodules in backward
        layer(_x()).sum().backward()
    assert names == ["Layer"]


def _hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )


@pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning"
)
@pytest.mark.parametrize("enable_first", [True, False])
def test_hugging_face_activation_checkpointing_in_a_block_is_an_error_naming_the_fix(
    enable_first,
) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    model = _hf_model().train()
    if enable_first:
        model.gradient_checkpointing_enable()
    tapesac_core.checkpoint_modules(model, {Qwen3DecoderLayer})
    if not enable_first:  # as the Trainer does in train(), after the model was wrapped
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TapeSACError) as error:
        model(input_ids=ids, labels=ids)
    message = str(error.value)
    assert "block 'model.layers.0' has Hugging Face activation checkpointing on" in message
    assert "gradient_checkpointing_disable()" in message
    model.gradient_checkpointing_disable()
    with tapesac_core.trace() as blocks:
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(blocks) == 2 and all(b.replayed for b in blocks)


def test_a_module_passed_to_checkpoint_unwrapped_names_its_submodules_and_keeps_no_hook() -> None:
    """``checkpoint(module, x)`` on a module ``checkpoint_module`` never wrapped records as a
    wrapped one does: each op named for its submodule, the hooks gone after the call."""
    layer = Layer()
    tape = tapesac_core.record(layer, _x())
    assert {"norm", "mlp.up", "mlp.down"} <= {n.module for n in tape.nodes}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in layer.modules())
