"""The main job: train the Qwen3-style example model with TapeSACFSDPStrategy on 2 CPU processes.

Real text (the standard library's own sources as bytes), documents of varying length so token
counts vary, an absolute memory limit tight enough that the plan has to choose, TensorBoard
logs under ``runs/``, and a summary at the end: the plan per region, predicted vs measured
speedup, peak memory against the limit.

Run from the repository root: python -m examples.train_lightning [--moe] [--steps 300]
``--baseline torch`` trains the same model under plain FSDP2 with torch.utils.checkpoint instead
(the reference for bitwise comparisons); ``--out DIR`` writes per-step losses and TapeSAC's
counters as JSON (one file per rank).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy

from examples.data import batches
from examples.models import (
    DecoderLayer,
    DecoderLM,
    ModelConfig,
    MoEDecoderLayer,
    tiny_qwen3,
)
from examples.records import step_record, summary
from tapesac_lightning import TapeSACFSDPStrategy


class LitDecoder(pl.LightningModule):
    """Next-token prediction on byte tokens with the example decoder."""

    def __init__(self, config: ModelConfig, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = DecoderLM(config)
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TorchCheckpointed(LitDecoder):
    """The baseline: torch.utils.checkpoint on every block, FSDP2 on blocks and model."""

    def configure_model(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )
        from torch.distributed.fsdp import fully_shard

        # The example decoder keeps its layers at .layers, a Hugging Face causal LM at .model.layers.
        layers = self.model.model.layers if hasattr(self.model, "model") else self.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        mesh = self.device_mesh["data_parallel"]
        options = getattr(self, "fsdp_options", {})
        for layer in layers:
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(self.model, mesh=mesh, **options)


class Batches(torch.utils.data.Dataset):
    """Pre-cut batches of real text; each item is a whole batch, so lengths vary from step to step.

    Each rank reads every world-size-th batch, in the same order every epoch (so a run resumed
    at an epoch boundary sees the batches an uninterrupted run sees).
    """

    def __init__(
        self,
        count: int,
        batch_size: int,
        max_len: int,
        min_len: int,
        seed: int,
        grow_at: int | None = None,
    ) -> None:
        source = batches(batch_size=batch_size, max_len=max_len, min_len=min_len, seed=seed)
        self.items = [next(source) for _ in range(count)]
        if grow_at is not None:  # the batch grows mid-run: twice the sequences from here on
            self.items[grow_at:] = [torch.cat([b, b.flip(0)]) for b in self.items[grow_at:]]

    def _mine(self) -> list[torch.Tensor]:
        dist = torch.distributed
        if not dist.is_initialized():
            return self.items
        return self.items[dist.get_rank() :: dist.get_world_size()]

    def __len__(self) -> int:
        return len(self._mine())

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._mine()[i]


class Record(pl.Callback):
    """Per-step loss and TapeSAC counters of this rank, written as JSON when training ends."""

    def __init__(self, out: Path | None) -> None:
        self.out, self.steps = out, []

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        entry: dict[str, Any] = {
            "loss": outputs["loss"].item(),
            "tokens": batch.numel(),
            "global_step": trainer.global_step,
        }
        controller = getattr(trainer.strategy, "controller", None)
        if controller is not None:
            entry.update(step_record(controller.report))
        self.steps.append(entry)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"rank{trainer.global_rank}.json"
            path.write_text(json.dumps({"steps": self.steps}))


def parser() -> argparse.ArgumentParser:
    """The job's options (tests add their own on top)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moe", action="store_true", help="the mixture-of-experts variant")
    p.add_argument("--hf", action="store_true", help="a tiny Hugging Face Qwen3 instead")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--memory-limit", default="30MiB", help="absolute (e.g. 30MiB) or a fraction")
    p.add_argument(
        "--full-control-every",
        type=int,
        default=25,
        help="a full-checkpointing control step per this many planned steps (0: none)",
    )
    p.add_argument("--baseline", choices=["none", "torch"], default="none")
    p.add_argument(
        "--no-plain-blocks",
        action="store_true",
        help="record every block (no block runs plain, as without checkpointing)",
    )
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--grow-at", type=int, default=None, help="double the batch from this step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--accumulate", type=int, default=1, help="gradient accumulation batches")
    p.add_argument("--val-every", type=int, default=None, help="validate every N training batches")
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint every epoch here")
    p.add_argument("--full-checkpoint", action="store_true", help="one file, not sharded")
    p.add_argument("--resume", default=None, help="checkpoint to resume from")
    p.add_argument("--precision", default="32-true")
    p.add_argument(
        "--param-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="FSDP2 mixed precision: parameters in this dtype, gradients reduced in fp32",
    )
    p.add_argument("--logdir", default="runs")
    p.add_argument("--out", default=None, help="write per-rank JSON results here")
    return p


def quiet_lightning() -> None:
    """The job's output is its summary: Lightning's tips and setup lines, and warnings about
    choices this job makes on purpose (one process per batch, validation only on request,
    Lightning's own use of a deprecated torch pytree API), are not shown."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (
        ".*does not have many workers.*",
        ".*`validation_step` but have no `val_dataloader`.*",
        ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=message)


def fsdp_options(args: argparse.Namespace) -> dict[str, Any]:
    """``fully_shard`` options from the command line (the same for TapeSAC and the baseline)."""
    if args.param_dtype == "fp32":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    }


def run(
    args: argparse.Namespace,
    module: pl.LightningModule | None = None,
    policy: set[type[torch.nn.Module]] | None = None,
) -> None:
    """Train ``module`` (by default the example decoder) as ``args`` say."""
    quiet_lightning()
    torch.manual_seed(0)
    if module is None:
        config = ModelConfig(
            moe=args.moe,
            dropout=args.dropout,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=128,
        )
        module = (TorchCheckpointed if args.baseline == "torch" else LitDecoder)(config)
    steps_per_epoch = max(1, args.steps // args.epochs)
    data = Batches(
        steps_per_epoch * args.devices,
        args.batch_size,
        args.max_len,
        args.min_len,
        seed=0,
        grow_at=None if args.grow_at is None else args.grow_at * args.devices,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=0)
    options = fsdp_options(args)
    if args.baseline == "torch":
        module.fsdp_options = options
        if not isinstance(module, TorchCheckpointed):  # a given module gets the baseline's sharding
            module.configure_model = TorchCheckpointed.configure_model.__get__(module)
        strategy = ModelParallelStrategy(
            data_parallel_size=args.devices,
            tensor_parallel_size=1,
            save_distributed_checkpoint=not args.full_checkpoint,
        )
    else:
        strategy = TapeSACFSDPStrategy(
            memory_limit=_limit(args.memory_limit),
            activation_checkpointing_policy=policy or {DecoderLayer, MoEDecoderLayer},
            save_distributed_checkpoint=not args.full_checkpoint,
            full_control_every=args.full_control_every,
            plain_blocks=not args.no_plain_blocks,
            **options,
        )
    record = Record(Path(args.out) if args.out else None)
    callbacks: list[pl.Callback] = [record]
    if args.checkpoint_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}"
            )
        )
    validate = args.val_every is not None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every if validate else None,
        limit_val_batches=2 if validate else 0,
        logger=TensorBoardLogger(args.logdir, name="tapesac"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, loader, loader if validate else None, ckpt_path=args.resume)
    if trainer.is_global_zero and args.baseline == "none":
        print(summary(trainer.strategy.controller, record.steps))


def main() -> None:
    args = parser().parse_args()
    run(args, *(hf_decoder(args) if args.hf else ()))


def hf_decoder(args: argparse.Namespace) -> tuple[pl.LightningModule, set[type[torch.nn.Module]]]:
    """A tiny-config Hugging Face Qwen3 in a LightningModule, its decoder layer as the policy."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    return LitHuggingFace(tiny_qwen3(args.dropout)), {Qwen3DecoderLayer}


class LitHuggingFace(LitDecoder):
    """A Hugging Face causal LM trained on the same byte tokens."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        pl.LightningModule.__init__(self)
        self.model, self.lr = model, lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss


def _limit(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
