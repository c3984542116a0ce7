"""Tiny configs of the mixture-of-experts causal LMs transformers ships, for the tests: each
family's model class, config and decoder layer class; no downloads."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
_ATTENTION = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _qwen3_moe(tf: Any) -> tuple:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    config = tf.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
        num_experts=4, num_experts_per_tok=2, **_ATTENTION,
    )  # fmt: skip
    return tf.Qwen3MoeForCausalLM, config, Qwen3MoeDecoderLayer


def _qwen2_moe(tf: Any) -> tuple:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    config = tf.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **_ATTENTION,
    )  # fmt: skip
    return tf.Qwen2MoeForCausalLM, config, Qwen2MoeDecoderLayer


def _mixtral(tf: Any) -> tuple:
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    config = tf.MixtralConfig(
        hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        **_ATTENTION,
    )  # fmt: skip
    return tf.MixtralForCausalLM, config, MixtralDecoderLayer


def _olmoe(tf: Any) -> tuple:
    from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer

    config = tf.OlmoeConfig(
        hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2, **_ATTENTION
    )
    return tf.OlmoeForCausalLM, config, OlmoeDecoderLayer


def _deepseek_v3(tf: Any) -> tuple:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = tf.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, **_ATTENTION,
    )  # fmt: skip
    return tf.DeepseekV3ForCausalLM, config, DeepseekV3DecoderLayer


def _gpt_oss(tf: Any) -> tuple:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    config = tf.GptOssConfig(
        hidden_size=64, intermediate_size=32, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, **_ATTENTION,
    )  # fmt: skip
    return tf.GptOssForCausalLM, config, GptOssDecoderLayer


def _glm4_moe(tf: Any) -> tuple:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    config = tf.Glm4MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
        n_group=1, topk_group=1, **_ATTENTION,
    )  # fmt: skip
    return tf.Glm4MoeForCausalLM, config, Glm4MoeDecoderLayer


def _qwen3_5_moe(tf: Any) -> tuple:
    """Hybrid: a gated delta-net (linear attention) layer, then a full-attention one."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeDecoderLayer,
        Qwen3_5MoeForCausalLM,
    )

    config = tf.Qwen3_5MoeTextConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        **_ATTENTION,
    )  # fmt: skip
    return Qwen3_5MoeForCausalLM, config, Qwen3_5MoeDecoderLayer


FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
    "qwen3_5_moe": _qwen3_5_moe,
}
EXPERTS = ("eager", "grouped_mm")  # transformers' experts implementations: a loop, one GEMM


def moe_model(family: str, experts: str) -> tuple[torch.nn.Module, type]:
    """The family's tiny causal LM with ``experts`` experts (train mode), and its layer class."""
    import transformers

    cls, config, layer = FAMILIES[family](transformers)
    config.vocab_size = VOCAB
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # sinks: no SDPA
    config._experts_implementation = experts
    if family == "qwen3_5_moe":
        # Checkpointed training calls run without the key-value cache (``blocks/hf_cache.py``),
        # as under Hugging Face's own checkpointing; the reference too: Qwen3.5's linear
        # attention computes its first batch otherwise with one (transformers 5.25, 1e-9 apart).
        config.use_cache = False
    torch.manual_seed(0)
    model = cls(config)
    model.train()
    return model, layer
