"""TapeSAC under Hugging Face Accelerate: ``TapeSACAccelerator`` and its ``TapeSACPlugin`` settings.

Settings come from ``tapesac_*`` keys in the accelerate config's ``fsdp_config`` (``tapesac
launch`` takes them out of the YAML and hands them to the workers in ``SETTINGS_ENV``) or from an
explicit ``TapeSACPlugin``; explicit fields win. With settings, ``prepare`` gives the named block
classes TapeSAC (Accelerate's own activation checkpointing is switched off, never stacked) and lets
Accelerate's FSDP2 path shard, save and load. One controller step runs per micro-batch: opened by
the prepared model's first forward with grad enabled, closed after ``backward`` (accumulating
micro-batches) or after the optimizer step that follows it; more forwards before that backward
belong to the step (DPO: chosen and rejected), except one that reaches no backward (a logging
forward, a skipped batch: see ``StepDriver``). Without settings the class is exactly
``accelerate.Accelerator``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend
from typing_extensions import override

from tapesac_core import Controller, TapeSACConfig, TapeSACError, block_config
from tapesac_core.blocks.wrapping import (
    Policy,
    Regions,
    checkpoint_modules,
    op_names,
    region_namer,
    repeated_block_classes,
    repeated_blocks,
)

# use_fsdp_on_cpu is for a plain Accelerator's script too (examples/train_accelerate.py's baselines).
from ._compat import switch_off_fsdp_checkpointing, use_fsdp_on_cpu
from .driver import StepDiscarded, StepDriver, TokenCounter, open_at_forward, tokens_in
from .tracking import Publisher

SETTINGS_ENV = "TAPESAC_ACCELERATE_SETTINGS"
PREFIX = "tapesac_"
_CONFIG_FIELDS = tuple(
    f.name for f in dataclasses.fields(TapeSACConfig) if f.name != "memory_limit"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TapeSACPlugin:
    """TapeSAC's settings for ``TapeSACAccelerator``; a field left ``None`` comes from the YAML.

    ``memory_limit`` as for ``TapeSACConfig`` (default 0.9); ``checkpoint_modules``: block class
    names or classes (default: the config's ``fsdp_transformer_layer_cls_to_wrap``, else modules
    repeated in a ``ModuleList``); ``regions`` names region types; ``tokens`` counts the tokens of
    the model's forward inputs, given as ``(args, kwargs)``; ``deterministic_ops``: custom ops
    (``"namespace::name"``) declared not to draw random numbers (``checkpoint_modules``);
    ``settings``: other ``TapeSACConfig`` fields.
    """

    memory_limit: float | int | str | None = None
    checkpoint_modules: Collection[str | type[torch.nn.Module]] | None = None
    regions: Regions | None = None
    tokens: TokenCounter | None = None
    deterministic_ops: Collection[str] | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_modules, (str, type)):
            object.__setattr__(self, "checkpoint_modules", (self.checkpoint_modules,))
        if self.checkpoint_modules is not None:
            object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules))
        if isinstance(self.deterministic_ops, str):
            object.__setattr__(self, "deterministic_ops", (self.deterministic_ops,))
        if self.deterministic_ops is not None:
            object.__setattr__(self, "deterministic_ops", tuple(op_names(self.deterministic_ops)))
        unknown = sorted(set(self.settings) - set(_CONFIG_FIELDS))
        if unknown:
            raise TapeSACError(
                f"unknown TapeSAC setting {unknown[0]!r}. Fix: use one of "
                f"{', '.join(_CONFIG_FIELDS)}"
            )
        region_namer(self.regions)  # validates
        self.config()  # validates the limit and the settings now, not at the first step

    def config(self) -> TapeSACConfig:
        """The controller's configuration."""
        limit = 0.9 if self.memory_limit is None else self.memory_limit
        return TapeSACConfig(memory_limit=limit, **self.settings)

    def checkpoint(self, model: torch.nn.Module, policy: Policy) -> list[str]:
        """``checkpoint_modules`` on ``model`` with these settings' regions and declared ops."""
        return checkpoint_modules(
            model, policy, self.regions, deterministic_ops=self.deterministic_ops or ()
        )

    def over(self, fallback: TapeSACPlugin | None) -> TapeSACPlugin:
        """These settings, with the fields left unset taken from ``fallback``."""
        if fallback is None:
            return self
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        given["settings"] = {**fallback.settings, **self.settings}
        return dataclasses.replace(fallback, **given)

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> TapeSACPlugin:
        """Settings from accelerate-config keys ``tapesac_<field>`` (prefix optional); errors name
        the key as written in the YAML."""
        fields: dict[str, Any] = {"settings": {}}
        for key, value in keys.items():
            name = key.removeprefix(PREFIX)
            if name in ("memory_limit", "checkpoint_modules", "deterministic_ops"):
                fields[name] = value
            elif name in _CONFIG_FIELDS:
                fields["settings"][name] = value
            else:
                raise TapeSACError(
                    f"unknown key fsdp_config.{PREFIX}{name} in the accelerate config. Fix: use "
                    f"{PREFIX}memory_limit, {PREFIX}checkpoint_modules, {PREFIX}deterministic_ops "
                    f"or {PREFIX}<field> for a "
                    f"TapeSACConfig field ({', '.join(_CONFIG_FIELDS)})"
                )
        try:
            return cls(**fields)
        except (TypeError, ValueError, TapeSACError) as e:
            written = ", ".join(f"{PREFIX}{k.removeprefix(PREFIX)}: {v!r}" for k, v in keys.items())
            raise TapeSACError(
                f"the accelerate config's fsdp_config ({written}) is not valid. Fix: {e}"
            ) from None

    @classmethod
    def from_environment(cls) -> TapeSACPlugin | None:
        """The settings ``tapesac launch`` exported to this worker, if any."""
        text = os.environ.get(SETTINGS_ENV)
        return cls.from_keys(json.loads(text)) if text else None


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An accelerate config (as read from its YAML) without TapeSAC's keys, and those keys."""
    fsdp = dict(config.get("fsdp_config") or {})
    ours = {k: fsdp.pop(k) for k in list(fsdp) if k.startswith(PREFIX)}
    rest = dict(config)
    if "fsdp_config" in config:
        rest["fsdp_config"] = fsdp
    return rest, ours


def check_fsdp2(config: Mapping[str, Any]) -> None:
    """TapeSAC under Accelerate runs on FSDP2; any other distributed type is an error naming the fix."""
    fsdp = config.get("fsdp_config") or {}
    if config.get("distributed_type") != "FSDP" or str(fsdp.get("fsdp_version", 1)) != "2":
        raise TapeSACError(
            f"TapeSAC under Accelerate needs FSDP2, the accelerate config has distributed_type: "
            f"{config.get('distributed_type')} and fsdp_config.fsdp_version: "
            f"{fsdp.get('fsdp_version', 1)}. Fix: set distributed_type: FSDP and "
            "fsdp_config.fsdp_version: 2 (or remove the tapesac_* keys)"
        )


def named_blocks(
    model: torch.nn.Module, names: Collection[str | type[torch.nn.Module]], key: str
) -> Callable[[torch.nn.Module], bool]:
    """Selects the modules of the classes ``names``; a class ``model`` lacks is an error naming
    the setting ``key`` the names came from."""
    wanted = {n if isinstance(n, str) else n.__name__ for n in names}
    missing = sorted(wanted - {type(m).__name__ for m in model.modules()})
    if missing:
        raise TapeSACError(
            f"{key} names {missing[0]!r}, a class {type(model).__name__} does not contain. "
            f"Fix: name its block classes, e.g. {', '.join(repeated_block_classes(model)) or '...'}"
        )
    return lambda m: type(m).__name__ in wanted


class TapeSACAccelerator(Accelerator):
    """``accelerate.Accelerator`` with TapeSAC planned under a memory limit on the FSDP2 blocks.

    Settings: ``tapesac_plugin`` over the ``tapesac_*`` keys of the accelerate config (see
    ``TapeSACPlugin``); with neither, this is exactly ``Accelerator``. ``tapesac_controller`` is
    the controller once ``prepare`` has seen the model; its plan cache is saved and restored by
    ``save_state`` / ``load_state``.
    """

    def __init__(
        self, *args: Any, tapesac_plugin: TapeSACPlugin | None = None, **kwargs: Any
    ) -> None:
        plugin = (
            tapesac_plugin.over(TapeSACPlugin.from_environment())
            if tapesac_plugin
            else TapeSACPlugin.from_environment()
        )
        super().__init__(*args, **kwargs)
        self.tapesac_plugin = plugin
        self.tapesac_controller: Controller | None = None
        self._driver: StepDriver | None = None
        self._publisher = Publisher()
        if plugin is None:
            return
        use_fsdp_on_cpu(self, kwargs.get("fsdp_plugin"))
        if not self.is_fsdp2:
            raise TapeSACError(
                f"TapeSAC under Accelerate needs FSDP2, this run is {self.distributed_type.value}"
                f"{'' if self.state.fsdp_plugin is None else ' version 1'}. Fix: in the accelerate "
                "config set distributed_type: FSDP and fsdp_config.fsdp_version: 2, and start "
                "with `tapesac launch` (or remove the tapesac_* keys)"
            )
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise TapeSACError(
                f"TapeSAC under Accelerate does not run with dynamo_backend "
                f"{self.state.dynamo_plugin.backend.value} yet. Fix: set dynamo_backend: 'NO' in "
                "the accelerate config (or remove the tapesac_* keys)"
            )

    @override
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        plugin = self.tapesac_plugin
        if plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        for model in models:
            self._checkpoint_blocks(model, plugin)
        # TapeSAC replaces Accelerate's checkpoint wrapper: the two are never stacked.
        switch_off_fsdp_checkpointing(self.state.fsdp_plugin)
        prepared = super().prepare(*args, device_placement=device_placement)
        results = prepared if isinstance(prepared, (tuple, list)) else (prepared,)
        for model in (r for r in results if isinstance(r, torch.nn.Module)):
            self._drive(model, plugin)
        for optimizer in (r for r in results if isinstance(r, AcceleratedOptimizer)):
            optimizer.optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
        return prepared

    def _checkpoint_blocks(self, model: torch.nn.Module, plugin: TapeSACPlugin) -> None:
        """TapeSAC on the configured block classes, before FSDP2 shards them."""
        if any(block_config(m) for m in model.modules()):
            return
        names, key = plugin.checkpoint_modules, "tapesac_checkpoint_modules"
        if names is None:
            names = self.state.fsdp_plugin.transformer_cls_names_to_wrap
            key = "fsdp_transformer_layer_cls_to_wrap"
        policy = named_blocks(model, names, key) if names else repeated_blocks(model)
        plugin.checkpoint(model, policy)

    def _drive(self, model: torch.nn.Module, plugin: TapeSACPlugin) -> None:
        """A controller for the prepared model, its steps driven by hooks that survive ``prepare``."""
        controller = Controller(model, config=plugin.config(), device=self.device)
        driver = StepDriver(controller, plugin.tokens or tokens_in)
        self.tapesac_controller, self._driver = controller, driver
        open_at_forward(model, driver, self._finish_step)
        self.register_for_checkpointing(controller)

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        if self._driver is None or not self._driver.is_open:
            return
        self._driver.backward_done = True
        if not self.sync_gradients:
            self._finish_step()  # accumulating: no optimizer step belongs to this micro-batch

    def _after_optimizer_step(self) -> None:
        if self._driver is not None and self._driver.backward_done:
            self._finish_step()

    def _finish_step(self) -> None:
        controller, driver = self.tapesac_controller, self._driver
        assert controller is not None and driver is not None  # _drive made them before any step
        report = driver.close()
        if report is None or not self.is_main_process:
            return
        self._publisher.publish(
            controller,
            report,
            report.step,
            lambda metrics, step: self.log(metrics, step=step),
            self._tensorboard(),
        )

    @override
    def end_training(self) -> None:
        if self._driver is not None and self._driver.backward_done:
            self._finish_step()
        elif self._driver is not None:
            self._driver.discard(StepDiscarded("training ended before its backward"))
        if self.tapesac_controller is not None and self.is_main_process:
            self._publisher.finish(
                self.tapesac_controller, self.tapesac_controller.steps, self._tensorboard()
            )
        super().end_training()

    def _tensorboard(self) -> Any:
        """The TensorBoard tracker's writer, if the run logs to TensorBoard."""
        return next((t.writer for t in self.trackers if t.name == "tensorboard"), None)
