"""The callback the strategy installs: one controller step per training batch, logs, checkpoint state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from tapesac_core.metric_names import STATE_KEY

from ._compat import logged_step
from .driver import StepDiscarded, StepDriver
from .tracking import Publisher

if TYPE_CHECKING:
    from tapesac_core import Controller

    from .lightning_strategy import TapeSACFSDPStrategy


class TapeSACCallback(Callback):
    """Brackets each training batch (forward, backward, optimizer step) with ``controller.step``.

    A batch the module skips (``on_train_batch_start`` returning -1, after this hook ran) leaves
    its step open: it is discarded at the next batch, the epoch's end or teardown.
    """

    def __init__(self, strategy: TapeSACFSDPStrategy) -> None:
        self.strategy = strategy
        self._publisher = Publisher()

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY

    def _driver(self) -> StepDriver:
        driver = self.strategy.driver
        assert driver is not None, "TapeSACFSDPStrategy.setup makes the driver before any batch"
        return driver

    def _controller(self) -> Controller:
        controller = self.strategy.controller
        assert controller is not None, "TapeSACFSDPStrategy.setup makes the controller"
        return controller

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._driver().open(batch)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        report = self._driver().close()
        if report is None or trainer.logger is None or not trainer.is_global_zero:
            return
        logger = trainer.logger
        self._publisher.publish(
            self._controller(),
            report,
            logged_step(trainer),
            lambda metrics, step: logger.log_metrics(metrics, step=step),
            getattr(logger, "experiment", None),
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.logger is not None and trainer.is_global_zero:
            self._publisher.finish(
                self._controller(),
                logged_step(trainer),
                getattr(trainer.logger, "experiment", None),
            )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._driver().discard(StepDiscarded("the batch was skipped"))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.strategy.driver is not None:
            self.strategy.driver.discard(StepDiscarded("the batch was skipped"))

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.strategy.driver is not None:
            self.strategy.driver.discard(exception)

    @override
    def state_dict(self) -> dict[str, Any]:
        controller = self.strategy.controller
        return controller.state_dict() if controller is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._controller().load_state_dict(state_dict)
