"""Running one block: ``checkpoint`` records it, or runs it from its cached tape (steady state).

Contract, as for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the block's forward
runs once, normally; autograd's saved tensors are replaced by value ids except the mandatory set
S0 and the values the active plan saves; backward replays, on demand, only the producers of the
values it unpacks. Loss and gradients are bitwise those of running without checkpointing.

When grad is disabled a block runs plainly. In eval mode with grad enabled it is still
checkpointed. Raises ``TapeSACError`` for a block nested in another (at wrap time when a module is
wrapped inside or around a wrapped one, else at its forward), a block run during a backward
pass (reentrant checkpointing), ``torch.utils.checkpoint`` around a block or inside one (Hugging
Face's ``gradient_checkpointing`` flag on a block; a wrapper on a submodule or saved-tensor hooks
pushed inside, checked as each submodule is entered in a recorded call; a reentrant checkpoint,
seen in the graph a recorded call made), ``fully_shard`` on a
module inside a block (at wrap time or at its forward), and in-place writes into block inputs,
parameters or buffers. Double backward (``create_graph=True``) works: autograd attaches each
saved tensor's forward history to the value the unpack hook returns, which replay computes
without recording a graph of its own.

Under ``torch.compile`` the blocks are excluded from tracing (``torch.compiler.disable`` at the
block boundary, one info log): each block is one graph break and runs eagerly with record and
replay, the code between blocks compiles, and nothing of a block is guarded, so blocks cause no
recompilation. As for any disabled call, Dynamo runs eagerly a whole frame that calls a block
inside a loop: compile the modules around the blocks then.
"""

from __future__ import annotations

import functools
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import noop_context_fn

from .._compat import any_autocast_enabled, graph_task_id
from ..errors import TapeSACError
from ..plan.plan import BlockKind
from ..tape.block import Block, BlockPlan
from ..tape.call_checks import CallLog
from ..tape.data_sizes import DataBinding, DataTemplate
from ..tape.offload import alone_bytes
from ..tape.recompute import Recompute, leaves_of, never_unpacked
from ..tape.recorder import Recorder
from ..tape.rerun_checks import rerun_check
from ..tape.signature import Signature, block_signature, call_arguments
from ..tape.steady import Recorded, SteadyForward, SteadyTape, autograd_nodes, steady_tape
from ..tape.steady_cache import SteadyCache, steady_cache
from ..tape.structure_switch import Switch, ran_alike
from ..tape.tape import INPUT, PARAM, Tape
from ..tape.verify import HiddenWrites
from ..tensors import tensor_leaves
from .block_settings import BlockConfig, block_config
from .hf_cache import without_hf_cache
from .plan_scope import PLAN
from .refusals import (
    hf_layer_forward,
    refuse_hf_checkpointing,
    refuse_outer_torch_checkpoint,
    refuse_reentrant_checkpoint_inside,
    refuse_sharded_inside,
)
from .submodule_hooks import submodules_tracked
from .torch_keywords import TorchKeywords
from .trace_scope import TORCH_CHECKPOINTING, TRACE, TraceScope, trace

RECORDING: ContextVar[Block | None] = ContextVar("tapesac_recording", default=None)


@contextmanager
def _autocast_weight_cache_disabled() -> Iterator[None]:
    """Autocast caches casts of parameters: a cached cast never reaches the dispatcher again, so
    the tape would see it as an external tensor and keep it. Casting again is cheap. Known cost:
    a parameter a block uses twice is cast twice, and its two casts' gradients are summed in
    float32 where without checkpointing one cast's are summed in the autocast dtype (not bitwise
    then; ``torch.utils.checkpoint`` is): said once (``_warn_if_cast_twice``)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _casts_cached() -> bool:
    """Whether autocast is on with its weight cache: without checkpointing, a parameter is cast
    once for all its uses in the region (the two warnings below say where blocks differ)."""
    return any_autocast_enabled() and torch.is_autocast_cache_enabled()


def _warn_if_cast_twice(block: Block) -> None:
    """A parameter cast twice to one dtype in a forward under autocast, which without
    checkpointing (its weight cache on) casts it once: said once per run, in words the same
    for every layer of a model (``_autocast_weight_cache_disabled``)."""
    seen: set[tuple[int, Any]] = set()
    for node in block.nodes:
        if node.name != "aten._to_copy.default" or not node.inputs:
            continue
        value = block.values[node.inputs[0]]
        leaf = block.leaves_read.get(value.name) if type(value.name) is str else None
        if value.kind != PARAM or leaf is None or not leaf.requires_grad:
            continue
        key = (value.vid, node.kwargs.get("dtype"))
        if key in seen:
            owner = type(block.module).__name__ if block.module is not None else "function"
            warnings.warn(
                f"TapeSAC: a checkpointed {owner} casts its parameter {value.name!r} to "
                f"{key[1]} twice under autocast: its blocks run with autocast's weight cache "
                "off, so where autocast made both casts, that parameter's gradient is summed "
                "in float32, where without checkpointing it is summed in the autocast dtype "
                "(close, not bit for bit; torch.utils.checkpoint is). Fix: cast the parameter "
                "once in the forward and use that cast twice, or turn the cache off "
                "(torch.autocast(..., cache_enabled=False): both then cast twice)",
                UserWarning,
                stacklevel=2,
            )
            return
        seen.add(key)


def _warn_if_called_again_under_autocast(config: BlockConfig, block: Block) -> None:
    """A module called again under autocast before its earlier call's backward (a shared layer,
    a siamese encoder): without checkpointing, autocast's weight cache casts its parameters once
    for both calls if one region holds them, and their gradients sum in the autocast dtype;
    blocks run with the cache off (``_autocast_weight_cache_disabled``) and cast per call. Said
    once per run, in words the same for every layer of a model."""
    if not _casts_cached():
        return
    if len(config.autocast_calls):  # an earlier call autograd still holds
        owner = type(block.module).__name__
        warnings.warn(
            f"TapeSAC: a checkpointed {owner} ran again under autocast before the backward of "
            "its earlier call: where one autocast region holds both calls, without "
            "checkpointing autocast casts its parameters once for both (its weight cache) and "
            "their gradients sum in the autocast dtype; its blocks cast per call, so they sum "
            "in float32 (close, not bit for bit; torch.utils.checkpoint neither). Fix: "
            "torch.autocast(..., cache_enabled=False) for bitwise gradients (both then cast "
            "per call), or checkpoint the module that calls it",
            UserWarning,
            stacklevel=3,
        )
    config.autocast_calls.add(block)


def run_block(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    region: str,
    module: torch.nn.Module | None,
    name: str,
    hf_layer: bool = False,
) -> Any:
    """One call of a block (``hf_layer``: a Hugging Face layer's forward, handed over by the
    layer with its checkpointing flag on)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    outer = RECORDING.get()
    if outer is not None:
        raise TapeSACError(
            f"block {name!r} is nested inside checkpointed block {outer.name!r}. "
            "Fix: checkpoint only one of them"
        )
    if graph_task_id() != -1:
        raise TapeSACError(
            f"block {name!r} ran during a backward pass (reentrant checkpointing, e.g. "
            "torch.utils.checkpoint(use_reentrant=True) around it). Fix: remove the outer checkpoint"
        )
    if module is not None:
        args, kwargs = without_hf_cache(module, args, kwargs)
    if module is not None and not hf_layer:
        refuse_hf_checkpointing(module, name)
    refuse_outer_torch_checkpoint(name)
    torch_checkpointed = TORCH_CHECKPOINTING.get()
    if torch_checkpointed is not None:
        torch_checkpointed.append(name)
        return _torch_checkpoint(fn, args, kwargs)
    plan = PLAN.get()
    block_plan = plan.block_plan(region) if plan else BlockPlan()
    scope = TRACE.get()
    position = _next_started(scope, region) if scope is not None else 0
    # Not recorded, nothing to check: as without checkpointing, or as full checkpointing does.
    if block_plan.kind is BlockKind.PLAIN:
        if scope is not None:
            scope.plain.append(name)
        return _backward_watched(scope, fn(*args, **kwargs))
    if block_plan.kind is BlockKind.TORCH_CHECKPOINT:
        if scope is not None:
            scope.torch_checkpointed.append(name)
        return _backward_watched(scope, _torch_checkpoint(fn, args, kwargs))
    submodules = list(module.modules()) if module is not None else []
    if module is not None:
        refuse_sharded_inside(module, name, submodules)
    if scope is not None:
        scope.check_micro_batch(name)
    config = block_config(module) if module is not None else None
    block = Block(
        name,
        region,
        module,
        block_plan,
        RECORDING.get,
        config.hidden_writes if config is not None else HiddenWrites(),
    )
    block.trace.position = position
    if scope is not None:
        scope.blocks.append(block.trace)
    if config is not None:
        _warn_if_called_again_under_autocast(config, block)
    call = call_arguments(args, kwargs)
    inputs = call.tensors
    cache = steady_cache(module) if module is not None else None
    signature = (
        block_signature(fn, call, inputs, submodules, _plan_key(block_plan), block.forced)
        if module is not None
        else None
    )
    entry = (
        cache.get(signature)
        if cache is not None and signature is not None
        else Recorded.NOT_A_MODULE
    )
    steady = scope is None or scope.steady
    if isinstance(entry, SteadyTape) and cache is not None and signature is not None and steady:
        return _run_steady(
            block, entry, fn, args, kwargs, inputs, cache, signature, block_plan.offload
        )
    block.trace.recorded_because = str(
        Recorded.MEASURED if isinstance(entry, SteadyTape) else entry
    )
    if scope is not None and scope.probe is not None:
        block.probe = scope.probe.watch(block, len(scope.blocks) - 1)
    if config is not None:
        block.deterministic_ops = config.deterministic_ops
    if scope is not None:
        block.verify = scope.verify
    if scope is not None and scope.time_nodes:
        block.enable_timing(inputs[0].device if inputs else torch.get_default_device())
    # On CPU profile steps the forward's wall time, against its ops' times, prices recording
    # (a plain block saves it); on accelerators host time says nothing about the step's time.
    timed = scope is not None and scope.time_nodes and all(t.device.type == "cpu" for t in inputs)
    start = time.perf_counter() if timed else 0.0
    recording = _Recording(block, inputs)
    out = recording.run(fn, args, kwargs, recording.recorder.pack, block.unpack)
    if timed:
        block.trace.forward_seconds = time.perf_counter() - start
    # A steady-state call's walk comes after its timing too (_run_steady).
    autograd = recording.autograd()
    refuse_reentrant_checkpoint_inside(name, autograd)
    if block.probe is not None:
        block.probe.forward_end(block.outliving(recording.recorder.alive))
    if cache is not None and signature is not None:
        cache.put(signature, recording.steady_tape(autograd), name)
    recording.recorder.forget()
    block.watch_writes([*recording.outputs, *inputs], recording.recorder.holding.outside)
    if scope is not None and scope.offload is not None:  # after the cache read what it holds
        scope.offload.store(block, planned=block_plan.offload)
    return out


class _Recording:
    """One recorded forward of ``block`` (its first call, or a diverged call run again in its
    backward, ``_learned_again``): the recorder, the call log and the outputs."""

    def __init__(self, block: Block, inputs: list[torch.Tensor]) -> None:
        self.block, self.inputs = block, inputs
        self.recorder = recorder = Recorder(block)
        recorder.register_inputs(inputs)
        # A module block's calls, for its steady-state calls to check (``call_checks.py``).
        module = block.module
        self.calls = CallLog(inputs, module, recorder.ops) if module is not None else None
        if self.calls is not None:
            recorder.call_sources = self.calls.sources
        self.outputs: list[torch.Tensor] = []
        self.output_vids: list[int] = []

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        pack: Callable[[torch.Tensor], Any],
        unpack: Callable[[Any], torch.Tensor],
    ) -> Any:
        """The forward, recorded, under the saved-tensor hooks ``pack`` and ``unpack``."""
        block, recorder, calls = self.block, self.recorder, self.calls
        block.on_exit = recorder.module_exit
        cached_casts = _casts_cached()
        token = RECORDING.set(block)
        try:
            with (
                _autocast_weight_cache_disabled(),
                torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                recorder,
                _submodules_tracked(block.module, block, True),
                calls if calls is not None else nullcontext(),
            ):
                out = fn(*args, **kwargs)
        finally:
            RECORDING.reset(token)
            block.on_exit = None  # the recorder holds the block: no cycle outlives the forward
        recorder.settle_writes()
        recorder.settle_swaps()
        if cached_casts:
            _warn_if_cast_twice(block)
        self.outputs = _tensors_out(out)
        self.output_vids = [recorder.vid_of(t) for t in self.outputs]
        block.finish(frozenset(self.output_vids), recorder.alive)
        return out

    def autograd(self) -> tuple[str, ...] | None:
        """The kinds of the autograd nodes the forward made (``autograd_nodes``)."""
        return autograd_nodes(self.outputs, self.inputs, limit=2 * len(self.block.nodes) + 64)

    def steady_tape(self, autograd: tuple[str, ...] | None) -> SteadyTape | Recorded:
        """The recorded call as a steady-state entry, or why later calls must record."""
        recorder = self.recorder
        assert recorder.ops is not None, "a module block's recorder logs its ops"
        assert self.calls is not None, "a module block logs its calls"
        if recorder.moved:
            return Recorded.MOVED
        return steady_tape(
            self.block,
            self.inputs,
            self.outputs,
            self.output_vids,
            autograd,
            recorder.log,
            recorder.ops,
            self.calls,
        )


def _learned_again(
    block: Block, cache: SteadyCache, signature: Signature, forward: SteadyForward
) -> Callable[..., None]:
    """A diverged call's recomputation (``Recompute``), recorded for its family of op structures
    to learn from (``data_sizes.DataFamily.learn``): a structure seen only in calls that
    departed from the active template (an expert left idle now and then) gets its template too.
    Learned only if it can run in steady state and ran the forward's ops up to where the
    forward departed (``structure_switch.ran_alike``). The recomputation's packs are taken as
    ever; nothing of the new tape reaches the call's backward, and nothing the recording holds
    outlives it."""
    assert forward.binding is not None, "only calls whose sizes follow their data learn so"
    started, matched = forward.binding.template, forward.matched()
    plan = BlockPlan(
        block.plan_coords,
        block.plan_sequence,
        block.plan_budget,
        block.plan_anchors,
        block.plan_modules,
    )

    def run(fn: Callable[..., Any], args: tuple, kwargs: dict, recompute: Recompute) -> None:
        learner = Block(
            block.name, block.region, block.module, plan, RECORDING.get, block.hidden_writes
        )
        config = block_config(block.module) if block.module is not None else None
        if config is not None:
            learner.deterministic_ops = config.deterministic_ops
        recording = _Recording(learner, call_arguments(args, kwargs).tensors)
        recompute.recorder_pack = recording.recorder.pack
        try:
            recording.run(fn, args, kwargs, recompute.pack, never_unpacked)
            made = recording.steady_tape(recording.autograd())
            if isinstance(made, SteadyTape) and ran_alike(started, made, matched):
                cache.put(signature, made, block.name)
        finally:
            recompute.recorder_pack = None
            recording.recorder.forget()
            learner.held.clear()

    return run


def _next_started(scope: TraceScope, region: str) -> int:
    """A block of ``region`` starts its forward: the block before it (its caller has let go of
    its inputs) offloads what only it holds now, where the step offloads it. On profiling and
    offloading steps, the bytes of its inputs it alone held are measured first, for the planner
    (``RegionProfile.inputs_alone``, checked again on every offloading step), unless its call
    diverged (it holds nothing). Returns the block's place among its region's blocks started in
    the trace."""
    if (scope.time_nodes or scope.offload is not None) and scope.blocks:
        previous = scope.blocks[-1]
        block = previous.block() if previous.block is not None else None
        if block is not None and previous.inputs_alone is None and previous.diverged is None:
            previous.inputs_alone = alone_bytes(block, (INPUT,))
    if scope.offload is not None:
        scope.offload.next_started()
    position = scope.started[region]
    scope.started[region] = position + 1
    return position


def _backward_watched(scope: TraceScope | None, out: Any) -> Any:
    """``out``, of a block a plan ran plain or under torch's checkpoint: where the step
    offloads, its backward's start (the first of its outputs' autograd nodes to run) starts
    the copy back of the block before it, as a recorded block's first unpack does
    (``Offload.kept``)."""
    if scope is not None and scope.offload is not None:
        scope.offload.watch_outputs(_tensors_out(out))
    return out


def _plan_key(plan: BlockPlan) -> tuple:
    """What of a block's plan entry its tape depends on (the held values, hence the packs)."""
    return (plan.coords, plan.sequence, plan.budget, plan.anchors)


def _run_steady(
    block: Block,
    entry: SteadyTape,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    inputs: list[torch.Tensor],
    cache: SteadyCache,
    signature: Signature,
    offload: bool,
) -> Any:
    """A call with a cached tape: the forward under the saved-tensor hooks and the checking mode
    (``steady.py``), binding its sizes as it runs where they follow its data (``data_sizes.py``);
    ``offload``: its plan offloads what it holds."""
    template = entry.template
    binding, switch = None, None
    if isinstance(template, DataTemplate):
        binding = DataBinding(template, block)
        family = cache.family(signature)
        switch = Switch(family) if family is not None and len(family.structures) > 1 else None
    forward = SteadyForward(block, entry, inputs, binding, switch)
    # On CPU its wall time prices the steady-state path against recording (profile.py).
    timed = all(t.device.type == "cpu" for t in inputs)
    start = time.perf_counter() if timed else 0.0
    token = RECORDING.set(block)
    try:
        with (
            _autocast_weight_cache_disabled(),
            torch.autograd.graph.saved_tensors_hooks(forward.pack, block.unpack),
            _submodules_tracked(block.module, block, bool(entry.exit_hold)),
            forward.check,
        ):
            out = fn(*args, **kwargs)
    finally:
        RECORDING.reset(token)
        block.on_exit = None  # the forward holds the block: no cycle outlives the forward
    block.recording = False
    if timed:
        block.trace.forward_seconds = time.perf_counter() - start
    outputs = _tensors_out(out)
    diverged = forward.finish(outputs, inputs)
    if diverged is None:
        cache.confirmed(signature, forward.entry)
        block.watch_writes([*outputs, *inputs], forward.outside)
        scope = TRACE.get()
        if scope is not None and scope.offload is not None:
            scope.offload.store(block, planned=offload)
    else:
        cache.diverged(signature, entry, block.name, diverged)
        block.held.clear()
        scope = TRACE.get()
        if scope is not None and scope.offload is not None:
            scope.offload.kept(block)  # holds nothing: its backward runs its forward again
        block.trace.diverged, block.trace.steady = diverged, False
        block.recompute = Recompute(
            block.name,
            fn,
            args,
            kwargs,
            forward.rng,
            signature.autocast,
            forward.layouts(),
            forward.sources,
            _recording,
            [] if block.module is None else leaves_of(block.module, forward.check.sources.read),
            rerun_check(forward.check),
            _learned_again(block, cache, signature, forward) if binding is not None else None,
        )
    return out


def _submodules_tracked(
    module: torch.nn.Module | None, block: Block, needed: bool
) -> AbstractContextManager[None]:
    """The submodule hooks for a call that needs them (``submodule_hooks.py``)."""
    if module is None or not needed:
        return nullcontext()
    return submodules_tracked(module, block)


@contextmanager
def _recording(block: Block) -> Iterator[None]:
    """``block`` is the one running (a recomputation in its backward): a saved tensor unpacked
    inside it, or a block called inside it, is refused as during its forward; and autocast's
    weight cache is off, as in its forward (a cached cast dispatches nothing: the run would not
    be the forward's, ``rerun_checks.py``)."""
    token = RECORDING.set(block)
    try:
        with _autocast_weight_cache_disabled():
            yield
    finally:
        RECORDING.reset(token)


def _tensors_out(out: Any) -> list[torch.Tensor]:
    """The tensors a block returned, in pytree order (a lone tensor skips pytree's walk)."""
    return [out] if isinstance(out, torch.Tensor) else tensor_leaves(out)


@torch.compiler.disable
def outside_compile(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A block reached by torch.compile: Dynamo stops here (one graph break) and ``call`` runs
    the block eagerly with record and replay; the code around it stays compiled."""
    # A warning, not a log line: Python's default filter shows it once per run, with no flag of ours.
    warnings.warn(
        "TapeSAC: torch.compile leaves checkpointed blocks uncompiled (they run eagerly, "
        "excluded with torch.compiler.disable); the rest of the model compiles",
        UserWarning,
        stacklevel=2,
    )
    return call(*args, **kwargs)


def _torch_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` under ``torch.utils.checkpoint`` (non-reentrant), ``kwargs``
    passed in one positional dict: torch's checkpoint would take those it knows (``debug``,
    ``early_stop``) for itself, and it looks for the devices whose random states it restores
    in its positional arguments only (a block given its tensors as keywords would draw other
    dropout masks again on an accelerator)."""
    return torch.utils.checkpoint.checkpoint(_call, fn, args, kwargs, use_reentrant=False)


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


def _unfolded(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], tuple, dict]:
    """``fn`` without the ``functools.partial`` around it: Hugging Face's layers pass
    ``partial(forward, layer, **kwargs)``, whose module names the block and keeps its steady
    state, and whose bound tensors are the block's inputs."""
    while isinstance(fn, functools.partial):
        partial: functools.partial[Any] = fn
        fn, args, kwargs = partial.func, (*partial.args, *args), {**partial.keywords, **kwargs}
    # transformers 5 passes the layer's forward unbound, the layer first: bound, it is the
    # module's call, so that its steady state lives on the module. Only a function of the
    # module's class: a lambda made per call would stay in the module's cache, with what it holds.
    if (
        isinstance(fn, types.FunctionType)
        and args
        and isinstance(args[0], torch.nn.Module)
        and _of_class(fn, type(args[0]))
    ):
        fn, args = types.MethodType(fn, args[0]), args[1:]
    return fn, args, kwargs


def _of_class(fn: types.FunctionType, cls: type[torch.nn.Module]) -> bool:
    """Whether ``fn`` is a method of ``cls`` or the forward its own ``forward`` wraps."""
    if getattr(cls.forward, "__wrapped__", None) is fn:
        return True
    return any(vars(c).get(fn.__name__) is fn for c in cls.__mro__)


def _module_of(fn: Callable[..., Any]) -> torch.nn.Module | None:
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    region: str = "default",
    use_reentrant: bool | None = None,
    context_fn: Callable[[], Any] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as one checkpointed block with tape record and replay; takes
    ``torch.utils.checkpoint.checkpoint``'s keywords (``torch_keywords.py``), never passing them on."""
    # Under torch.compile the block runs eagerly, outside the graph (see _checkpointed_forward in
    # wrapping.py).
    keywords = TorchKeywords(
        use_reentrant=use_reentrant,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        preserve_rng_state=preserve_rng_state,
    )
    if torch.compiler.is_compiling():
        return outside_compile(checkpoint, fn, *args, region=region, **vars(keywords), **kwargs)
    if not isinstance(region, str):
        raise TypeError(
            f"tapesac_core.checkpoint: region must be a str (the block's region type), not "
            f"{type(region).__name__}: a keyword argument named region cannot pass through to "
            "the checkpointed function; rename it there"
        )
    from_partial = isinstance(fn, functools.partial)
    fn, args, kwargs = _unfolded(fn, args, kwargs)
    module = _module_of(fn)
    config = block_config(module) if module is not None else None
    name = (config.path if config else None) or str(getattr(fn, "__qualname__", type(fn).__name__))
    keywords.check(name)
    # A Hugging Face layer calling TapeSAC as its checkpoint function hands over a partial.
    hf_layer = from_partial and module is not None and hf_layer_forward(module, fn)
    return run_block(fn, args, kwargs, region, module, name, hf_layer=hf_layer)


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Tape:
    """Run ``fn`` once as a block (grad enabled) and return its tape, for analysis and tests."""
    with torch.enable_grad(), trace() as blocks:
        checkpoint(fn, *args, **kwargs)
    return blocks[0].tape
