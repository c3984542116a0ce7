"""TapeSACTrainerCallback: Hugging Face's Trainer on 2 CPU processes (data-parallel, gloo) under
`tapesac launch`, and in this process for the layer flag and TRL's SFTTrainer."""

import glob
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from launch import ROOT, tapesac_launch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tapesac_core.metric_names import SCALARS

EXAMPLE = yaml.safe_load((ROOT / "examples" / "hf_trainer_tapesac.yaml").read_text())
SHORT = ("--steps", "6", "--min-len", "96", "--max-len", "96", "--accumulate", "2")
SCRIPT = ("-m", "examples.train_hf_trainer")


def config(tmp: Path, tapesac: bool = True, **keys) -> Path:
    """The example YAML, with or without its tapesac_* keys, ``keys`` added to its fsdp_config."""
    data = json.loads(json.dumps(EXAMPLE))
    if not tapesac:
        data["fsdp_config"] = {
            k: v for k, v in data["fsdp_config"].items() if not k.startswith("tapesac_")
        }
    data["fsdp_config"].update(keys)
    path = tmp / f"config{len(list(tmp.glob('config*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fit(tmp: Path, name: str, *args: str, tapesac: bool = True, **keys) -> list[dict]:
    """Each rank's JSON; the Trainer's output_dir is ``tmp/name/output``."""
    out = tmp / name
    baseline = () if tapesac else ("--baseline", "hf")
    tapesac_launch(
        config(tmp, tapesac, **keys),
        *args,
        *baseline,
        "--output-dir",
        str(out / "output"),
        "--out",
        str(out),
        script=SCRIPT,
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def losses(ranks: list[dict]) -> list[list[float]]:
    return [[s["loss"] for s in rank["steps"]] for rank in ranks]


@pytest.mark.slow
@pytest.mark.launch
def test_trainer_is_bitwise_its_own_checkpointing_one_step_per_micro_batch(tmp_path) -> None:
    # Every block recorded (no block plain): the plans save values and replay the rest.
    tapesac = fit(tmp_path, "tapesac", *SHORT, tapesac_plain_blocks=False)
    baseline = fit(tmp_path, "hf", *SHORT, tapesac=False)
    assert losses(tapesac) == losses(baseline)  # attention dropout on, 2 micro-batches per step
    assert [len(r["steps"]) for r in tapesac] == [12, 12]
    # The reference really ran HF's checkpointing: its flag on each layer and on the model.
    assert all(r["run"]["hf_checkpointed"] == 3 for r in baseline)
    for rank in tapesac:
        assert rank["run"] == {
            "num_processes": 2,
            "distributed_type": "MULTI_CPU",  # on CPU the Trainer runs data-parallel
            "dtensor_params": False,
            "tapesac_blocks": 2,
            "hf_checkpointed": 0,
            "checkpoint_wrappers": 0,
        }
        assert rank["limit"] == 30 * 2**20  # the YAML's tapesac_memory_limit
        steps = rank["steps"]
        planned = [s for s in steps if s["mode"] == "planned"]
        must_only = [s["replayed"] for s in steps if s["mode"] in ("warmup", "profile")]
        assert planned and all(s["saved_bytes"] > 0 for s in planned)  # beyond must-only
        assert max(s["replayed"] for s in planned) < min(must_only)
        # torch's checkpoint ran only in the full-checkpointing control steps TapeSAC asked for.
        assert all(s["torch_checkpointed"] == 0 for s in steps if s["mode"] != "full")
    assert [s["plan"] for s in tapesac[0]["steps"]] == [s["plan"] for s in tapesac[1]["steps"]]
    events = glob.glob(str(tmp_path / "tapesac" / "output" / "runs" / "**" / "events*"))
    tags = {"scalars": set(), "images": set(), "tensors": set()}
    for path in events:
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        acc.Reload()
        for kind, names in tags.items():
            names.update(acc.Tags()[kind])
    assert {s for s in tags["scalars"] if s.startswith("tapesac/")} == set(SCALARS)
    assert "train/loss" in tags["scalars"]
    assert tags["images"] == {"tapesac/frontier"}
    assert "tapesac/plan/text_summary" in tags["tensors"]


@pytest.mark.slow
@pytest.mark.launch
def test_resume_from_a_checkpoint_elsewhere_needs_no_profiling(tmp_path) -> None:
    common = (*SHORT, "--memory-limit", "28MiB", "--save-steps", "3")
    whole = fit(tmp_path, "whole", *common)
    moved = tmp_path / "elsewhere" / "checkpoint-3"
    shutil.copytree(tmp_path / "whole" / "output" / "checkpoint-3", moved)
    state = json.loads((moved / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["TapeSAC"]["plans"]
    assert any("tapesac/saved_bytes" in entry for entry in state["log_history"])
    resumed = fit(tmp_path, "resumed", *common, "--resume", str(moved))
    assert [r["limit"] for r in resumed] == [28 * 2**20] * 2  # explicit beats the YAML
    assert losses(resumed) == [run[6:] for run in losses(whole)]
    assert [s["mode"] for s in resumed[0]["steps"]] == ["planned"] * 6  # no profiling again
    # The default runs blocks plain with memory to spare; what they keep counts as saved.
    planned = [s for s in whole[0]["steps"] + resumed[0]["steps"] if s["mode"] == "planned"]
    assert any(s["plain_blocks"] for s in planned)
    assert all(s["saved_bytes"] > 0 for s in planned)
    assert resumed[0]["steps"][0]["plan"] == whole[0]["steps"][5]["plan"]


def tiny_qwen3(vocab_size: int = 64, dropout: float = 0.1) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attention_dropout=dropout,
    )
    return Qwen3ForCausalLM(config)


def test_hugging_face_layer_flag_is_switched_off_with_one_info_line(
    tmp_path, caplog, fresh_accelerate_state
) -> None:
    from transformers import Trainer, TrainingArguments

    from tapesac_lightning import TapeSACTrainerCallback

    model = tiny_qwen3()
    model.gradient_checkpointing_enable()  # torch's checkpoint inside each layer
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = TapeSACTrainerCallback(memory_limit="20MiB", warmup_steps=1)
    args = TrainingArguments(
        tmp_path, max_steps=3, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    with caplog.at_level(logging.INFO, logger="tapesac_lightning.hf_trainer"):
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tapesac_lightning.hf_trainer"]
    assert line.startswith("TapeSAC replaces the Trainer's activation checkpointing")
    assert "Qwen3ForCausalLM's own" in line
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    trainer.train()  # no TapeSACError from torch's checkpoint inside a block
    assert callback.controller.steps == 3


def test_declared_deterministic_ops_reach_every_block(tmp_path, fresh_accelerate_state) -> None:
    from transformers import Trainer, TrainingArguments

    from tapesac_core import block_config
    from tapesac_lightning import TapeSACTrainerCallback

    model = tiny_qwen3()
    callback = TapeSACTrainerCallback(memory_limit="20MiB", deterministic_ops={"mylib::norm"})
    args = TrainingArguments(tmp_path, max_steps=1, report_to=[], use_cpu=True)
    Trainer(model=model, args=args, train_dataset=[], callbacks=[callback])
    configs = [block_config(m) for m in model.model.layers]
    assert configs and all(c.deterministic_ops == {"mylib::norm"} for c in configs)


def test_model_init_without_the_wrapper_names_the_fix(tmp_path, fresh_accelerate_state) -> None:
    from transformers import Trainer, TrainingArguments

    from tapesac_core import TapeSACError
    from tapesac_lightning import TapeSACTrainerCallback

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        tmp_path, max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    callback = TapeSACTrainerCallback(memory_limit="20MiB", warmup_steps=1)

    def init() -> torch.nn.Module:
        return tiny_qwen3()

    trainer = Trainer(model_init=init, args=args, train_dataset=data, callbacks=[callback])
    with pytest.raises(TapeSACError, match=r"model_init=callback.model_init\(model_init\)"):
        trainer.train()
    wrapped = Trainer(
        model_init=callback.model_init(init),
        args=args,
        train_dataset=data,
        callbacks=[callback],
    )
    wrapped.train()
    assert callback.controller.steps == 2


def byte_tokenizer():
    """A tokenizer built here: one token per character of a small alphabet, plus EOS and PAD."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = "abcdefghijklmnopqrstuvwxyz .,"
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<eos>": len(alphabet), "<pad>": 30}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def sft_losses(tmp: Path, callbacks: list) -> list[float]:
    """Per-step losses of TRL's SFTTrainer (its default: its own activation checkpointing on)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    AcceleratorState._reset_state(reset_partial_state=True)
    words = ["tape", "replay", "plan", "saved", "memory", "limit", "block", "step"]
    texts = [" ".join(words[(i + j) % 8] for j in range(6 + i % 4)) + "." for i in range(16)]
    args = SFTConfig(
        output_dir=str(tmp),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        bf16=False,
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=tiny_qwen3(vocab_size=32),
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=byte_tokenizer(),
        callbacks=callbacks,
    )
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_trl_sft_trainer_is_bitwise_its_own_checkpointing(tmp_path, fresh_accelerate_state) -> None:
    pytest.importorskip("trl")
    from tapesac_lightning import TapeSACTrainerCallback

    callback = TapeSACTrainerCallback(memory_limit="20MiB", warmup_steps=1)
    assert sft_losses(tmp_path / "tapesac", [callback]) == sft_losses(tmp_path / "own", [])
    assert callback.controller.steps == 8  # one step per micro-batch
    assert callback.controller.report.mode == "planned"
