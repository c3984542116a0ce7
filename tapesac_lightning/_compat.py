"""Every workaround the integrations need in Lightning, Accelerate and transformers, in one place.

Each is a small function saying what it works around and on which versions it was checked;
``CHECKED`` lists those versions per library, and ``pyproject.toml`` bounds each library below
the next minor release until the integration's tests have passed there
(``tests/test_integration_compat.py`` keeps the bounds, ``CHECKED`` and the modules in step:
no other module of the package reaches a private name of these libraries). A library that
renames or drops something breaks here, and only here.

Nothing here imports a library at module level: each integration imports its own library when
first used, so a function imports what it needs when called.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers import TrainerState, TrainingArguments

# The minor versions the integrations' tests passed on, lowest and highest, per library.
CHECKED: dict[str, tuple[str, ...]] = {
    "lightning": ("2.6",),
    "accelerate": ("1.15", "1.16"),
    "transformers": ("5.17", "5.25"),
}

__all__ = [
    "CHECKED",
    "add_to_latest_log",
    "current_fsdp_plugin",
    "data_parallel_over_every_process",
    "logged_step",
    "mark_cpu_workers",
    "no_split_modules",
    "setup_without_configure_model",
    "stateful_callbacks",
    "switch_off_fsdp_checkpointing",
    "switch_off_model_checkpointing",
    "switch_off_trainer_checkpointing",
    "tensorboard_logging_dir",
    "use_config_file",
    "use_fsdp_on_cpu",
]


# ------------------------------------------------------------------------------------ Lightning


def setup_without_configure_model(strategy: ModelParallelStrategy, trainer: pl.Trainer) -> None:
    """``ModelParallelStrategy.setup`` less its check that the LightningModule overrides
    ``configure_model``, for a strategy that parallelises the model itself.

    Works around that check, which raises a TypeError for a module that leaves its
    parallelisation to the strategy; Lightning has no argument or hook to skip it, and it sits
    inside the ``setup`` that also does the rest of the model's setup. So this runs that rest
    without the check, through supported calls: the FSDP1 refusal, materialising a model built
    on the meta device (Lightning's own helper, a private function), then the base
    ``Strategy.setup`` (accelerator, precision plugin's module conversion, model to device,
    optimizers and their device, as ``ModelParallelStrategy.setup`` calls them, its own
    ``setup_optimizers`` included) and the barrier. It patches nothing: Lightning's
    ``is_overridden`` keeps answering for every module, this one too. ``tests/test_lightning.py``
    fails when ``ModelParallelStrategy.setup`` calls anything this does not mirror.
    Checked on Lightning 2.6 (2.6.6)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    assert strategy.model is not None
    if any(isinstance(m, FullyShardedDataParallel) for m in strategy.model.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`."
            f" The `{type(strategy).__name__}` only supports the new FSDP2 APIs (fully_shard)."
        )
    _materialize_distributed_module(strategy.model, strategy.root_device)
    Strategy.setup(strategy, trainer)
    strategy.barrier()


def data_parallel_over_every_process(strategy: ModelParallelStrategy) -> None:
    """Every process shards data: ``data_parallel_size="auto"`` resolved to the world size.

    Works around ``ModelParallelStrategy`` reading ``"auto"`` as the number of nodes (it fills
    each node with tensor parallelism); with a tensor parallel size of 1 the mesh's sizes then
    miss the world size and ``setup_environment`` raises. Its constructor is the only public way to set the size, and the world size
    is known only once the Trainer has set the cluster environment, so the size is written into
    the private attribute its ``setup_environment`` reads. Call before that method.
    Checked on Lightning 2.6 (2.6.6)."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.world_size  # 1 without a cluster environment


def logged_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs ``self.log`` metrics of this batch at: the optimizer steps
    completed before it (``global_step`` is one ahead after an optimizer step).

    Works around Lightning keeping that count only in a private attribute of its epoch loop
    (its own callbacks read it there: ``LearningRateMonitor``, ``DeviceStatsMonitor``).
    Checked on Lightning 2.6 (2.6.6)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# ----------------------------------------------------------------------------------- Accelerate


def use_fsdp_on_cpu(
    accelerator: Accelerator, fsdp_plugin: FullyShardedDataParallelPlugin | None = None
) -> None:
    """Accelerate's FSDP path on a multi-process CPU run whose config asks for FSDP.

    Works around ``AcceleratorState`` leaving such a run ``MULTI_CPU`` (it turns only accelerator
    device types into FSDP, and takes no setting to do otherwise): installs the FSDP plugin as it
    would, so Accelerate's own FSDP2 path (prepare, save_state, load_state) runs, and rewrites
    the distributed type of the state and of ``PartialState``'s shared state (which later
    ``AcceleratorState()`` calls copy, as at the end of its ``__init__``). Call right after
    constructing the ``Accelerator``. Checked on Accelerate 1.15 and 1.16."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or fsdp_plugin
    if state.distributed_type != DistributedType.MULTI_CPU or not wants_fsdp:
        return
    plugin = fsdp_plugin or FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState().distributed_type = DistributedType.FSDP


def current_fsdp_plugin() -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin of the Accelerator built in this process, if it runs FSDP.

    Works around ``AcceleratorState`` being a process-wide singleton that a Trainer builds out of
    reach (no event hands over its Accelerator before ``prepare``), and lacking the attribute
    altogether when it runs no FSDP. Checked on Accelerate 1.15 and 1.16."""
    from accelerate.state import AcceleratorState, is_initialized

    return getattr(AcceleratorState(), "fsdp_plugin", None) if is_initialized() else None


def switch_off_fsdp_checkpointing(plugin: FullyShardedDataParallelPlugin | None) -> bool:
    """Accelerate's activation checkpointing wrapper off on ``plugin`` (TapeSAC replaces it: the
    two are never stacked); whether it was on.

    Works around the setting being read from the plugin the state holds when ``prepare`` runs,
    with no argument of ``prepare`` to override it: the plugin is changed in place before.
    Checked on Accelerate 1.15 and 1.16."""
    if plugin is None or not plugin.activation_checkpointing:
        return False
    plugin.activation_checkpointing = False
    return True


def use_config_file(args: argparse.Namespace, path: str) -> None:
    """The arguments ``args`` Accelerate's launch parser read, pointed at the config file
    ``path`` as if the command line had named it.

    Works around ``launch_command`` copying the config's sections (``fsdp_config`` and the
    others) into the arguments only when the namespace holds the ``nondefault`` set its parser's
    actions make on the first option given, and only for keys not in it: the config file is
    recorded there as given, which also makes the set when the command line gave no option.
    Checked on Accelerate 1.15 and 1.16."""
    args.config_file = path
    args.nondefault = getattr(args, "nondefault", set()) | {"config_file"}


def mark_cpu_workers() -> None:
    """The workers of the coming launch told that they run on CPU (the config's ``use_cpu``).

    Works around Accelerate's multi-process launcher not telling CPU workers they are CPU
    workers: without ``ACCELERATE_USE_CPU`` in the environment each comes up as a single
    non-distributed process. Checked on Accelerate 1.15 and 1.16."""
    os.environ["ACCELERATE_USE_CPU"] = "true"


# --------------------------------------------------------------------------------- transformers


def switch_off_trainer_checkpointing(args: TrainingArguments) -> list[str]:
    """The Trainer's own activation checkpointing off, before ``train()`` turns it on: the
    argument under both its names; what was on (as the names, for a message).

    Works around the Trainer having no way for a callback to take over checkpointing: its
    arguments are changed in place after ``__init__``, where ``train()`` reads them.
    ``gradient_checkpointing`` is ``activation_checkpointing``'s deprecated alias since
    transformers 5.2x and the only name before; TRL's ``SFTConfig`` turns it on by default and
    still reads it. Checked on transformers 5.17 and 5.25 (TRL 1.16)."""
    names = [n for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(args, n)]
    on = [n for n in names if getattr(args, n)]
    for name in names:
        setattr(args, name, False)
    return [f"{' / '.join(on)}=True"] if on else []


def switch_off_model_checkpointing(model: torch.nn.Module) -> bool:
    """Hugging Face's layer flag off (torch's checkpoint would run inside the TapeSAC block), on
    a model the user or a PEFT flow already checkpointed; whether it was on.

    Works around the flag living on each layer (``gradient_checkpointing``), switched by
    ``activation_checkpointing_disable``, or ``gradient_checkpointing_disable`` before
    transformers 5.2x. Checked on transformers 5.17 and 5.25."""
    if not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or getattr(model, "gradient_checkpointing_disable"))()
    return True


def no_split_modules(model: torch.nn.Module) -> set[str]:
    """The block class names a Hugging Face model declares (what ``device_map`` and FSDP's
    auto-wrap read): the default blocks, those ``model`` contains.

    Works around transformers keeping them only in the private class attribute
    ``_no_split_modules`` (a set, a list or None). Checked on transformers 5.17 and 5.25."""
    present = {type(m).__name__ for m in model.modules()}
    return set(getattr(model, "_no_split_modules", None) or ()) & present


def add_to_latest_log(
    state: TrainerState, logs: dict[str, float] | None, metrics: dict[str, float]
) -> None:
    """``metrics`` added to the entry an ``on_log`` event carries, where the Trainer shows it.

    Works around the event coming after the Trainer copied ``logs`` into ``state.log_history``
    and after the reporting callbacks (added before a user's) saw it: the entry is updated in
    both. Checked on transformers 5.17 and 5.25."""
    if logs is None:
        return
    logs.update(metrics)
    if state.log_history:
        state.log_history[-1].update(metrics)


def stateful_callbacks(state: TrainerState) -> dict[str, Any]:
    """The callbacks' saved states by name, which ``trainer_state.json`` carries.

    Works around transformers annotating the field as a list of callbacks, which
    ``TrainerState.__post_init__`` turns into this dict. Checked on transformers 5.17 and 5.25."""
    return cast("dict[str, Any]", state.stateful_callbacks)


def tensorboard_logging_dir(args: TrainingArguments) -> str | None:
    """Where the Trainer's TensorBoard writer logs, if set: the environment's
    ``TENSORBOARD_LOGGING_DIR``, else the ``logging_dir`` argument.

    Works around transformers 5.2x dropping the ``logging_dir`` argument for the environment
    variable. Checked on transformers 5.17 and 5.25."""
    return os.getenv("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None)
