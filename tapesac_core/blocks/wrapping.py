"""Checkpointing modules: ``checkpoint_module`` and ``checkpoint_modules`` make a module's forward
run as a block (its submodules are marked as inside it, so that wrapping one later is refused),
``restore_modules`` undoes that; and the policy helpers the integrations share: which modules
become blocks, their region names."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from ..errors import TapeSACError
from ..tape.steady_cache import forget_steady_cache
from ..tape.values import forget_leaves
from ..tape.verify import HiddenWrites
from .block_settings import BlockConfig, block_config
from .refusals import refuse_wrapping
from .running import outside_compile, run_block

M = TypeVar("M", bound=torch.nn.Module)


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Under torch.compile, Dynamo would trace into the recorder (a dispatch mode and saved-tensor
    # hooks), guard on each block's attributes, recompile per block up to its limit and silently
    # fall back: the block is excluded explicitly, reading none of its attributes while tracing.
    if torch.compiler.is_compiling():
        return outside_compile(_checkpointed_forward, self, *args, **kwargs)
    config = block_config(self)
    assert config is not None  # _wrap patches this forward in with the module's config
    return run_block(
        vars(self)["_tapesac_forward"],
        args,
        kwargs,
        config.region,
        self,
        config.path or type(self).__name__,
    )


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
    refuse_wrapping(module, name)
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
    for sub in module.modules():
        if sub is not module:
            vars(sub)["_tapesac_inside"] = name  # wrapping it later is refused (refusals.py)
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
            refuse_wrapping(module, path or type(module).__name__)  # before any is wrapped
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
