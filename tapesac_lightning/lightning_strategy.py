"""TapeSACFSDPStrategy: FSDP2 sharding plus TapeSAC on the transformer blocks, from one memory limit."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from tapesac_core import Controller, TapeSACConfig, TapeSACError, block_config
from tapesac_core.blocks.wrapping import (
    Policy,
    Regions,
    checkpoint_modules,
    module_selector,
    op_names,
    region_namer,
    repeated_blocks,
)

from ._compat import data_parallel_over_every_process, setup_without_configure_model
from .driver import StepDriver, TokenCounter, tokens_in
from .lightning_callback import TapeSACCallback

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class TapeSACFSDPStrategy(ModelParallelStrategy):
    """FSDP2 with TapeSAC activation checkpointing planned under ``memory_limit``.

    The strategy checkpoints the blocks ``activation_checkpointing_policy`` selects (a set of
    module classes or a ``Module -> bool`` callable; by default every module that sits in a
    ``ModuleList`` beside others of its class), then applies ``fully_shard`` to each block (or to
    what ``auto_wrap_policy`` selects) and to the LightningModule, whose step methods it
    registers with FSDP. A model the user already sharded in ``configure_model`` only gets
    TapeSAC. The first fit steps warm up and profile; later steps run the plan for their token
    bucket. ``memory_limit``: a fraction of device memory (of physical memory on CPU), a size
    such as ``"20GiB"``, or an int of bytes. ``regions`` names region types (class -> name, or
    a callable); ``tokens`` counts a batch's tokens; ``deterministic_ops`` declares custom ops
    (``"namespace::name"``) that draw no random numbers (``checkpoint_modules``). ``mp_policy`` (FSDP2's
    ``MixedPrecisionPolicy``), ``reshard_after_forward`` and ``offload_policy`` go to every
    ``fully_shard`` call the strategy makes (Lightning's ``ModelParallelStrategy`` takes none of
    them). Further keywords are ``TapeSACConfig``'s.
    """

    def __init__(
        self,
        memory_limit: float | int | str = 0.9,
        *,
        activation_checkpointing_policy: Policy | None = None,
        auto_wrap_policy: Policy | None = None,
        regions: Regions | None = None,
        tokens: TokenCounter | None = None,
        deterministic_ops: Iterable[str] = (),
        data_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        mp_policy: Any = None,
        reshard_after_forward: bool | int | None = None,
        offload_policy: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tapesac_config = TapeSACConfig(memory_limit=memory_limit, **settings)
        if activation_checkpointing_policy is not None:  # validated now, applied at setup
            module_selector(activation_checkpointing_policy, "activation_checkpointing_policy")
        self._policy = activation_checkpointing_policy
        self._shard = (
            module_selector(auto_wrap_policy, "auto_wrap_policy")
            if auto_wrap_policy is not None
            else None
        )
        region_namer(regions)  # validates
        self._regions = regions
        self._tokens = tokens or tokens_in
        self._deterministic_ops = op_names(deterministic_ops)  # validated now, applied at setup
        # Only the options given: fully_shard's own defaults stay in charge of the others.
        self._fsdp_options: dict[str, Any] = {
            k: v
            for k, v in (
                ("mp_policy", mp_policy),
                ("reshard_after_forward", reshard_after_forward),
                ("offload_policy", offload_policy),
            )
            if v is not None
        }
        self.controller: Controller | None = None
        self.driver: StepDriver | None = None

    @override
    def setup_environment(self) -> None:
        data_parallel_over_every_process(self)  # tensor parallel size 1: every process shards data
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        self._apply(module)
        # ModelParallelStrategy.setup, less its demand that the module parallelise itself in
        # configure_model: this strategy did it above.
        setup_without_configure_model(self, trainer)
        self.controller = Controller(module, config=self.tapesac_config, device=self.root_device)
        self.driver = StepDriver(self.controller, self._tokens)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, not declared on Trainer
        if not any(isinstance(c, TapeSACCallback) for c in callbacks):
            # First, so the step is closed (and its report ready) before other callbacks run.
            callbacks.insert(0, TapeSACCallback(self))

    def _apply(self, module: pl.LightningModule) -> None:
        """TapeSAC on the selected blocks, then FSDP2 around them (checkpointing inside sharding)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        if not any(block_config(m) for m in module.modules()):
            try:
                checkpoint_modules(
                    module,
                    self._policy or repeated_blocks(module),
                    self._regions,
                    deterministic_ops=self._deterministic_ops,
                )
            except TapeSACError as e:
                raise TapeSACError(
                    f"{e}. The policy came from TapeSACFSDPStrategy("
                    "activation_checkpointing_policy=...)"
                ) from None
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # sharded in configure_model: TapeSAC only
        mesh = self.device_mesh["data_parallel"]
        shard = self._shard or (lambda m: block_config(m) is not None)
        for _, sub in reversed(list(module.named_modules())):
            if sub is not module and shard(sub):
                fully_shard(sub, mesh=mesh, **self._fsdp_options)
        fully_shard(module, mesh=mesh, **self._fsdp_options)
        for name in STEP_METHODS:
            if callable(getattr(module, name, None)):
                register_fsdp_forward_method(module, name)
