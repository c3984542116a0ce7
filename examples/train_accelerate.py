"""The Accelerate job: the Lightning example's model and data, trained with TapeSACAccelerator.

Run from the repository root on 2 CPU processes:

    tapesac launch --config_file examples/accelerate_tapesac.yaml -m examples.train_accelerate

The settings come from the YAML (FSDP2, the block class, ``tapesac_memory_limit``); the script is
an ordinary Accelerate loop whose only TapeSAC line is the import. At the end rank 0 prints a
summary: the plan per region, predicted vs measured speedup, peak memory against the limit.
``--baseline torch`` trains under plain ``Accelerator`` with ``torch.utils.checkpoint`` on every
block instead (the reference for bitwise comparisons; the YAML must then have no tapesac_* keys
and ``fsdp_activation_checkpointing: false``), ``--baseline accelerate`` under plain
``Accelerator`` as the YAML says; ``--out DIR`` writes per-step losses, TapeSAC's counters and what
the run was made of as JSON (one file per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from examples.data import batches
from examples.models import DecoderLM, ModelConfig, tiny_qwen3
from examples.records import step_record, summary
from tapesac_core import block_config
from tapesac_lightning import TapeSACAccelerator
from tapesac_lightning.accelerate import use_fsdp_on_cpu


def parser() -> argparse.ArgumentParser:
    """The job's options."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--moe", action="store_true", help="the mixture-of-experts variant")
    p.add_argument("--hf", action="store_true", help="a tiny Hugging Face Qwen3 instead")
    p.add_argument("--steps", type=int, default=300, help="micro-batches per rank")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--accumulate", type=int, default=1, help="gradient accumulation micro-batches")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N micro-batches")
    p.add_argument("--save-at", type=int, default=None, help="save_state after this micro-batch")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--resume", default=None, help="load_state from this folder and continue")
    p.add_argument("--baseline", choices=["none", "torch", "accelerate"], default="none")
    p.add_argument("--logdir", default="runs")
    p.add_argument("--out", default=None, help="write per-rank JSON results here")
    return p


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The example decoder (or a tiny Hugging Face Qwen3), seeded identically on every rank."""
    torch.manual_seed(0)
    if not args.hf:
        return DecoderLM(
            ModelConfig(
                moe=args.moe,
                dropout=args.dropout,
                hidden_size=128,
                intermediate_size=256,
                moe_intermediate_size=128,
            )
        )
    return tiny_qwen3(args.dropout)


def loss_of(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    """Next-token loss through the prepared model's own forward (FSDP2's hooks run)."""
    if hf:
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def checkpoint_every_block(model: torch.nn.Module) -> None:
    """The reference: ``torch.utils.checkpoint(use_reentrant=False)`` around every decoder layer,
    RNG preserved (Accelerate's own wrapper does not preserve it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    layers = model.model.layers if hasattr(model, "model") else model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """TapeSACAccelerator, or plain Accelerator on the same FSDP2 path for the baselines."""
    common = dict(
        log_with="tensorboard", project_dir=args.logdir, gradient_accumulation_steps=args.accumulate
    )
    if args.baseline == "none":
        return TapeSACAccelerator(**common)
    accelerator = Accelerator(**common)
    use_fsdp_on_cpu(accelerator)
    return accelerator


def describe(
    accelerator: Accelerator, model: torch.nn.Module, plain_keys: list[str]
) -> dict[str, Any]:
    """What the prepared run is made of, for tests."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return {
        "rank": torch.distributed.get_rank(),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "is_main": accelerator.is_main_process,
        "is_fsdp2": accelerator.is_fsdp2,
        "dtensor_params": all(isinstance(p, DTensor) for p in model.parameters()),
        "tapesac_blocks": sum(block_config(m) is not None for m in model.modules()),
        "tapesac_classes": sorted(
            {
                type(m).__name__.removeprefix("FSDP")
                for m in model.modules()
                if block_config(m) is not None
            }
        ),
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        "same_state_dict_keys": sorted(model.state_dict()) == plain_keys,
    }


def run(args: argparse.Namespace) -> None:
    """Train as ``args`` say; rank 0 prints the summary."""
    accelerator = make_accelerator(args)
    model = build_model(args)
    plain_keys = sorted(model.state_dict())
    if args.baseline == "torch":
        checkpoint_every_block(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    source = batches(batch_size=args.batch_size, max_len=args.max_len, min_len=args.min_len, seed=0)
    data = [next(source) for _ in range(args.steps * accelerator.num_processes)]
    loader = torch.utils.data.DataLoader(data, batch_size=1, collate_fn=lambda items: items[0])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.init_trackers("tapesac")
    if args.resume:
        accelerator.load_state(args.resume)
    skip = int(args.resume and args.save_at or 0)
    records = []
    for i, ids in enumerate(accelerator.skip_first_batches(loader, skip) if skip else loader, skip):
        with accelerator.accumulate(model):
            loss = loss_of(model, ids, args.hf)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        entry = {
            "loss": loss.item(),
            "tokens": ids.numel(),
            "batch": zlib.crc32(ids.numpy().tobytes()),
        }
        controller = getattr(accelerator, "tapesac_controller", None)
        if controller is not None:
            entry.update(step_record(controller.report), controller_steps=controller.steps)
        if args.eval_every and (i + 1) % args.eval_every == 0:
            with torch.no_grad():
                entry["eval_loss"] = loss_of(model, ids, args.hf).item()
        records.append(entry)
        if args.save_at is not None and i + 1 == args.save_at:
            accelerator.save_state(args.save_dir)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"run": describe(accelerator, model, plain_keys), "steps": records}
        (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()
    controller = getattr(accelerator, "tapesac_controller", None)
    if accelerator.is_main_process and controller is not None:
        print(summary(controller, records))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(parser().parse_args())
