"""What every method trains: the model at a named size, its block class, and the batch."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer

# The examples' training jobs' model (examples/train_lightning.py), with ModelConfig's defaults.
EXAMPLE_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
SIZES = {
    # model shape; seq; batch
    "tiny": (
        dict(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
        ),
        32,
        2,
    ),
    "small": (
        dict(
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            intermediate_size=768,
            moe_intermediate_size=256,
        ),
        256,
        2,
    ),
    # The examples' training jobs, batch 4 x 256.
    "example": (
        dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, **EXAMPLE_SHAPE),
        256,
        4,
    ),
    # Qwen3-style, about 1.0B parameters (16 layers of 54M, 32K vocabulary): for one GPU.
    "1b": (
        dict(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=1536,
            vocab_size=32768,
        ),
        2048,
        2,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM with the example models' ``loss(ids)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = model.config.vocab_size

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def build_model(kind: str, size: str, dropout: float) -> tuple[torch.nn.Module, type, int, int]:
    """The model, its block class, sequence length and batch size."""
    shape, seq, batch = SIZES[size]
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        config = Qwen3Config(
            vocab_size=shape.get("vocab_size", 256),
            hidden_size=shape["hidden_size"],
            intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["num_layers"],
            num_attention_heads=shape["num_heads"],
            num_key_value_heads=shape["num_kv_heads"],
            head_dim=shape["head_dim"],
            max_position_embeddings=max(seq, 128),
            attention_dropout=dropout,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        return HFCausalLM(Qwen3ForCausalLM(config)), Qwen3DecoderLayer, seq, batch
    torch.manual_seed(0)
    config = ModelConfig(dropout=dropout, moe=kind == "moe", num_experts=4, top_k=2, **shape)
    return DecoderLM(config), (MoEDecoderLayer if config.moe else DecoderLayer), seq, batch


@dataclasses.dataclass
class Workload:
    model: torch.nn.Module  # the initial weights every method copies
    block: type  # the block class every method checkpoints
    seq: int
    batch: int
    device: torch.device

    def ids(self, batch: int, seed: int) -> torch.Tensor:
        """A batch of random token ids, the same for a given seed."""
        vocab = getattr(self.model, "vocab_size", None) or self.model.config.vocab_size
        ids = torch.randint(
            0, vocab, (batch, self.seq), generator=torch.Generator().manual_seed(seed)
        )
        return ids.to(self.device)


def load_workload(args: argparse.Namespace) -> Workload:
    """The command line's model on its device and dtype (``--seq``/``--batch`` override the
    size's), with torch's thread count set first."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, block, seq, batch = build_model(args.model, args.size, args.dropout)
    model = model.to(device=device, dtype=DTYPES[args.dtype])
    return Workload(model, block, args.seq or seq, args.batch or batch, device)
