"""TapeSACFSDPStrategy end to end: 2-process CPU fits (subprocesses: the main job through
Lightning's own launcher, which re-executes argv; the others with both ranks started at once), and
fits in this process on one rank."""

import contextlib
import glob
import statistics
from pathlib import Path

import pytest
import torch
from launch import lightning_fit, tapesac_report
from support import SHORT_SCHEDULE, SMALL
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tapesac_core import TapeSACError
from tapesac_core.metric_names import SCALARS
from tapesac_core.plan.plan import Plan


def fit(out: Path, *args: str, launcher: str = "external") -> list[list[dict]]:
    """Run the job on 2 CPU processes; each rank's per-step records."""
    return lightning_fit(out, *args, launcher=launcher)


def report(run: Path, out: Path) -> str:
    """What `tapesac report RUN --out OUT` prints."""
    return tapesac_report(run, "--out", str(out))


def losses(ranks: list[list[dict]]) -> list[list[float]]:
    return [[s["loss"] for s in steps] for steps in ranks]


SHORT = ("--steps", "10", "--min-len", "96", "--max-len", "96")


RECORDED = ("--no-plain-blocks",)  # every block recorded: plans save, none runs plain


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    """The job as a user runs it (one process, whose Lightning launcher starts rank 1) with the
    SHORT settings, launched once: the TapeSAC run of the bitwise test's default variant, and
    the run whose TensorBoard scalars and report the scalars test reads back."""
    out = tmp_path_factory.mktemp("main_job")
    return out, fit(out, *SHORT, launcher="lightning")


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize(
    "variant",
    [
        (),
        ("--accumulate", "2", "--val-every", "4", "--precision", "bf16-mixed", *RECORDED),
        # Manual optimization, and FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
        # reduce_dtype=fp32) on every fully_shard call, given to the strategy and, for the
        # baseline, to plain FSDP2 + torch.utils.checkpoint: one pair of launches for what were
        # two tests (the policy's test ran without dropout; here dropout is on).
        ("--manual", "--param-dtype", "bf16", *RECORDED),
    ],
    ids=[
        "dropout_plain_blocks",
        "accumulate_validate_bf16",
        "manual_optimization_fsdp2_bf16_params_same_policy",
    ],
)
def test_fit_is_bitwise_torch_checkpoint_and_really_uses_tapesac(
    tmp_path, variant, request
) -> None:
    """Losses bitwise torch.utils.checkpoint's on FSDP2 (the same options), both ranks on the
    same plan every step, planned steps beyond must-only replaying fewer nodes, full-
    checkpointing control steps under torch's checkpoint; per variant: the main job as a user
    launches it (dropout, blocks run plain), gradient accumulation with validation under
    bf16-mixed, and manual optimization with FSDP2's bf16 parameter policy (every block
    recorded in both: planned steps save values)."""
    if variant:
        tapesac = fit(tmp_path / "tapesac", *SHORT, *variant)
        torch_ckpt = fit(tmp_path / "torch", *SHORT, *variant, "--baseline", "torch")
    else:  # the main job, as a user launches it; its baseline with both ranks started at once
        # (about 8 s less than through Lightning's launcher, which changes no number)
        _, tapesac = request.getfixturevalue("main_job")
        torch_ckpt = fit(tmp_path / "torch", *SHORT, "--baseline", "torch")
    assert losses(tapesac) == losses(torch_ckpt)
    planned = [s for s in tapesac[0] if s["mode"] == "planned"]
    # Beyond must-only: each planned step saved values or ran blocks plain (not recorded).
    assert planned and all(not s["plan_empty"] for s in planned)
    assert all(s["saved_bytes"] > 0 or s["blocks"] < 4 for s in planned)
    if RECORDED[0] in variant:
        assert all(s["blocks"] == 4 and s["saved_bytes"] > 0 for s in planned)
    else:  # the default: with memory to spare, the plans run blocks plain
        assert any(s["blocks"] < 4 for s in planned)
    must_only = [s["replayed"] for s in tapesac[0] if s["mode"] not in ("planned", "full")]
    assert min(must_only) > 0
    # The plan replays fewer nodes than must-only steps.
    assert max(s["replayed"] for s in planned) < min(must_only)
    # Full-checkpointing control steps ran torch.utils.checkpoint on every block, recording none.
    full = [s for s in tapesac[0] if s["mode"] == "full"]
    assert full and all((s["blocks"], s["torch_checkpointed"]) == (0, 4) for s in full)
    # Both ranks ran the same plan every step.
    assert [s["plan"] for s in tapesac[0]] == [s["plan"] for s in tapesac[1]]


@pytest.mark.slow
@pytest.mark.launch
def test_scalars_read_back_from_tensorboard(tmp_path, main_job) -> None:
    run, (steps, _) = main_job
    (events,) = glob.glob(str(run / "runs" / "tapesac" / "version_0" / "events*"))
    acc = EventAccumulator(events, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    assert {t for t in acc.Tags()["scalars"] if t.startswith("tapesac/")} == set(SCALARS)
    # Block counts and saved bytes as the steps reported them; with memory to spare the plans run
    # blocks plain, and what those keep beyond must-only counts as saved, as explain() says.
    logged = {
        key: [e.value for e in acc.Scalars(f"tapesac/{name}")]
        for key, name in [
            ("saved_bytes", "saved_bytes"),
            ("plain_blocks", "plain_blocks"),
            ("torch_checkpointed", "torch_checkpoint_blocks"),
        ]
    }
    for key, values in logged.items():
        assert values == pytest.approx([s[key] for s in steps], rel=1e-6)  # TensorBoard's float32
    planned = [s for s in steps if s["mode"] == "planned"]
    assert any(s["plain_blocks"] for s in planned) and all(s["saved_bytes"] > 0 for s in planned)
    assert all(s["blocks"] + s["plain_blocks"] + s["torch_checkpointed"] == 4 for s in steps)
    assert acc.Scalars("tapesac/measured_speedup")  # once the plan ran beside must-only steps
    assert acc.Scalars("tapesac/memory_limit_bytes")[0].value == 30 * 2**20
    # On Lightning's own step index, beside the module's train_loss.
    assert (
        [e.step for e in acc.Scalars("tapesac/step_time_ms")]
        == [e.step for e in acc.Scalars("train_loss")]
        == list(range(10))
    )
    assert acc.Tags()["images"] == ["tapesac/frontier"]
    assert "tapesac/plan/text_summary" in acc.Tags()["tensors"]
    # tapesac report reads the same run back: plans, speedups over the run, figures.
    text = report(run / "runs", tmp_path / "report")
    plans = acc.Tensors("tapesac/plan/text_summary")
    assert text.count("plan logged at step") == len(plans) > 0
    measured = [e.value for e in acc.Scalars("tapesac/measured_speedup")]
    assert (
        f"measured speedup vs must-only, as logged each step: median "
        f"{statistics.median(measured):.3f}x"
    ) in text
    assert f"{len(measured)} steps)" in text
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "frontier.png",
        "timeline.png",
    ]


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_resume_reuses_the_stored_plan_and_continues_with_identical_losses(tmp_path, full) -> None:
    common = (
        "--steps",
        "12",
        "--epochs",
        "2",
        "--min-len",
        "96",
        "--max-len",
        "96",
        "--dropout",
        "0.0",
    ) + (("--full-checkpoint",) if full else ())
    whole = fit(tmp_path / "whole", *common, "--checkpoint-dir", str(tmp_path / "ckpt"))
    (first_epoch,) = glob.glob(str(tmp_path / "ckpt" / "epoch=0*"))
    resumed = fit(tmp_path / "resumed", *common, "--resume", first_epoch)
    assert len(resumed[0]) == 6
    assert losses(resumed) == [run[6:] for run in losses(whole)]
    assert [s["mode"] for s in resumed[0]] == ["planned"] * 6  # no warm-up, no profiling
    assert resumed[0][0]["plan"] == whole[0][5]["plan"]
    # tapesac report reads the checkpoint's plan cache.
    text = report(Path(first_epoch), tmp_path / "report")
    assert "(lightning)" in text and Plan.from_json(whole[0][5]["plan"]).explain() in text
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["speedup_by_bucket.png"]


@pytest.mark.slow
@pytest.mark.launch
def test_ranks_with_batches_of_different_lengths_keep_their_plans(tmp_path) -> None:
    # Each rank reads its own batches (64 to 256 tokens per sequence): the ranks agree on the
    # largest count, but each measures its own memory. Their plans must not shrink step by step.
    ranks = fit(
        tmp_path,
        "--steps",
        "40",
        "--min-len",
        "64",
        "--max-len",
        "256",
        "--full-control-every",
        "0",
    )
    assert [s["tokens"] for s in ranks[0]] != [s["tokens"] for s in ranks[1]]
    plans = [Plan.from_json(s["plan"]) for s in ranks[0] if s["mode"] == "planned"]
    assert len(plans) >= 8 and all(not p.empty for p in plans)
    assert min(p.capacity for p in plans) >= 0.9 * max(p.capacity for p in plans)
    peaks = [s["peak"] for r in ranks for s in r if s["peak"] is not None]
    assert max(peaks) <= 30 * 2**20


@pytest.mark.slow
@pytest.mark.launch
def test_a_growing_batch_replans_and_stays_under_the_limit(tmp_path) -> None:
    ranks = fit(
        tmp_path,
        "--steps",
        "16",
        "--min-len",
        "96",
        "--max-len",
        "96",
        "--grow-at",
        "8",
        "--memory-limit",
        "20MiB",
    )
    steps = ranks[0]
    before = Plan.from_json(steps[7]["plan"])
    after = Plan.from_json(steps[-1]["plan"])
    assert steps[7]["mode"] == steps[-1]["mode"] == "planned"
    assert after.coordinates() != before.coordinates()
    assert after.predicted_peak <= after.capacity  # the memory model's peak (peak-aware or Eq. 8)
    peaks = [s["peak"] for r in ranks for s in r if s["peak"] is not None]
    assert peaks and max(peaks) <= 20 * 2**20


@pytest.mark.slow
@pytest.mark.launch
def test_a_hugging_face_model_is_bitwise_fsdp2_with_torch_checkpoint(tmp_path) -> None:
    args = ("--hf", "--steps", "8", "--min-len", "64", "--max-len", "64")
    tapesac = fit(tmp_path / "tapesac", *args, *RECORDED)
    assert losses(tapesac) == losses(fit(tmp_path / "torch", *args, "--baseline", "torch"))
    planned = [s for s in tapesac[0] if s["mode"] == "planned"]
    assert planned and planned[-1]["saved_bytes"] > 0
    assert all(s["blocks"] == 2 for s in tapesac[0] if s["mode"] != "full")  # Qwen3's 2 layers


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(memory_limit=1.5), ValueError, r"must lie in \[0, 1\]"),
        (dict(memory_limit=1024), ValueError, "at least 1 MiB"),
        (dict(memory_limit="a lot"), ValueError, "cannot read memory_limit"),
        (
            dict(activation_checkpointing_policy="DecoderLayer"),
            TypeError,
            "activation_checkpointing_policy must be a set of nn.Module classes",
        ),
        (dict(auto_wrap_policy={int}), TypeError, "auto_wrap_policy must be"),
        (dict(regions=3), TypeError, "regions must map module classes"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_fix(kwargs, error, match) -> None:
    from tapesac_lightning import TapeSACFSDPStrategy

    with pytest.raises(error, match=match):
        TapeSACFSDPStrategy(**kwargs)


def test_the_setup_compat_runs_is_lightnings_less_the_configure_model_check() -> None:
    """``_compat.setup_without_configure_model`` takes ModelParallelStrategy.setup's steps itself
    (the configure_model check left out, the FSDP1 refusal, materialising, the barrier) or through
    Strategy.setup: a step Lightning adds to either must be mirrored there."""
    import ast
    import inspect
    import textwrap

    from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

    def calls(function) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        return {
            n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
        }

    taken_here = {"is_overridden", "TypeError", "any", "isinstance", "modules", "type"}
    taken_here |= {"_materialize_distributed_module", "barrier"}
    assert calls(ModelParallelStrategy.setup) - taken_here <= calls(Strategy.setup)
    # Strategy.setup's model hook is ModelParallelStrategy's own only while it overrides none.
    assert "_setup_model" not in vars(ModelParallelStrategy)


def test_lightnings_configure_model_check_is_left_alone_while_the_strategy_sets_up(
    tmp_path,
) -> None:
    """The strategy skips the check without patching Lightning: while it sets up (the module's
    configure_optimizers runs then), Lightning's is_overridden is its own and still answers that
    this module does not override configure_model."""
    from lightning.pytorch.strategies import model_parallel
    from lightning.pytorch.utilities import model_helpers

    from examples.train_lightning import LitDecoder
    from tapesac_lightning import TapeSACFSDPStrategy

    seen = []

    class Checks(LitDecoder):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            seen.append(model_parallel.is_overridden is model_helpers.is_overridden)
            seen.append(model_parallel.is_overridden("configure_model", self))
            return super().configure_optimizers()

    strategy = TapeSACFSDPStrategy("64MiB", **SHORT_SCHEDULE)
    _fit_tiny(tmp_path, Checks, strategy, batches=2, max_steps=2)
    assert seen == [True, False] and strategy.controller.steps == 2


@pytest.mark.filterwarnings("ignore:Parameter initialization incomplete")
def test_a_module_built_on_the_meta_device_is_materialised_at_setup(tmp_path) -> None:
    """``trainer.init_module(empty_init=True)``: parameters on the meta device, sharded by the
    strategy, then materialised by its setup before the first step."""
    from examples.train_lightning import LitDecoder
    from tapesac_lightning import TapeSACFSDPStrategy

    strategy = TapeSACFSDPStrategy("64MiB", **SHORT_SCHEDULE)
    module = _fit_tiny(tmp_path, LitDecoder, strategy, batches=2, max_steps=2, empty_init=True)
    assert all(p.device.type == "cpu" for p in module.parameters())
    assert strategy.controller.steps == 2


def test_a_policy_matching_no_module_fails_at_setup(tmp_path) -> None:
    import lightning.pytorch as pl

    from examples.models import ModelConfig
    from examples.train_lightning import LitDecoder
    from tapesac_lightning import TapeSACFSDPStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        strategy=TapeSACFSDPStrategy(activation_checkpointing_policy={torch.nn.Conv2d}),
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    module = LitDecoder(ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16))
    try:
        with pytest.raises(
            TapeSACError,
            match=r"policy \{Conv2d\} matches no module of LitDecoder\. "
            r"Fix: name its block classes, e\.g\. \{DecoderLayer\}.*"
            r"TapeSACFSDPStrategy\(activation_checkpointing_policy",
        ):
            trainer.fit(module, [torch.zeros(1, 8, dtype=torch.long)])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_model_sharded_in_configure_model_gets_tapesac_only_and_options_apply(tmp_path) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from examples.models import DecoderLayer
    from examples.train_lightning import LitDecoder
    from tapesac_lightning import TapeSACFSDPStrategy

    class SelfSharded(LitDecoder):
        def configure_model(self) -> None:
            for layer in self.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    counted = []

    def tokens(batch):
        counted.append(batch.shape)
        return {"attention_block": batch.numel()}

    strategy = TapeSACFSDPStrategy(
        "64MiB",
        activation_checkpointing_policy={DecoderLayer},
        regions={DecoderLayer: "attention_block"},
        tokens=tokens,
        **SHORT_SCHEDULE,
    )
    module = _fit_tiny(tmp_path, SelfSharded, strategy, batches=5, max_steps=5)
    controller = strategy.controller
    assert controller.regions == ["attention_block"] and len(counted) == 5
    assert controller.report.mode == "planned" and not controller.report.plan.empty
    # The user's sharding stands: the root LightningModule was not sharded again.
    assert not isinstance(module, FSDPModule) and isinstance(module.model, FSDPModule)


def test_a_batch_skipped_by_the_module_discards_its_step_and_training_goes_on(tmp_path) -> None:
    from examples.train_lightning import LitDecoder
    from tapesac_core.blocks.trace_scope import TRACE
    from tapesac_lightning import TapeSACFSDPStrategy

    open_steps = []

    class SkipsOnce(LitDecoder):
        def on_train_batch_start(self, batch, batch_idx: int):
            return -1 if (self.current_epoch, batch_idx) == (0, 2) else None  # ends epoch 0

        def on_train_epoch_end(self) -> None:
            open_steps.append(TRACE.get() is not None)

    strategy = TapeSACFSDPStrategy("64MiB", **SHORT_SCHEDULE)
    _fit_tiny(tmp_path, SkipsOnce, strategy, batches=4, max_epochs=2)
    # 2 batches in epoch 0, 4 in epoch 1; the skipped batch's step left nothing behind.
    assert strategy.controller.steps == 6 and strategy.controller.report.mode == "planned"
    assert open_steps == [False, False]


def _fit_tiny(
    tmp_path, module_class, strategy, batches: int, empty_init: bool = False, **trainer_args
):
    """Fit a 2-layer ``module_class`` in this process (one rank) on ``batches`` random batches;
    ``empty_init``: built under ``trainer.init_module(empty_init=True)`` (on the meta device)."""
    import lightning.pytorch as pl

    from examples.models import ModelConfig

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        strategy=strategy,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_args,
    )
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
        module = module_class(ModelConfig(**(SMALL | dict(num_layers=2))))
    assert all(p.is_meta for p in module.parameters()) == empty_init
    data = torch.utils.data.DataLoader(
        [torch.randint(0, 256, (2, 16)) for _ in range(batches)], batch_size=None
    )
    try:
        trainer.fit(module, data)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return module


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_hugging_face_checkpointing_inside_the_blocks_is_an_error_naming_the_fix(tmp_path) -> None:
    import lightning.pytorch as pl
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from examples.train_lightning import LitHuggingFace
    from tapesac_lightning import TapeSACFSDPStrategy

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config)
    model.gradient_checkpointing_enable()  # Hugging Face's own: torch's checkpoint in each layer
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        strategy=TapeSACFSDPStrategy(activation_checkpointing_policy={Qwen3DecoderLayer}),
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    try:
        with pytest.raises(TapeSACError, match="has Hugging Face activation checkpointing on"):
            data = torch.utils.data.DataLoader([torch.randint(0, 64, (2, 16))], batch_size=None)
            trainer.fit(LitHuggingFace(model), data)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
