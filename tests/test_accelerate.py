"""TapeSACAccelerator end to end: `tapesac launch` of the example job on 2 CPU processes (gloo)."""

import glob
import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from launch import ROOT, tapesac_launch, tapesac_report
from support import SMALL
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from examples.data import batches
from tapesac_core import TapeSACError
from tapesac_core.metric_names import SCALARS
from tapesac_lightning.accelerate import (
    SETTINGS_ENV,
    TapeSACAccelerator,
    TapeSACPlugin,
    split_config,
)

EXAMPLE = yaml.safe_load((ROOT / "examples" / "accelerate_tapesac.yaml").read_text())
SHORT = ("--steps", "10", "--min-len", "96", "--max-len", "96")


def config(tmp: Path, tapesac: bool = True, **changes) -> Path:
    """The example YAML, with or without its tapesac_* keys, fsdp_config entries changed."""
    data = json.loads(json.dumps(EXAMPLE))
    fsdp = data["fsdp_config"]
    if not tapesac:
        fsdp = {k: v for k, v in fsdp.items() if not k.startswith("tapesac_")}
    fsdp.update({k: v for k, v in changes.items() if k.startswith(("fsdp_", "tapesac_"))})
    data.update({k: v for k, v in changes.items() if not k.startswith(("fsdp_", "tapesac_"))})
    data["fsdp_config"] = fsdp
    path = tmp / f"config{len(list(tmp.glob('config*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fit(tmp: Path, name: str, yaml_path: Path, *args: str) -> list[dict]:
    """Each rank's JSON: what the run was made of and its per-step records."""
    out = tmp / name
    tapesac_launch(yaml_path, *args, "--out", str(out), "--logdir", str(out / "runs"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def losses(ranks: list[dict]) -> list[list[float]]:
    return [[s["loss"] for s in rank["steps"]] for rank in ranks]


def torch_baseline(tmp: Path, *args: str, **changes) -> list[dict]:
    """Plain Accelerator, same FSDP2 path, torch.utils.checkpoint (RNG preserved) on every block."""
    yaml_path = config(tmp, tapesac=False, fsdp_activation_checkpointing=False, **changes)
    return fit(tmp, "torch", yaml_path, *args, "--baseline", "torch")


RECORDED = {"tapesac_plain_blocks": False}  # every block recorded: plans save, none runs plain


def assert_really_tapesac(ranks: list[dict], recorded: bool = True) -> None:
    """Planned steps ran non-empty plans with fewer replayed nodes, the same plan on both ranks:
    saving values in every block (``recorded``), else running some blocks plain (the default
    with memory to spare)."""
    steps = ranks[0]["steps"]
    blocks = ranks[0]["run"]["tapesac_blocks"]
    planned = [s for s in steps if s["mode"] == "planned"]
    assert planned and all(not s["plan_empty"] for s in planned)
    if recorded:
        assert all(s["blocks"] == blocks and s["saved_bytes"] > 0 for s in planned)
    else:
        assert any(s["plain_blocks"] for s in planned)
    # What plain blocks keep beyond must-only counts as saved (the scalar agrees with explain()).
    assert all(s["saved_bytes"] > 0 for s in planned)
    assert all(s["blocks"] + s["plain_blocks"] + s["torch_checkpointed"] == blocks for s in steps)
    must_only = [s["replayed"] for s in steps if s["mode"] not in ("planned", "full")]
    assert max(s["replayed"] for s in planned) < min(must_only)
    assert [s["plan"] for s in steps] == [s["plan"] for s in ranks[1]["steps"]]
    # Full-checkpointing control steps ran torch.utils.checkpoint on every block, recording none.
    full = [s for s in steps if s["mode"] == "full"]
    assert full and all((s["blocks"], s["torch_checkpointed"]) == (0, blocks) for s in full)


@pytest.mark.slow
@pytest.mark.launch
def test_launch_shards_the_run_is_bitwise_torch_checkpoint_and_logs_from_rank_0(tmp_path) -> None:
    tapesac = fit(tmp_path, "tapesac", config(tmp_path), *SHORT)
    assert losses(tapesac) == losses(torch_baseline(tmp_path, *SHORT))
    assert_really_tapesac(tapesac, recorded=False)  # the default: blocks run plain
    for rank, result in enumerate(tapesac):
        assert result["run"] == {
            "rank": rank,
            "num_processes": 2,
            "process_index": rank,
            "is_main": rank == 0,
            "is_fsdp2": True,
            "dtensor_params": True,
            "tapesac_blocks": 4,
            "tapesac_classes": ["DecoderLayer"],
            "checkpoint_wrappers": 0,
            "same_state_dict_keys": True,
        }
    # Each rank trained its own shard of the loader: together, every batch once.
    source = batches(batch_size=4, max_len=96, min_len=96, seed=0)
    every = [zlib.crc32(next(source).numpy().tobytes()) for _ in range(20)]
    assert [s["batch"] for s in tapesac[0]["steps"]] == every[0::2]
    assert [s["batch"] for s in tapesac[1]["steps"]] == every[1::2]
    # Tracker files come from rank 0 alone, with the Lightning strategy's tags.
    (events,) = glob.glob(str(tmp_path / "tapesac" / "runs" / "**" / "events*"), recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(SCALARS)
    assert acc.Tags()["images"] == ["tapesac/frontier"]
    assert sorted(acc.Tags()["tensors"]) == [
        "tapesac/plan/text_summary",
        "tapesac/plan_json/text_summary",
    ]


@pytest.mark.slow
@pytest.mark.launch
def test_plain_accelerator_on_the_same_path_wraps_blocks_in_its_checkpoint_wrapper(
    tmp_path,
) -> None:
    plain = fit(
        tmp_path,
        "plain",
        config(tmp_path, tapesac=False),
        "--steps",
        "1",
        "--baseline",
        "accelerate",
    )
    assert [r["run"]["checkpoint_wrappers"] for r in plain] == [4, 4]
    assert [r["run"]["tapesac_blocks"] for r in plain] == [0, 0]
    assert all(r["run"]["is_fsdp2"] for r in plain)


@pytest.mark.slow
@pytest.mark.launch
def test_tapesac_checkpoint_modules_names_other_blocks_than_fsdp_wraps(tmp_path) -> None:
    yaml_path = config(tmp_path, tapesac_checkpoint_modules=["GatedMLP"])
    ranks = fit(tmp_path, "mlp", yaml_path, "--steps", "1")
    assert [r["run"]["tapesac_classes"] for r in ranks] == [["GatedMLP"], ["GatedMLP"]]
    assert [r["run"]["tapesac_blocks"] for r in ranks] == [4, 4]


@pytest.mark.slow
@pytest.mark.launch
def test_hugging_face_qwen3_named_by_class_in_the_yaml(tmp_path) -> None:
    args = (*SHORT, "--hf")
    yaml_path = config(tmp_path, fsdp_transformer_layer_cls_to_wrap="Qwen3DecoderLayer", **RECORDED)
    tapesac = fit(tmp_path, "tapesac", yaml_path, *args)
    baseline = torch_baseline(
        tmp_path, *args, fsdp_transformer_layer_cls_to_wrap="Qwen3DecoderLayer"
    )
    assert losses(tapesac) == losses(baseline)
    assert_really_tapesac(tapesac)
    assert tapesac[0]["run"]["tapesac_classes"] == ["Qwen3DecoderLayer"]
    assert tapesac[0]["run"]["tapesac_blocks"] == 2 and tapesac[0]["run"]["same_state_dict_keys"]


@pytest.mark.slow
@pytest.mark.launch
def test_bf16_with_accumulation_and_no_grad_evaluation_is_bitwise_torch_checkpoint_one_step_per_micro_batch(
    tmp_path,
) -> None:
    """One launch (and one baseline) for what were two tests: under bf16 mixed precision,
    training with 2 micro-batches per optimizer step and a no-grad evaluation every third
    micro-batch gives losses and evaluation losses bitwise those of torch's checkpoint under the
    same precision; each micro-batch is one controller step (the evaluations are none); the run
    really used TapeSAC."""
    args = (*SHORT, "--accumulate", "2", "--eval-every", "3")
    yaml_path = config(tmp_path, mixed_precision="bf16", **RECORDED)
    tapesac = fit(tmp_path, "tapesac", yaml_path, *args)
    baseline = torch_baseline(tmp_path, *args, mixed_precision="bf16")
    assert losses(tapesac) == losses(baseline)
    assert [[s["eval_loss"] for s in r["steps"] if "eval_loss" in s] for r in tapesac] == [
        [s["eval_loss"] for s in r["steps"] if "eval_loss" in s] for r in baseline
    ]
    assert [s["controller_steps"] for s in tapesac[0]["steps"]] == list(range(1, 11))
    assert_really_tapesac(tapesac)


@pytest.mark.slow
@pytest.mark.launch
def test_save_state_load_state_round_trips_the_plan_cache(tmp_path) -> None:
    yaml_path = config(tmp_path)
    common = ("--steps", "12", "--min-len", "96", "--max-len", "96", "--dropout", "0.0")
    whole = fit(
        tmp_path,
        "whole",
        yaml_path,
        *common,
        "--save-at",
        "6",
        "--save-dir",
        str(tmp_path / "state"),
    )
    resumed = fit(
        tmp_path,
        "resumed",
        yaml_path,
        *common,
        "--resume",
        str(tmp_path / "state"),
        "--save-at",
        "6",
    )
    assert losses(resumed) == [run[6:] for run in losses(whole)]
    assert [s["mode"] for s in resumed[0]["steps"]] == ["planned"] * 6  # no warm-up, no profiling
    assert resumed[0]["steps"][0]["plan"] == whole[0]["steps"][5]["plan"]
    # tapesac report reads the plan cache from the save_state folder.
    result = json.loads(tapesac_report(tmp_path / "state", "--json"))
    assert result["kind"] == "accelerate"
    assert whole[0]["steps"][5]["plan"] in [b["plan"] for b in result["buckets"]]


@pytest.mark.slow
@pytest.mark.launch
def test_a_dynamo_backend_in_the_yaml_fails_the_launch_at_start_naming_the_key_and_the_fix(
    tmp_path,
) -> None:
    """The one bad YAML still launched: the workers stop in TapeSACAccelerator() (before any
    model), and the error, with its fix, reaches the user as the launch's failure. The other
    bad YAMLs go through the same checks in this process (the two tests below)."""
    change = {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}
    done = tapesac_launch(config(tmp_path, **change), "--steps", "2", check=False)
    assert done.returncode != 0
    assert "does not run with dynamo_backend" in done.stderr and "Fix:" in done.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tapesac_memory_limit": 1.5}, "tapesac_memory_limit: 1.5"),
        ({"tapesac_warmup_step": 2}, "unknown key fsdp_config.tapesac_warmup_step"),
        ({"fsdp_version": 1}, "fsdp_config.fsdp_version: 2"),
    ],
    ids=["limit", "unknown_key", "fsdp1"],
)
def test_bad_yaml_stops_tapesac_launch_before_any_worker_naming_the_key_and_the_fix(
    tmp_path, monkeypatch, change, message
) -> None:
    """``tapesac launch`` as the user runs it (its main()), in this process: these YAMLs fail
    its own checks before Accelerate's launcher would start a worker (here that would fail the
    test), with a message naming the key and the fix as the exit status (which Python prints
    to stderr, exiting with code 1)."""
    from tapesac_lightning.cli import main

    def started(args) -> None:
        raise AssertionError("tapesac launch started the workers")

    monkeypatch.setattr("accelerate.commands.launch.launch_command", started)
    for name in (SETTINGS_ENV, "ACCELERATE_USE_CPU"):  # what a launch that passed would set
        monkeypatch.delenv(name, raising=False)
    command = ["launch", "--config_file", str(config(tmp_path, **change))]
    with pytest.raises(SystemExit) as stopped:
        main([*command, "-m", "examples.train_accelerate", "--steps", "2"])
    assert isinstance(stopped.value.code, str), stopped.value.code  # sys.exit(message)
    assert message in stopped.value.code and "Fix:" in stopped.value.code


def test_a_yaml_block_class_the_model_lacks_is_an_error_naming_the_key_and_the_fix() -> None:
    """The check a worker makes in prepare() when fsdp_transformer_layer_cls_to_wrap names a
    class the model lacks (a launch of such a YAML fails there): TapeSACAccelerator's own code
    on the example decoder, given the names as Accelerate's FSDP plugin holds them from the
    YAML (that the YAML's names reach the plugin, the launched Qwen3 test shows)."""
    from examples.models import DecoderLM, ModelConfig

    fsdp_plugin = SimpleNamespace(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    worker = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin))
    plugin = TapeSACPlugin.from_keys(split_config(EXAMPLE)[1])
    with pytest.raises(TapeSACError) as stopped:
        TapeSACAccelerator._checkpoint_blocks(worker, DecoderLM(ModelConfig(**SMALL)), plugin)
    message = str(stopped.value)
    assert "fsdp_transformer_layer_cls_to_wrap names 'LlamaDecoderLayer'" in message
    assert "Fix:" in message


def test_plugin_from_yaml_keys_and_explicit_fields_win() -> None:
    yaml_plugin = TapeSACPlugin.from_keys(
        {"tapesac_memory_limit": "20GiB", "tapesac_warmup_steps": 3}
    )
    assert yaml_plugin.config().memory_limit.bytes == 20 * 2**30
    merged = TapeSACPlugin(memory_limit=0.5, settings={"profile_steps": 4}).over(yaml_plugin)
    assert merged.config().memory_limit.fraction == 0.5
    assert (merged.config().warmup_steps, merged.config().profile_steps) == (3, 4)
    with pytest.raises(TapeSACError, match="unknown TapeSAC setting 'warmup'"):
        TapeSACPlugin(settings={"warmup": 1})
    declared = TapeSACPlugin.from_keys({"tapesac_deterministic_ops": "mylib::fused_norm"})
    assert declared.deterministic_ops == ("mylib::fused_norm",)
    with pytest.raises(TapeSACError, match="tapesac_deterministic_ops.*'namespace::name'"):
        TapeSACPlugin.from_keys({"tapesac_deterministic_ops": ["fused_norm"]})


def test_without_settings_it_is_plain_accelerate(monkeypatch, fresh_accelerate_state) -> None:
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    accelerator = TapeSACAccelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    assert accelerator.tapesac_plugin is None and accelerator.tapesac_controller is None
    assert not any(hasattr(m, "_tapesac") for m in model.modules())
    assert not model._forward_pre_hooks


HF_CHECKPOINTED = """
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tapesac_lightning import TapeSACAccelerator

accelerator = TapeSACAccelerator()
config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
model = Qwen3ForCausalLM(config)
model.gradient_checkpointing_enable()  # Hugging Face's own: torch's checkpoint in each layer
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 64, (2, 16))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
"""


@pytest.mark.slow
@pytest.mark.launch
def test_hugging_face_checkpointing_inside_the_blocks_stops_the_run_naming_the_fix(
    tmp_path,
) -> None:
    script = tmp_path / "hf_checkpointed.py"
    script.write_text(HF_CHECKPOINTED)
    yaml_path = config(tmp_path, fsdp_transformer_layer_cls_to_wrap="Qwen3DecoderLayer")
    done = tapesac_launch(yaml_path, check=False, script=(str(script),))
    assert done.returncode != 0
    assert "has Hugging Face activation checkpointing on" in done.stderr, done.stderr[-3000:]
    assert "gradient_checkpointing_disable()" in done.stderr


FORWARDS_WITHOUT_BACKWARD = """
import json
import logging
import sys
from pathlib import Path

import torch

from examples.data import batches
from examples.models import DecoderLM, ModelConfig
from tapesac_lightning import TapeSACAccelerator

logging.basicConfig(level=logging.INFO)
accelerator = TapeSACAccelerator()
torch.manual_seed(0)
model = DecoderLM(ModelConfig())
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
controller = accelerator.tapesac_controller
source = batches(batch_size=4, max_len=96, min_len=96, seed=accelerator.process_index)
glance = torch.randint(0, 256, (2, 32))  # 64 tokens: a training micro-batch has 384


def loss_of(ids):
    logits = model(ids)[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def train(loss):
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


records = []


def record(case):
    report = controller.report  # blocks: recorded, or run under torch's checkpoint (full steps)
    blocks = report.blocks + report.torch_checkpointed + report.plain_blocks
    records.append({"case": case, "steps": controller.steps, "step": report.step,
                    "mode": report.mode, "blocks": blocks,
                    "tokens": report.local_tokens["DecoderLayer"]})


for case in ["logging"] * 3 + ["skip", "after skip"] + ["dpo"] * 2 + ["plain"]:
    if case == "logging":  # a forward with grad for a log line, its output dropped at once
        model(glance).float().mean().item()
    if case == "dpo":  # two forwards (chosen, rejected), one backward
        loss = loss_of(next(source)) + loss_of(next(source))
    else:
        loss = loss_of(next(source))
    if case == "skip":  # a batch the loop skips: no backward; its loss lives on until rebound
        records.append({"case": case, "steps": controller.steps})
        continue
    train(loss)
    record(case)
accelerator.end_training()
Path(sys.argv[1], f"rank{accelerator.process_index}.json").write_text(json.dumps(records))
"""


@pytest.mark.slow
@pytest.mark.launch
def test_a_forward_without_backward_is_left_out_and_two_forwards_one_backward_are_one_step(
    tmp_path,
) -> None:
    """A forward with grad that reaches no backward is not the next micro-batch's: a logging
    forward whose output is gone before the next one begins is left out of the step; a skipped
    batch still alive then spoils the step's measurements, which are discarded. Two forwards
    before one backward (DPO: chosen and rejected) are one step with both forwards' blocks."""
    script = tmp_path / "forwards_without_backward.py"
    script.write_text(FORWARDS_WITHOUT_BACKWARD)
    done = tapesac_launch(config(tmp_path), str(tmp_path), script=(str(script),))
    for rank in range(2):
        records = json.loads((tmp_path / f"rank{rank}.json").read_text())
        by_case = lambda case: [r for r in records if r["case"] == case]  # noqa: E731
        # Each training micro-batch after a logging forward is a step of its own: its four
        # blocks, its 384 tokens (not the logging forward's 8 blocks and 64 tokens).
        logging = by_case("logging")
        assert [r["steps"] for r in logging] == [1, 2, 3]
        assert all((r["blocks"], r["tokens"]) == (4, 384) for r in logging), logging
        # The micro-batch trained after a skipped batch shares a step with it: not measured.
        (skip,), (after_skip,) = by_case("skip"), by_case("after skip")
        assert skip["steps"] == after_skip["steps"] == 3 and after_skip["step"] == 2
        # Two forwards, one backward: one step of both forwards' eight blocks.
        dpo = by_case("dpo")
        assert [(r["steps"], r["blocks"], r["tokens"]) for r in dpo] == [(4, 8, 384), (5, 8, 384)]
        (plain,) = by_case("plain")
        assert (plain["steps"], plain["blocks"], plain["tokens"]) == (6, 4, 384)
    assert done.stderr.count("reached no backward") == 2  # said once, on each rank
