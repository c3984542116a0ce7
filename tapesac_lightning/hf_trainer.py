"""TapeSAC under Hugging Face's ``Trainer`` and the trainers built on it (TRL's ``SFTTrainer``).

``Trainer`` builds its own ``Accelerator``; the way in is a callback. ``on_init_end``, the last
event before Accelerate prepares the model, gives the decoder layers TapeSAC and switches the
Trainer's own activation checkpointing off (never two wrappers on a layer). One controller step
runs per micro-batch: opened by the model's first forward with grad enabled (no event carries the
inputs), closed at ``on_substep_end`` (accumulating) or ``on_optimizer_step``. The plan cache
travels in ``trainer_state.json`` of each ``checkpoint-N`` folder and comes back with
``resume_from_checkpoint``, wherever that folder lies.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tapesac_core import Controller, TapeSACError, block_config
from tapesac_core.blocks.wrapping import (
    Policy,
    Regions,
    module_selector,
    repeated_blocks,
)
from tapesac_core.metric_names import STATE_KEY

from ._compat import (
    add_to_latest_log,
    current_fsdp_plugin,
    no_split_modules,
    stateful_callbacks,
    switch_off_fsdp_checkpointing,
    switch_off_model_checkpointing,
    switch_off_trainer_checkpointing,
    tensorboard_logging_dir,
)
from .accelerate import TapeSACPlugin, named_blocks
from .driver import StepDiscarded, StepDriver, TokenCounter, open_at_forward, tokens_in
from .tracking import Publisher, step_metrics

logger = logging.getLogger(__name__)


class TapeSACTrainerCallback(TrainerCallback):
    """TapeSAC planned under ``memory_limit`` on the model's decoder layers, for ``Trainer``.

    ``memory_limit``: a fraction of device memory (of physical memory on CPU), a size such as
    ``"20GiB"`` or an int of bytes; default 0.9, or the accelerate config's
    ``tapesac_memory_limit`` under ``tapesac launch`` (explicit arguments win over the YAML's
    ``tapesac_*`` keys). ``activation_checkpointing_policy``: a set of block classes or a
    ``Module -> bool`` callable (default: the YAML's ``tapesac_checkpoint_modules``, else the
    model's ``_no_split_modules`` classes, else modules repeated in a ``ModuleList``).
    ``regions`` names region types, ``tokens`` counts the tokens of the model's forward inputs
    ``(args, kwargs)``, ``deterministic_ops`` declares custom ops that draw no random numbers
    (``checkpoint_modules``); further keywords are ``TapeSACConfig``'s. ``controller`` is the
    controller once training began.
    """

    def __init__(
        self,
        memory_limit: float | int | str | None = None,
        *,
        activation_checkpointing_policy: Policy | None = None,
        regions: Regions | None = None,
        tokens: TokenCounter | None = None,
        deterministic_ops: Collection[str] | None = None,
        **settings: Any,
    ) -> None:
        if activation_checkpointing_policy is not None:  # validated now, applied at on_init_end
            module_selector(activation_checkpointing_policy, "activation_checkpointing_policy")
        self._policy = activation_checkpointing_policy
        given = TapeSACPlugin(
            memory_limit=memory_limit,
            regions=regions,
            tokens=tokens,
            deterministic_ops=deterministic_ops,
            settings=settings,
        )
        self.plugin = given.over(TapeSACPlugin.from_environment())
        self.controller: Controller | None = None
        self._model: torch.nn.Module | None = None  # the controller's
        self._driver: StepDriver | None = None
        self._hook: Any = None
        self._state: TrainerState | None = None
        self._publisher = Publisher()
        self._writer: Any = None
        self._latest: dict[str, float] = {}

    def model_init(self, init: Callable[..., Any]) -> Callable[..., Any]:
        """``init`` (a Trainer's ``model_init``) giving TapeSAC to each model it builds:
        ``Trainer(model_init=callback.model_init(init), callbacks=[callback])``."""

        @functools.wraps(init)  # same signature: Trainer counts its arguments
        def build(*args: Any) -> torch.nn.Module:
            model = init(*args)
            switch_off_model_checkpointing(model)
            self._checkpoint(model)
            return model

        return build

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        switched = _switch_off_checkpointing(args)
        if model is not None and switch_off_model_checkpointing(model):
            switched.append(f"{type(model).__name__}'s own (on before the Trainer)")
        if switched and state.is_world_process_zero:
            logger.info(
                "TapeSAC replaces the Trainer's activation checkpointing: switched off %s",
                ", ".join(switched),
            )
        if model is not None:
            self._checkpoint(model)

    def _checkpoint(self, model: torch.nn.Module) -> None:
        """TapeSAC on the selected blocks (once), before Accelerate prepares the model."""
        if any(block_config(m) for m in model.modules()):
            return
        policy, source = self._select(model)
        try:
            self.plugin.checkpoint(model, policy)
        except TapeSACError as e:
            raise TapeSACError(f"{e}. The blocks came from {source}") from None

    def _select(self, model: torch.nn.Module) -> tuple[Policy, str]:
        """The block policy and where it came from, for messages."""
        if self._policy is not None:
            return self._policy, "TapeSACTrainerCallback(activation_checkpointing_policy=...)"
        names = self.plugin.checkpoint_modules
        if names:
            key = "tapesac_checkpoint_modules"
            return named_blocks(model, names, key), f"the accelerate config's {key}"
        no_split = no_split_modules(model)
        if no_split:
            return (lambda m: type(m).__name__ in no_split), "its _no_split_modules"
        return repeated_blocks(model), "modules repeated in a ModuleList"

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        assert model is not None  # the Trainer passes its model to every event
        if not any(block_config(m) for m in model.modules()):
            raise TapeSACError(
                f"the Trainer's model {type(model).__name__} has no TapeSAC block: train() "
                "rebuilt it with model_init after on_init_end, and no event comes before "
                "Accelerate prepares it. Fix: Trainer(model_init=callback.model_init(model_init), "
                "callbacks=[callback])"
            )
        if model is not self._model:  # a new model (model_init, a hyperparameter trial)
            self._model = model
            self.controller = Controller(model, config=self.plugin.config(), device=args.device)
            self._driver = StepDriver(self.controller, self.plugin.tokens or tokens_in)
        controller, driver = self.controller, self._driver
        assert controller is not None and driver is not None  # made for self._model
        self._discard("a new train() began before it finished")
        saved = stateful_callbacks(state).get(STATE_KEY)
        if saved:  # resume_from_checkpoint: the trainer_state.json it loaded holds the plans
            controller.load_state_dict(saved)
        self._hook = open_at_forward(model, driver, self._close)
        self._state = state
        if state.is_world_process_zero and "tensorboard" in (args.report_to or ()):
            self._writer = _summary_writer(args)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._discard("its micro-batch raised or was skipped")

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()

    def _close(self) -> None:
        """Finish the open step; rank 0 publishes it at the Trainer's step index."""
        controller, driver, state = self.controller, self._driver, self._state
        assert controller is not None and driver is not None and state is not None  # train began
        report = driver.close()
        if report is None or not state.is_world_process_zero:
            return
        self._latest = step_metrics(report)
        self._publisher.publish(
            controller, report, state.global_step, self._add_scalars, self._writer
        )

    def _add_scalars(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step)

    def _discard(self, why: str) -> None:
        if self._driver is not None:
            self._driver.discard(StepDiscarded(why))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        # The scalars of the latest step beside the training loss, in log_history too.
        if logs is not None and "loss" in logs and self._latest:
            add_to_latest_log(state, logs, self._latest)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._keep_state(args, state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._discard("its micro-batch raised or was skipped")
        self._keep_state(args, state, control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._keep_state(args, state, control)

    def _keep_state(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> None:
        """The plan cache into the TrainerState the coming checkpoint's trainer_state.json
        holds (a save follows this event, or may, after evaluation with save_strategy best)."""
        if self.controller is not None and (control.should_save or args.save_strategy == "best"):
            stateful_callbacks(state)[STATE_KEY] = self.controller.state_dict()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._discard("training ended before its micro-batch finished")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._writer is not None and self.controller is not None:
            self._publisher.finish(self.controller, state.global_step, self._writer)
            self._writer.close()
            self._writer = None


def _switch_off_checkpointing(args: TrainingArguments) -> list[str]:
    """The Trainer's own activation checkpointing off before train() would turn it on: its
    argument, and fsdp_config's (Accelerate's checkpoint wrapper); what was on."""
    switched = switch_off_trainer_checkpointing(args)
    if switch_off_fsdp_checkpointing(current_fsdp_plugin()):
        switched.append("fsdp_config's activation_checkpointing")
    return switched


def _summary_writer(args: TrainingArguments) -> Any:
    """A TensorBoard writer beside the Trainer's: its logging dir where one is set, else
    ``<output_dir>/runs/tapesac``."""
    from torch.utils.tensorboard import SummaryWriter

    assert args.output_dir is not None  # TrainingArguments.__post_init__ fills it in
    log_dir = tensorboard_logging_dir(args)
    return SummaryWriter(log_dir or os.path.join(args.output_dir, "runs", "tapesac"))
