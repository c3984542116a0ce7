"""Bitwise equality with no checkpointing on the example models and Hugging Face Qwen3 layers."""

import pytest
import torch
from support import (
    BLOCK_CLASSES,
    assert_bitwise,
    assert_replayed_as_predicted,
    step,
    tiny_lm,
    token_ids,
)

import tapesac_core

CONFIGS = {
    "dense_dropout": dict(dropout=0.1),
    "dense_no_gate_mha": dict(attention_output_gate=False, num_kv_heads=4),
    "moe_dropout": dict(moe=True, dropout=0.1),
    "moe_weights_on_input": dict(moe=True, routing_weights_on_input=True),
    "moe_skip_empty_experts": dict(moe=True, skip_empty_experts=True, dropout=0.1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_example_model_is_bitwise_exact(name: str) -> None:
    model = tiny_lm(**CONFIGS[name])
    ids = token_ids(1, batch=2, seq=24)
    ref = step(model, lambda: model.loss(ids))
    tapesac_core.checkpoint_modules(model, BLOCK_CLASSES)
    with tapesac_core.trace() as blocks:
        got = step(model, lambda: model.loss(ids))
    assert_bitwise(ref, got)
    assert len(blocks) == model.config.num_layers
    assert_replayed_as_predicted(blocks)
    assert all(b.replayed for b in blocks)


def _hf_case(kind: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_dropout=0.1,
    )
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common)), Qwen3DecoderLayer
    config = Qwen3MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        **common,
    )
    return Qwen3MoeForCausalLM(config), Qwen3MoeDecoderLayer


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_hugging_face_decoder_layers_are_bitwise_exact(kind: str) -> None:
    torch.manual_seed(0)
    model, layer_class = _hf_case(kind)
    model.train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    ref = step(model, loss)
    paths = tapesac_core.checkpoint_modules(model, {layer_class})
    assert paths == ["model.layers.0", "model.layers.1"]
    with tapesac_core.trace() as blocks:
        got = step(model, loss)
    assert_bitwise(ref, got)
    assert [b.tape.name for b in blocks] == paths
    assert_replayed_as_predicted(blocks)
