"""The callback the strategy installs: one controller step per training batch, logs, checkpoint state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .logging import log_plan, log_step

if TYPE_CHECKING:
    from .strategy import TapeSACFSDPStrategy


class _BatchSkipped(Exception):
    """Ends the step of a batch Lightning skipped (the module's ``on_train_batch_start`` returned
    -1, after this callback's hook ran): the step is discarded, as after an exception."""


class TapeSACCallback(Callback):
    """Brackets each training batch (forward, backward, optimizer step) with ``controller.step``."""

    def __init__(self, strategy: TapeSACFSDPStrategy) -> None:
        self.strategy = strategy
        self._step: Any = None
        self._logged_plans: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        return "TapeSAC"

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._close(_BatchSkipped())
        controller = self.strategy.controller
        self._step = controller.step(tokens=self.strategy.count_tokens(batch))
        self._step.__enter__()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._close(None)
        controller = self.strategy.controller
        report = controller.report
        if trainer.logger is None or not trainer.is_global_zero:
            return
        log_step(trainer.logger, report, trainer.global_step)
        if report.plan is not None and report.plan.to_json() not in self._logged_plans:
            self._logged_plans.add(report.plan.to_json())
            log_plan(trainer.logger, controller, report, trainer.global_step)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(_BatchSkipped())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(_BatchSkipped())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exception: BaseException | None) -> None:
        step, self._step = self._step, None
        if step is not None:
            if exception is None:
                step.__exit__(None, None, None)
            else:
                step.__exit__(type(exception), exception, exception.__traceback__)

    @override
    def state_dict(self) -> dict[str, Any]:
        controller = self.strategy.controller
        return controller.state_dict() if controller is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.strategy.controller.load_state_dict(state_dict)
