"""The Hugging Face Trainer job: a small Qwen3 on the standard library's text, with TapeSAC.

Run from the repository root on 2 CPU processes:

    tapesac launch --config_file examples/hf_trainer_tapesac.yaml -m examples.train_hf_trainer

The only TapeSAC line is ``callbacks=[TapeSACTrainerCallback(...)]``; its settings come from the
arguments, else the YAML's ``tapesac_*`` keys. At the end rank 0 prints a summary: the plan per
region, predicted vs measured speedup, peak memory against the limit. ``--baseline hf`` trains
the same Trainer with its own activation checkpointing (``torch.utils.checkpoint``, non-reentrant)
instead, the reference for bitwise comparisons (start it with a YAML without tapesac_* keys);
``--out DIR`` writes per-micro-batch losses, TapeSAC's counters and what the run was made of as
JSON (one file per rank).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import (
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from examples.data import batches
from examples.models import tiny_qwen3
from examples.records import step_record, summary
from tapesac_core import block_config
from tapesac_lightning import TapeSACTrainerCallback


def parser() -> argparse.ArgumentParser:
    """The job's options."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--memory-limit", default=None, help="default: the YAML's, else 0.9")
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout")
    p.add_argument("--batch-size", type=int, default=4, help="per process and micro-batch")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--accumulate", type=int, default=1, help="gradient accumulation micro-batches")
    p.add_argument("--save-steps", type=int, default=None, help="a checkpoint-N every N steps")
    p.add_argument("--resume", default=None, help="resume_from_checkpoint this folder")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--out", default=None, help="write per-rank JSON results here")
    return p


def texts(args: argparse.Namespace, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` byte sequences of the standard library's sources, of varying length."""
    source = batches(batch_size=1, max_len=args.max_len, min_len=args.min_len, seed=0)
    return [{"input_ids": next(source)[0]} for _ in range(count)]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    """The Trainer's arguments; the baseline turns its own activation checkpointing on."""
    checkpointing = {}
    if args.baseline == "hf":
        # ``activation_checkpointing`` from transformers 5.2x, ``gradient_checkpointing`` before.
        name = (
            "activation_checkpointing"
            if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
            else "gradient_checkpointing"
        )
        checkpointing = {name: True, f"{name}_kwargs": {"use_reentrant": False}}
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=["tensorboard"],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        **checkpointing,
    )


class Records(TrainerCallback):
    """Per micro-batch: its loss (from the model's forward) and TapeSAC's step counters."""

    def __init__(self, model: torch.nn.Module, tapesac: TapeSACTrainerCallback | None) -> None:
        self.tapesac = tapesac
        self.steps: list[dict[str, Any]] = []
        model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.steps.append({"loss": output.loss.item()})

    def on_substep_end(self, *args: Any, **kwargs: Any) -> None:
        self._counters()

    def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._counters()

    def _counters(self) -> None:
        if self.tapesac is not None and self.tapesac.controller is not None:
            self.steps[-1].update(step_record(self.tapesac.controller.report))


def describe(model: torch.nn.Module, trainer: Trainer) -> dict[str, Any]:
    """What the trained run is made of, for tests."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return {
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type.value),
        "dtensor_params": any(isinstance(p, DTensor) for p in model.parameters()),
        "tapesac_blocks": sum(block_config(m) is not None for m in model.modules()),
        "hf_checkpointed": sum(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
        ),
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
    }


def run(args: argparse.Namespace) -> None:
    """Train as ``args`` say; rank 0 prints the summary."""
    model = tiny_qwen3(args.dropout)
    tapesac = (
        TapeSACTrainerCallback(memory_limit=args.memory_limit) if args.baseline == "none" else None
    )
    records = Records(model, tapesac)
    training = training_arguments(args)
    count = args.steps * args.accumulate * args.batch_size * training.world_size
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=texts(args, count),
        data_collator=collate,
        callbacks=[c for c in (tapesac, records) if c is not None],
    )
    trainer.train(resume_from_checkpoint=args.resume)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"run": describe(model, trainer), "steps": records.steps}
        if tapesac is not None:
            result["limit"] = tapesac.controller.limit_bytes()
        (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    if trainer.is_world_process_zero() and tapesac is not None:
        print(summary(tapesac.controller, [s for s in records.steps if "mode" in s]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(parser().parse_args())
