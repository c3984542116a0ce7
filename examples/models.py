"""Small Qwen3.5-style decoder language models in plain PyTorch, for tests and benchmarks.

Every block is its own ``nn.Module`` class because checkpointing wraps module classes. The layout
follows Hugging Face's Qwen3 / Qwen3.5 (pre-norm residual blocks, RMSNorm on query and key heads,
RoPE, grouped-query attention with a sigmoid output gate, SwiGLU MLPs, top-k mixture of experts).

``DecoderLM.forward(input_ids)`` returns logits; ``DecoderLM.loss(input_ids)`` returns the
next-token cross-entropy.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "top_k",
    "moe_intermediate_size",
)
_FLAGS = (
    "attention_output_gate",
    "moe",
    "shared_expert",
    "routing_weights_on_input",
    "skip_empty_experts",
    "tie_word_embeddings",
)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and variant switches of a ``DecoderLM``; defaults are a small dense byte-level model."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_output_gate: bool = True
    dropout: float = 0.0
    moe: bool = False
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 64
    shared_expert: bool = True
    routing_weights_on_input: bool = False
    skip_empty_experts: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
                " for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def tiny(cls, **overrides: object) -> "ModelConfig":
        """A two-layer config that trains in seconds on a CPU; keyword arguments override fields."""
        sizes = dict(
            hidden_size=32,
            num_layers=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
        )
        return cls(**(sizes | overrides))


def _dropout(p: float) -> nn.Module:
    # Identity rather than Dropout(0) keeps dropout ops out of the op sequence when disabled.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 as in Hugging Face Qwen3."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cosines and sines ``[seq_len, head_dim]`` for positions 0..seq_len-1, in ``like``'s dtype."""
    # float32 regardless of the model dtype: positions times frequencies lose precision in bf16.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=like.device) / head_dim
    positions = torch.arange(seq_len, dtype=torch.float32, device=like.device)
    freqs = torch.outer(positions, 1.0 / theta**exponents)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Swap the two halves of the last dimension, negating the new first half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the position angles."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with query/key RMSNorm, RoPE and a sigmoid output gate."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        # As in Qwen3.5, one matmul yields each head's query and its gate side by side.
        query_width = config.num_heads * config.head_dim * (2 if self.output_gate else 1)
        kv_width = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, query_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.dropout = _dropout(config.dropout)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        batch, seq_len, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, seq_len, self.num_heads, -1)
        gate = None
        if self.output_gate:
            query, gate = query.chunk(2, dim=-1)
        key = self.k_proj(hidden_states).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden_states).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        query = apply_rotary(self.q_norm(query).transpose(1, 2), cos, sin)
        key = apply_rotary(self.k_norm(key).transpose(1, 2), cos, sin)
        attn = F.scaled_dot_product_attention(
            query, key, value.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        attn = attn.transpose(1, 2).reshape(batch, seq_len, -1)
        if gate is not None:
            attn = attn * torch.sigmoid(gate.reshape(batch, seq_len, -1))
        return self.dropout(self.o_proj(attn))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``, then dropout."""

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.dropout = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts plus an optional always-on shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.routing_weights_on_input = config.routing_weights_on_input
        self.skip_empty_experts = config.skip_empty_experts
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.num_experts)
        )
        self.shared_expert = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size)
            if config.shared_expert
            else None
        )
        self.dropout = _dropout(config.dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = self.route(tokens)
        output = torch.zeros_like(tokens)
        for index in self._experts_to_run(selected):
            token_idx, slot = torch.where(selected == index)
            expert_weights = weights[token_idx, slot].unsqueeze(-1)
            expert_out = self._run_expert(
                self.experts[index], tokens.index_select(0, token_idx), expert_weights
            )
            # index_put_ with accumulate rather than index_add_: index_add_'s backward keeps its
            # source alive (for expand_as), so expert outputs that are only summed would stay demanded.
            output.index_put_((token_idx,), expert_out, accumulate=True)
        if self.shared_expert is not None:
            output = output + self.shared_expert(tokens)
        return self.dropout(output.view_as(hidden_states))

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Renormalised top-k routing weights and expert indices, both ``[tokens, top_k]``."""
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, selected = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(tokens.dtype), selected

    def _experts_to_run(self, selected: torch.Tensor) -> list[int]:
        if not self.skip_empty_experts:
            return list(range(len(self.experts)))
        # Data-dependent control flow, as in Hugging Face's Qwen3-MoE: idle experts do not run.
        counts = torch.bincount(selected.flatten(), minlength=len(self.experts))
        return counts.nonzero().flatten().tolist()

    def _run_expert(
        self, expert: nn.Module, tokens: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.routing_weights_on_input:
            # Weighting the input instead leaves the expert outputs feeding only the sum.
            return expert(tokens * weights)
        return expert(tokens) * weights


class DecoderLayer(nn.Module):
    """Pre-norm residual block: self-attention, then a SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.feed_forward(config)

    @staticmethod
    def feed_forward(config: ModelConfig) -> nn.Module:
        """The block after attention."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.dropout)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, sin
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MoEDecoderLayer(DecoderLayer):
    """Pre-norm residual block: self-attention, then a mixture of experts."""

    @staticmethod
    def feed_forward(config: ModelConfig) -> nn.Module:
        """The block after attention."""
        return MoE(config)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


class DecoderLM(nn.Module):
    """Decoder-only language model: embedding, decoder layers, final RMSNorm and LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_class = MoEDecoderLayer if config.moe else DecoderLayer
        self.layers = nn.ModuleList(layer_class(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``."""
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(
            input_ids.shape[1], self.config.head_dim, self.config.rope_theta, hidden_states
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.lm_head(self.norm(hidden_states))

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy: position t predicts token t + 1."""
        logits = self(input_ids)[:, :-1].float()
        return F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())


def tiny_qwen3(dropout: float) -> nn.Module:
    """The examples' tiny Hugging Face ``Qwen3ForCausalLM`` over bytes (2 layers, GQA), seeded
    identically on every rank (transformers is imported here: only its users need it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_dropout=dropout,
        )
    )
