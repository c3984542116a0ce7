"""Public entry points: checkpoint a function or a module, apply a plan, record or trace blocks.

Contract, as for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the block's forward
runs once, normally; autograd's saved tensors are replaced by value ids except the mandatory set
S0 and the values the active plan saves; backward replays, on demand, only the producers of the
values it unpacks. Loss and gradients are bitwise those of running without checkpointing.

When grad is disabled a block runs plainly. In eval mode with grad enabled it is still
checkpointed. Raises ``TapeSACError`` for a block nested in another (at wrap time when a module is
wrapped inside or around a wrapped one, else at its forward), a block run during a backward
pass (reentrant checkpointing), ``torch.utils.checkpoint`` around a block or inside one (Hugging
Face's ``gradient_checkpointing`` flag on a block, a wrapper on a submodule, saved-tensor hooks
pushed inside: checked as each submodule is entered), ``fully_shard`` on a
module inside a block (at wrap time or at its forward), double backward, and in-place writes into
block inputs, parameters or buffers.

Under ``torch.compile`` the blocks are excluded from tracing (``torch.compiler.disable`` at the
block boundary, one info log): each block is one graph break and runs eagerly with record and
replay, the code between blocks compiles, and nothing of a block is guarded, so blocks cause no
recompilation. As for any disabled call, Dynamo runs eagerly a whole frame that calls a block
inside a loop: compile the modules around the blocks then.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from .block import Block, BlockPlan, BlockTrace
from .errors import TapeSACError
from .plan.coords import Anchor, Coord
from .plan.plan import BlockKind, Plan
from .recorder import Recorder
from .signature import Signature, block_signature
from .steady import Recompute, Recorded, SteadyForward, SteadyTape, steady_tape
from .steady_cache import SteadyCache, forget_steady_cache, steady_cache
from .tape import Tape
from .values import forget_leaves
from .verify import HiddenWrites

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=torch.nn.Module)
PlanSpec = Mapping[str, Any]

_RECORDING: ContextVar[Block | None] = ContextVar("tapesac_recording", default=None)
_PLAN: ContextVar[_PlanScope | None] = ContextVar("tapesac_plan", default=None)
_TRACE: ContextVar[_TraceScope | None] = ContextVar("tapesac_trace", default=None)
_TORCH_CHECKPOINT: ContextVar[list[str] | None] = ContextVar(
    "tapesac_torch_checkpoint", default=None
)


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """How a module is checkpointed: its region type, once known its path in the model, and the
    hidden writes verifying steps found in its model's blocks (shared by the blocks of one
    ``checkpoint_modules`` call)."""

    region: str
    path: str | None = None
    hidden_writes: HiddenWrites = field(default_factory=HiddenWrites, compare=False, repr=False)
    deterministic_ops: frozenset[str] = frozenset()  # custom ops declared not to draw numbers


# ---------------------------------------------------------------------- plans


def _is_coord(c: Any) -> bool:
    return (
        isinstance(c, (tuple, list))
        and len(c) == 3
        and isinstance(c[0], str)
        and isinstance(c[1], int)
        and isinstance(c[2], int)
    )


def _coords(collection: Any, region: str) -> frozenset[Coord]:
    coords = list(collection)
    bad = [c for c in coords if not _is_coord(c)]
    if bad:
        raise TapeSACError(
            f"plan for region {region!r}: {bad[0]!r} is not a coordinate "
            "(op_name, k, j), e.g. ('aten.mm.default', 0, 0)"
        )
    return frozenset(Coord(c[0], c[1], c[2]) for c in coords)


def normalize_plan(
    plan: PlanSpec,
) -> dict[str, frozenset[Coord] | list[frozenset[Coord] | BlockKind]]:
    """Coordinates per region, or one entry per block of the region in forward order: its
    coordinate set, ``PLAIN`` or ``TORCH_CHECKPOINT``."""
    if not isinstance(plan, Mapping):
        raise TapeSACError(f"a plan maps region names to coordinates, got {type(plan).__name__}")
    out: dict[str, Any] = {}
    for region, entry in plan.items():
        items = list(entry)
        if items and all(
            isinstance(i, BlockKind)
            or (not _is_coord(i) and isinstance(i, (set, frozenset, list, tuple)))
            for i in items
        ):
            out[region] = [_entry(i, region) for i in items]
        else:
            out[region] = _coords(items, region)
    return out


def _entry(item: Any, region: str) -> frozenset[Coord] | BlockKind:
    """One block's entry of a per-block plan list."""
    if item is BlockKind.TAPE:
        raise TapeSACError(
            f"plan for region {region!r}: a recorded block's entry is its coordinate set "
            "(an empty set for must-only), not BlockKind.TAPE"
        )
    return item if isinstance(item, BlockKind) else _coords(item, region)


class _PlanScope:
    def __init__(self, plan: Plan | PlanSpec) -> None:
        # A solved Plan also names the op sequence its coordinates are valid for, the bytes
        # each block's set may keep and the sets anchored on submodules; coordinates alone
        # are valid for any op sequence, with no bound.
        self.sequences: dict[str, str] = {}
        self.budgets: dict[str, list[int]] = {}
        self.anchors: dict[str, tuple[list[frozenset[Anchor]], Mapping[str, str]]] = {}
        if isinstance(plan, Plan):
            self.sequences = plan.sequences()
            self.budgets = plan.budgets()
            self.anchors = plan.anchors()
            kinds = plan.block_kinds()
            plan = {
                r: [
                    k if k is not BlockKind.TAPE else s
                    for s, k in zip(sets, kinds.get(r, [BlockKind.TAPE] * len(sets)))
                ]
                for r, sets in plan.coordinates().items()
            }
        self.plan = normalize_plan(plan)
        self.blocks: Counter[str] = Counter()

    def block_plan(self, region: str) -> BlockPlan:
        entry = self.plan.get(region, frozenset())
        if not isinstance(entry, list):
            return BlockPlan(entry, self.sequences.get(region))
        i = self.blocks[region]
        self.blocks[region] += 1  # an unrecorded block counts too: later ones keep their entries
        if not entry:
            return BlockPlan()
        item = entry[i % len(entry)]
        if isinstance(item, BlockKind):
            return BlockPlan(kind=item)
        budgets = self.budgets.get(region)
        anchors, modules = self.anchors.get(region, ([], {}))
        return BlockPlan(
            item,
            self.sequences.get(region),
            budgets[i % len(budgets)] if budgets else None,
            anchors[i % len(anchors)] if anchors else frozenset(),
            modules,
        )


@contextmanager
def use_plan(plan: Plan | PlanSpec) -> Iterator[None]:
    """Blocks recorded inside save the plan's coordinates (plus S0); outside, blocks are must-only.

    ``plan`` maps a region name to coordinates ``(op_name, k, j)``, or to a list with one
    coordinate collection per block of that region in forward order (block ``i`` uses entry
    ``i mod len(list)``, so one plan serves every micro-batch inside the context), ``PLAIN``
    for a block that runs as without checkpointing (not recorded: autograd keeps everything it
    saves, and nothing is replayed), or ``TORCH_CHECKPOINT`` for one that runs under
    ``torch.utils.checkpoint(use_reentrant=False)`` (not recorded either). It may also
    be a solved ``Plan``: then a block whose op sequence differs from the one the plan was
    solved on (its coordinates would name other tensors) saves the planned values of submodules
    whose own ops match the reference block's (anchored coordinates), and a block whose planned
    values take more bytes than the plan gave it (sizes that depend on data) keeps, in forward
    order, only those that fit.
    """
    token = _PLAN.set(_PlanScope(plan))
    try:
        yield
    finally:
        _PLAN.reset(token)


# ---------------------------------------------------------------------- traces


class _TraceScope:
    def __init__(
        self,
        time_nodes: bool,
        one_micro_batch: bool,
        verify: bool,
        probe: Any = None,
        plain: list[str] | None = None,
        torch_checkpointed: list[str] | None = None,
        record: bool = False,
    ) -> None:
        self.time_nodes = time_nodes
        self.one_micro_batch = one_micro_batch
        self.verify = verify
        self.probe = probe
        # Whether blocks with a cached tape may run from it: not where ops are timed, values
        # verified or memory probed, nor where the caller asks every block to record.
        self.steady = not (time_nodes or verify or probe is not None or record)
        self.blocks: list[BlockTrace] = []
        self.plain = plain if plain is not None else []  # blocks run plain (not recorded)
        # Blocks a plan ran under torch.utils.checkpoint (not recorded).
        self.torch_checkpointed = torch_checkpointed if torch_checkpointed is not None else []

    def check_micro_batch(self, name: str) -> None:
        """A block's forward after another block's backward is the next micro-batch's forward."""
        if self.one_micro_batch and any(b.unpacked for b in self.blocks):
            raise TapeSACError(
                f"block {name!r} ran its forward after the backward of another block in the same "
                "controller step (gradient accumulation: several micro-batches in one step); the "
                "plan would count every micro-batch's blocks as alive together. Fix: bracket each "
                "micro-batch in its own `with controller.step(tokens=...)`, with tokens of that "
                "micro-batch"
            )


@contextmanager
def trace(
    time_nodes: bool = False,
    one_micro_batch: bool = False,
    verify: bool = False,
    probe: Any = None,
    plain: list[str] | None = None,
    torch_checkpointed: list[str] | None = None,
    record: bool = False,
) -> Iterator[list[BlockTrace]]:
    """Collect a ``BlockTrace`` for every block recorded inside (and what its backward replays).

    With ``one_micro_batch``, a block recorded after another block of the trace ran its backward
    is a ``TapeSACError`` (one forward and backward per trace, as a controller step is).
    ``verify``: compare every value replay produces with the content autograd saved, to find
    writes the dispatcher cannot see (``tapesac_core.verify``); costs a fingerprint per saved
    value and a host sync per replayed value. ``probe`` (a ``timeline.StepProbe``) is told when
    each block's forward starts and ends, around each unpack, and when the block's saved values
    are freed: the memory timeline. ``plain`` and ``torch_checkpointed`` receive the names of the
    blocks a plan ran plain or under torch.utils.checkpoint. ``record``: every block records,
    none runs from a cached tape (steady state); a tape that differs from the cached one under
    the same signature is said at warning level. Timing, verifying and probing record too.
    """
    scope = _TraceScope(
        time_nodes, one_micro_batch, verify, probe, plain, torch_checkpointed, record
    )
    token = _TRACE.set(scope)
    try:
        yield scope.blocks
    finally:
        _TRACE.reset(token)


def traced_blocks() -> list[BlockTrace] | None:
    """The list the innermost open ``trace`` collects into (it grows as blocks record), or
    None outside any: for code that sees a controller step only from outside its ``with``."""
    scope = _TRACE.get()
    return scope.blocks if scope is not None else None


@contextmanager
def torch_checkpointing() -> Iterator[list[str]]:
    """Blocks run inside are not recorded: each runs under ``torch.utils.checkpoint(...,
    use_reentrant=False)`` as full checkpointing would, for steps that measure what users would
    otherwise run. Yields the names of the blocks so run."""
    names: list[str] = []
    token = _TORCH_CHECKPOINT.set(names)
    try:
        yield names
    finally:
        _TORCH_CHECKPOINT.reset(token)


# ---------------------------------------------------------------------- blocks


def _refuse_outer_torch_checkpoint(name: str) -> None:
    """torch.utils.checkpoint (non-reentrant) installs saved-tensor hooks around what it wraps."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint":
        raise TapeSACError(
            f"block {name!r} runs inside torch.utils.checkpoint. Fix: remove the outer "
            "checkpoint; TapeSAC already checkpoints this block"
        )


def _refuse_hf_checkpointing(module: torch.nn.Module, name: str) -> None:
    """Hugging Face's ``GradientCheckpointingLayer`` runs torch.utils.checkpoint inside its own
    forward while its ``gradient_checkpointing`` flag is on: autograd would hand every saved
    tensor to torch's hooks, not TapeSAC's, and the block would save and replay nothing."""
    if module.training and getattr(module, "gradient_checkpointing", False) is True:
        raise TapeSACError(
            f"block {name!r} has Hugging Face activation checkpointing on (its "
            "gradient_checkpointing flag): torch.utils.checkpoint would run inside the TapeSAC "
            "block, which would then save and replay nothing. Fix: turn it off, "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
            "transformers 5), or gradient_checkpointing=False in the Trainer's arguments; "
            "TapeSAC replaces it"
        )


# The pack hooks TapeSAC itself runs a block's forward under.
_OWN_PACK_HOOKS = (Recorder.pack, SteadyForward.pack, Recompute._pack)


def _refuse_inner_saved_tensor_hooks(block: Block, submodule: str) -> None:
    """Saved-tensor hooks pushed inside a recording block (torch.utils.checkpoint or a wrapper
    of it, activation offloading) take every tensor autograd saves there away from the tape's
    pack hook: the block would silently save and replay nothing of it."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None or getattr(hooks[0], "__func__", None) in _OWN_PACK_HOOKS:
        return
    origin = getattr(hooks[0], "__module__", "") or ""
    what = (
        "torch.utils.checkpoint (or a wrapper of it, e.g. checkpoint_wrapper)"
        if origin == "torch.utils.checkpoint"
        else f"saved-tensor hooks of {origin or 'unknown origin'} (e.g. save_on_cpu offloading)"
    )
    raise TapeSACError(
        f"{what} runs inside TapeSAC block {block.name!r} (around {block.name}.{submodule}): "
        "autograd would hand the tensors it saves there to those hooks, and TapeSAC would save "
        "and replay nothing of them. Fix: remove that checkpoint (or hooks) inside the block; "
        "TapeSAC already checkpoints it"
    )


def _refuse_recompute_in_backward(submodule: str, module: torch.nn.Module) -> None:
    """A submodule of a block running with grad during backward: a reentrant checkpoint inside
    the block recomputes it (its forward ran under no_grad, where no saved-tensor hooks show).
    torch's non-reentrant recompute (full-checkpointing control steps) runs under its hooks."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1:
        return
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None or getattr(hooks[0], "__module__", "") != "torch.utils.checkpoint":
        raise TapeSACError(
            f"{module._tapesac_inside}.{submodule} ran during backward: a reentrant checkpoint "
            "(torch.utils.checkpoint(use_reentrant=True)) inside TapeSAC block "
            f"{module._tapesac_inside!r} recomputes it. Fix: remove that checkpoint; TapeSAC "
            "already checkpoints the block"
        )


@contextmanager
def _autocast_weight_cache_disabled() -> Iterator[None]:
    """Autocast caches casts of parameters: a cached cast never reaches the dispatcher again, so
    the tape would see it as an external tensor and keep it. Casting again is cheap."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _run_block(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    region: str,
    module: torch.nn.Module | None,
    name: str,
) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    outer = _RECORDING.get()
    if outer is not None:
        raise TapeSACError(
            f"block {name!r} is nested inside checkpointed block {outer.name!r}. "
            "Fix: checkpoint only one of them"
        )
    if torch._C._current_graph_task_id() != -1:
        raise TapeSACError(
            f"block {name!r} ran during a backward pass (reentrant checkpointing, e.g. "
            "torch.utils.checkpoint(use_reentrant=True) around it). Fix: remove the outer checkpoint"
        )
    if module is not None:
        _refuse_hf_checkpointing(module, name)
    _refuse_outer_torch_checkpoint(name)
    torch_checkpointed = _TORCH_CHECKPOINT.get()
    if torch_checkpointed is not None:
        torch_checkpointed.append(name)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    plan = _PLAN.get()
    block_plan = plan.block_plan(region) if plan else BlockPlan()
    scope = _TRACE.get()
    # Not recorded, nothing to check: as without checkpointing, or as full checkpointing does.
    if block_plan.kind is BlockKind.PLAIN:
        if scope is not None:
            scope.plain.append(name)
        return fn(*args, **kwargs)
    if block_plan.kind is BlockKind.TORCH_CHECKPOINT:
        if scope is not None:
            scope.torch_checkpointed.append(name)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if module is not None:
        _refuse_sharded_inside(module, name)
    if scope is not None:
        scope.check_micro_batch(name)
    config = block_config(module) if module is not None else None
    block = Block(
        name,
        region,
        module,
        block_plan,
        _RECORDING.get,
        config.hidden_writes if config is not None else HiddenWrites(),
    )
    if scope is not None:
        scope.blocks.append(block.trace)
    inputs = _tensors_in(args, kwargs)
    cache = steady_cache(module) if module is not None else None
    signature = (
        block_signature(
            fn, args, kwargs, inputs, list(module.modules()), _plan_key(block_plan), block.forced
        )
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
        return _run_steady(block, entry, fn, args, kwargs, inputs, cache, signature)
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
    recorder = Recorder(block)
    recorder.register_inputs(inputs)
    block.on_exit = recorder.module_exit
    token = _RECORDING.set(block)
    try:
        with (
            _autocast_weight_cache_disabled(),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, block.unpack),
            recorder,
        ):
            out = fn(*args, **kwargs)
    finally:
        _RECORDING.reset(token)
        block.on_exit = None  # the recorder holds the block: no cycle outlives the forward
    outputs = _tensors_in((out,), {})
    output_vids = [recorder.vid_of(t) for t in outputs]
    block.finish(frozenset(output_vids), recorder.alive)
    if timed:
        block.trace.forward_seconds = time.perf_counter() - start
    if block.probe is not None:
        block.probe.forward_end(block.outliving(recorder.alive))
    if cache is not None and signature is not None:
        cache.put(signature, steady_tape(block, inputs, outputs, output_vids), name)
    recorder.forget()
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
) -> Any:
    """A call with a cached tape: the forward under the saved-tensor hooks alone (``steady.py``)."""
    forward = SteadyForward(block, entry, inputs)
    # On CPU its wall time prices the steady-state path against recording (profile.py).
    timed = all(t.device.type == "cpu" for t in inputs)
    start = time.perf_counter() if timed else 0.0
    token = _RECORDING.set(block)
    try:
        with (
            _autocast_weight_cache_disabled(),
            torch.autograd.graph.saved_tensors_hooks(forward.pack, block.unpack),
        ):
            out = fn(*args, **kwargs)
    finally:
        _RECORDING.reset(token)
        block.on_exit = None  # the forward holds the block: no cycle outlives the forward
    block.recording = False
    if timed:
        block.trace.forward_seconds = time.perf_counter() - start
    diverged = forward.finish(_tensors_in((out,), {}), inputs)
    if diverged is not None:
        cache.diverged(signature, entry, block.name, diverged)
        block.held.clear()
        block.trace.diverged = diverged
        block.recompute = Recompute(
            block.name,
            fn,
            args,
            kwargs,
            forward.rng,
            signature.autocast,
            forward.layouts(),
            _recording,
        )
    return out


@contextmanager
def _recording(block: Block) -> Iterator[None]:
    """``block`` is the one running (a recomputation in its backward): its submodules' checks
    see their block."""
    token = _RECORDING.set(block)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments (or a block's outputs), in pytree order. Flat
    arguments, the common case, skip pytree's walk, which costs tens of microseconds a block."""
    if kwargs or not all(
        isinstance(a, torch.Tensor) or a is None or type(a) in (int, float, bool) for a in args
    ):
        return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return [a for a in args if isinstance(a, torch.Tensor)]


_told_compiled = False


@torch.compiler.disable
def _outside_compile(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A block reached by torch.compile: Dynamo stops here (one graph break) and ``call`` runs
    the block eagerly with record and replay; the code around it stays compiled."""
    global _told_compiled
    if not _told_compiled:
        _told_compiled = True
        logger.info(
            "TapeSAC: torch.compile leaves checkpointed blocks uncompiled (they run "
            "eagerly, excluded with torch.compiler.disable); the rest of the model compiles"
        )
    return call(*args, **kwargs)


def _module_of(fn: Callable[..., Any]) -> torch.nn.Module | None:
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def checkpoint(fn: Callable[..., Any], *args: Any, region: str = "default", **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as one checkpointed block with tape record and replay."""
    # Under torch.compile the block runs eagerly, outside the graph (see _checkpointed_forward).
    if torch.compiler.is_compiling():
        return _outside_compile(checkpoint, fn, *args, region=region, **kwargs)
    module = _module_of(fn)
    config = block_config(module) if module is not None else None
    name = (config.path if config else None) or str(getattr(fn, "__qualname__", type(fn).__name__))
    return _run_block(fn, args, kwargs, region, module, name)


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Under torch.compile, Dynamo would trace into the recorder (a dispatch mode and saved-tensor
    # hooks), guard on each block's attributes, recompile per block up to its limit and silently
    # fall back: the block is excluded explicitly, reading none of its attributes while tracing.
    if torch.compiler.is_compiling():
        return _outside_compile(_checkpointed_forward, self, *args, **kwargs)
    config = block_config(self)
    assert config is not None  # _wrap patches this forward in with the module's config
    return _run_block(
        vars(self)["_tapesac_forward"],
        args,
        kwargs,
        config.region,
        self,
        config.path or type(self).__name__,
    )


def block_config(module: torch.nn.Module) -> BlockConfig | None:
    """How ``module`` is checkpointed (its region type and path), or None: not a TapeSAC block."""
    return getattr(module, "_tapesac", None)


def checkpoint_module(
    module: M, region: str | None = None, *, deterministic_ops: Iterable[str] = ()
) -> M:
    """Make every forward call of ``module`` a checkpointed block; patches forward in place.

    ``deterministic_ops``: custom ops (``"namespace::name"``) declared not to draw random
    numbers; any other op outside PyTorch's own libraries has its device's generator captured
    for replay. Raises ``TapeSACError`` if ``module`` is already checkpointed, lies inside a
    checkpointed module, or contains one (a block inside a block fails at its first forward)."""
    return _wrap(module, region, None, HiddenWrites(), op_names(deterministic_ops))


def op_names(ops: Iterable[str]) -> frozenset[str]:
    """``deterministic_ops`` as a set, each name checked (``namespace::name``)."""
    names = frozenset(ops)
    bad = sorted(n for n in names if not isinstance(n, str) or "::" not in n)
    if bad:
        raise TapeSACError(
            f"deterministic_ops names ops as 'namespace::name' (e.g. 'mylib::fused_norm'), "
            f"got {bad[0]!r}"
        )
    return names


def _wrap(
    module: M,
    region: str | None,
    path: str | None,
    hidden_writes: HiddenWrites,
    deterministic_ops: frozenset[str],
) -> M:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"checkpoint_module takes an nn.Module, got {type(module).__name__}")
    if block_config(module) is not None:
        raise TapeSACError(f"{type(module).__name__} is already checkpointed by TapeSAC")
    name = path or type(module).__name__
    _refuse_wrapping(module, name)
    # Bound methods deep-copy with their module, so a copied model checkpoints its own blocks.
    # Plain attributes, past nn.Module's registries (Module.__setattr__ stores them the same way).
    vars(module)["_tapesac_forward"] = module.forward
    vars(module)["_tapesac"] = BlockConfig(
        region=region or type(module).__name__,
        path=path,
        hidden_writes=hidden_writes,
        deterministic_ops=deterministic_ops,
    )
    module.forward = types.MethodType(_checkpointed_forward, module)
    # Held on the module, not beside it: a deep copy's handles then remove the copy's own hooks
    # (a handle's copy names the copied hook dict; one held elsewhere names the original's).
    vars(module)["_tapesac_hooks"] = _track_submodules(module, name)
    return module


def _unwrap(module: torch.nn.Module) -> None:
    """Undo ``_wrap``: the module's own forward back, and nothing of TapeSAC left on it or inside."""
    state = vars(module)
    forward = state.pop("_tapesac_forward")
    # Wrapping bound the class's forward unless the instance had its own (e.g. a library's hook).
    bound = getattr(forward, "__self__", None) is module
    if bound and getattr(forward, "__func__", None) is getattr(type(module), "forward", None):
        del state["forward"]
    else:
        state["forward"] = forward
    for handle in state.pop("_tapesac_hooks"):
        handle.remove()
    for sub in module.modules():
        vars(sub).pop("_tapesac_inside", None)
    del state["_tapesac"]
    forget_steady_cache(module)
    forget_leaves(module)


def restore_modules(model: torch.nn.Module) -> list[str]:
    """Undo ``checkpoint_modules`` and ``checkpoint_module`` on every block of ``model``: each runs
    its own forward again, as before checkpointing; the blocks' paths in ``model``."""
    blocks = [(path, m) for path, m in model.named_modules() if block_config(m) is not None]
    if not blocks:
        raise TapeSACError(
            f"restore_modules: no module of {type(model).__name__} is checkpointed by TapeSAC "
            "(never checkpointed, or restored already). Fix: pass the model given to "
            "checkpoint_modules (or a module around those given to checkpoint_module), once"
        )
    for _, module in blocks:
        _unwrap(module)
    return [path for path, _ in blocks]


def _refuse_wrapping(module: torch.nn.Module, name: str) -> None:
    """Every reason ``module`` cannot become a block, as an error naming the fix."""
    _refuse_nesting(module, name)
    _refuse_sharded_inside(module, name)


def _refuse_nesting(module: torch.nn.Module, name: str) -> None:
    """A checkpointed module inside ``module``, or ``module`` inside one: an error naming both."""
    outer = getattr(module, "_tapesac_inside", None)
    if outer is not None:
        raise TapeSACError(
            f"cannot checkpoint {name!r}: it lies inside {outer!r}, which is "
            "already checkpointed (a block inside a block). Fix: checkpoint only "
            "one of them"
        )
    inner = next(
        (
            f"{name}.{sub_name}"
            for sub_name, sub in module.named_modules()
            if sub is not module and block_config(sub) is not None
        ),
        None,
    )
    if inner is not None:
        raise TapeSACError(
            f"cannot checkpoint {name!r}: it contains {inner!r}, which is already "
            "checkpointed (a block inside a block). Fix: checkpoint only one of them"
        )


def _refuse_sharded_inside(module: torch.nn.Module, name: str) -> None:
    """``fully_shard`` on a module inside a block: an error naming it (FSDP would gather and free
    its parameters inside the block's forward, which replay cannot repeat)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    inner = next(
        (
            f"{name}.{sub_name}"
            for sub_name, sub in module.named_modules()
            if sub is not module and isinstance(sub, FSDPModule)
        ),
        None,
    )
    if inner is not None:
        raise TapeSACError(
            f"block {name!r} contains {inner!r}, sharded by fully_shard on its own: "
            "FSDP gathers and frees its parameters inside the block, which replay "
            "cannot repeat. Fix: apply fully_shard to the block (or a module "
            "around it), not to modules inside it"
        )


def _track_submodules(module: torch.nn.Module, name: str) -> list[RemovableHandle]:
    """Name the submodule that issues each recorded op (module paths in plans and explain()),
    and mark each as inside block ``name`` so wrapping it later is refused; the hooks' handles."""
    handles = []
    for sub_name, sub in module.named_modules():
        if sub is not module:
            sub._tapesac_inside = name
            handles.append(
                sub.register_forward_pre_hook(functools.partial(_enter_submodule, sub_name))
            )
            handles.append(sub.register_forward_hook(_exit_submodule))
    return handles


def _enter_submodule(name: str, module: torch.nn.Module, args: Any) -> None:
    block = _RECORDING.get()
    if block is not None:
        _refuse_inner_saved_tensor_hooks(block, name)
        block.enter_module(name)
    else:
        _refuse_recompute_in_backward(name, module)


def _exit_submodule(module: torch.nn.Module, args: Any, output: Any) -> None:
    block = _RECORDING.get()
    if block is not None:
        block.exit_module(output)


Policy = set[type[torch.nn.Module]] | Callable[[torch.nn.Module], bool]
Regions = Mapping[type[torch.nn.Module], str] | Callable[[torch.nn.Module], str | None]


def module_selector(policy: Policy, what: str = "policy") -> Callable[[torch.nn.Module], bool]:
    """A ``Module -> bool`` from a set of module classes or a callable (Lightning's convention)."""
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if classes and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            return lambda m: isinstance(m, classes)
    elif callable(policy) and not isinstance(policy, type):
        return policy
    raise TypeError(
        f"{what} must be a set of nn.Module classes (e.g. {{DecoderLayer}}) or a "
        f"Module -> bool callable, got {policy!r}"
    )


def region_namer(regions: Regions | None) -> Callable[[torch.nn.Module], str | None]:
    """Region type of a module: from a class -> name mapping or a callable; None: its class name."""
    if regions is None:
        return lambda m: None
    if isinstance(regions, Mapping):
        return lambda m: next((r for c, r in regions.items() if isinstance(m, c)), None)
    if callable(regions):
        return regions
    raise TypeError(
        f"regions must map module classes to region names or be a callable, got {regions!r}"
    )


def checkpoint_modules(
    model: torch.nn.Module,
    policy: Policy,
    regions: Regions | None = None,
    *,
    deterministic_ops: Iterable[str] = (),
) -> list[str]:
    """Checkpoint every submodule of ``model`` the policy selects (not inside another); their paths.

    ``deterministic_ops`` as for ``checkpoint_module``. A selected module inside or around a
    module checkpointed earlier is a ``TapeSACError``."""
    selects, region_of = module_selector(policy), region_namer(regions)
    declared = op_names(deterministic_ops)
    paths: list[str] = []
    chosen: list[torch.nn.Module] = []
    for path, module in model.named_modules():
        if selects(module) and not _inside(path, paths):
            _refuse_wrapping(module, path or type(module).__name__)  # before any is wrapped
            paths.append(path)
            chosen.append(module)
    hidden_writes = HiddenWrites()  # one model's findings
    for path, module in zip(paths, chosen):
        _wrap(module, region_of(module), path, hidden_writes, declared)
    if not paths:
        found = repeated_block_classes(model)
        example = "{" + ", ".join(found) + "}" if found else "the class of its transformer block"
        raise TapeSACError(
            f"the activation checkpointing policy {describe_policy(policy)} matches "
            f"no module of {type(model).__name__}. Fix: name its block classes, "
            f"e.g. {example}, or pass a callable that selects them"
        )
    return paths


def describe_policy(policy: Policy) -> str:
    """A policy as the user wrote it: ``{ClassA, ClassB}``, or the callable's name."""
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in policy)) + "}"
    return f"callable {getattr(policy, '__qualname__', repr(policy))}"


def repeated_blocks(root: torch.nn.Module) -> Callable[[torch.nn.Module], bool]:
    """The default policy: modules held in a ModuleList beside others of their class (layer stacks)."""
    repeated: set[int] = set()
    for child in root.modules():
        if isinstance(child, torch.nn.ModuleList):
            classes = [type(m) for m in child]
            repeated.update(id(m) for m in child if classes.count(type(m)) > 1)
    return lambda m: id(m) in repeated


def repeated_block_classes(root: torch.nn.Module) -> list[str]:
    """Names of the classes ``repeated_blocks`` selects, for messages that suggest a policy."""
    selected = repeated_blocks(root)
    return sorted({type(m).__name__ for m in root.modules() if selected(m)})


def _inside(path: str, parents: list[str]) -> bool:
    return any(path.startswith(p + ".") or p == "" for p in parents)


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Tape:
    """Run ``fn`` once as a block (grad enabled) and return its tape, for analysis and tests."""
    with torch.enable_grad(), trace() as blocks:
        checkpoint(fn, *args, **kwargs)
    return blocks[0].tape
