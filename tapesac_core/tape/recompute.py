"""A diverged steady-state call's backward: the block's forward run again from its inputs, as
``torch.utils.checkpoint`` recomputes, each saved tensor taken by its pack index (``steady.py``
says when a call diverges)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._compat import dispatch_disabled, torch_function_disabled, tree_leaves, tree_map_only
from ..errors import LEAF_FIX, TapeSACError, written_after_forward
from .call_checks import CallCheck
from .op_checks import SteadyCheck
from .rerun_checks import RerunCheck
from .signature import call_arguments
from .steady import Layout

if TYPE_CHECKING:
    from .block import Block

Tensor = torch.Tensor


class Recompute:
    """A diverged steady-state call's backward: its forward run again from its inputs, as
    ``torch.utils.checkpoint`` recomputes, its packs taken by index."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        rng: list[tuple[torch.Generator, Tensor]],
        autocast: Sequence[tuple[str, torch.dtype]],
        layouts: list[Layout],
        sources: list[Any],
        running: Callable[[Any], AbstractContextManager[Any]],
        leaves: list[Leaf],
        checked: RerunCheck | None,
        recorded: Callable[..., None] | None = None,
    ) -> None:
        self.name, self.fn, self.args, self.kwargs = name, fn, args, kwargs
        self.rng, self.autocast, self.layouts, self.running = rng, autocast, layouts, running
        # Where each tensor the forward saved came from (``Sources.pack_key``), and the run's:
        # a custom ``autograd.Function`` picks what it saves in Python, which no check sees.
        self.sources = sources
        self._sources: list[Any] = []
        self.leaves = leaves  # the module's parameters and buffers as the forward used them
        # What the forward ran, which the run checks against (``rerun_checks.py``), and the
        # mode checking the run now (paused at its packs).
        self.checked = checked
        self._check: SteadyCheck | CallCheck | None = None
        # Where the forward run again is recorded too (``running._learned_again``): called as
        # ``recorded(fn, args, kwargs, self)``, it runs the forward under ``pack`` and
        # ``never_unpacked`` with ``recorder_pack`` set to its recorder's pack.
        self.recorded = recorded
        self.recorder_pack: Callable[[Tensor], Any] | None = None
        self.packed: list[Tensor] | None = None
        self._packing: list[Tensor] = []
        # The forward's tensor arguments and their versions: run again from them, it would read
        # what code after the block wrote into them in place.
        self._versions = [
            (t, t._version) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
        ]

    def take(self, handle: int, block: Block) -> Tensor:
        """The tensor of pack ``handle``, running ``block``'s forward again at the first."""
        if self.packed is None:
            self.packed = self._run(block)
        return self.packed[handle]

    def _run(self, block: Block) -> list[Tensor]:
        for t, version in self._versions:
            if t._version != version:
                what = (
                    f"its input {tuple(t.shape)} {t.dtype}, from which its backward runs its "
                    "forward again,"
                )
                raise written_after_forward(self.name, what, version, t._version)
        for leaf in self.leaves:
            if leaf.version is not None and leaf.tensor._version != leaf.version:
                what = f"its parameter or buffer {leaf.name!r}, from which its backward runs its forward again,"
                raise written_after_forward(
                    self.name, what, leaf.version, leaf.tensor._version, LEAF_FIX
                )
        args, kwargs = _detached_inputs(self.args, self.kwargs)
        check = None
        if self.checked is not None and block.module is not None:
            check = self.checked.mode(call_arguments(args, kwargs).tensors, block.module)
        fn = self.fn if check is None else _under(check, self.fn)
        self._check = check
        current = [(g, g.get_state()) for g, _ in self.rng]
        for g, state in self.rng:
            g.set_state(state)
        try:
            with ExitStack() as stack:
                # The forward's autocast: backward runs without it (on GPUs in autograd's own
                # threads), and casts decide what is saved.
                for device_type, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(self.running(block))
                stack.enter_context(forward_leaves(self.leaves))
                if self.recorded is not None:
                    self.recorded(fn, args, kwargs, self)
                else:
                    stack.enter_context(
                        torch.autograd.graph.saved_tensors_hooks(self.pack, never_unpacked)
                    )
                    fn(*args, **kwargs)
        finally:
            self._check = None
            for g, state in current:
                g.set_state(state)
        if check is not None:
            assert self.checked is not None, "a run is checked against its forward"
            why = self.checked.verdict(check)
            sources, self._sources = self._sources, []
            if why is None and sources != self.sources:
                first = next(
                    (i for i, (a, b) in enumerate(zip(sources, self.sources)) if a != b),
                    min(len(sources), len(self.sources)),
                )
                why = f"saved tensor {first} was made by other {check.unit} than the forward's"
            if why is not None:
                self._packing = []
                raise TapeSACError(
                    f"block {self.name!r}: its forward ran differently when run again in "
                    f"backward than in forward ({why}). A call that departed from its tape runs "
                    "its forward again in backward, as torch.utils.checkpoint does: backward "
                    "would read what that run saved, not what the forward saved (wrong "
                    "gradients), and the run repeats what the forward changed. Fix: do not "
                    "change inside the forward what it reads or keeps outside it (a counter it "
                    "increments, Python's random, a statistic it accumulates): update such "
                    "state in the training loop, between steps; or leave this module out of "
                    "checkpointing"
                )
        packed, self._packing = self._packing, []
        layouts = [(t.shape, t.dtype) for t in packed]
        if layouts != self.layouts:
            first = next(
                (i for i, (a, b) in enumerate(zip(layouts, self.layouts)) if a != b),
                min(len(layouts), len(self.layouts)),
            )
            raise TapeSACError(
                f"block {self.name!r}: its forward ran differently in backward than in forward "
                f"({len(self.layouts)} tensors saved in forward, {len(layouts)} when run again; "
                f"they differ from saved tensor {first} on). "
                "Fix: make what steers the block's forward an input or a module attribute that "
                "does not change between a step's forward and its backward"
            )
        return packed

    def pack(self, t: Tensor) -> int:
        check = self._check
        if check is not None:
            self._sources.append(check.sources.pack_key(t))
            check.pause()
        try:
            if self.recorder_pack is not None:
                self.recorder_pack(t)
                with dispatch_disabled(), torch_function_disabled():  # not the forward's ops
                    self._packing.append(t.detach())
            else:
                self._packing.append(t.detach())
        finally:
            if check is not None:
                check.resume()
        return len(self._packing) - 1


def _detached_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward's arguments, each tensor detached once: a tensor passed twice is one tensor
    again (``attention(x, x, x)`` takes another path for a key that is not its query)."""
    made: dict[int, Tensor] = {}

    def detached(t: Tensor) -> Tensor:
        d = made.get(id(t))
        if d is None:
            d = made[id(t)] = t.detach().requires_grad_(t.requires_grad)
        return d

    out: tuple[tuple, dict] = tree_map_only(Tensor, detached, (args, kwargs))
    return out


def _under(check: SteadyCheck | CallCheck, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under ``check``: entered around the forward alone, above any mode recording
    it (``running._learned_again``), whose own ops it must not see."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with check:
            return fn(*args, **kwargs)

    return run


class Leaf(NamedTuple):
    """One parameter or buffer of a module, in its owner's table under ``attr``, and its
    version at the end of the forward if the forward read it."""

    table: dict[str, Any]  # the owner's ``_parameters`` or ``_buffers``
    attr: str
    tensor: Tensor
    name: str  # its path in the module
    version: int | None  # None: not read (an expert no token was routed to)


def leaves_of(module: torch.nn.Module, read: Mapping[str, Tensor]) -> list[Leaf]:
    """The parameters and buffers the forward of ``module`` (just ended) used: each as it first
    read it (``read``, by name), else as the module holds it now."""
    leaves = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for attr, t in table.items():
                if t is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    used = read.get(name)
                    version = None if used is None else used._version
                    leaves.append(Leaf(table, attr, t if used is None else used, name, version))
    return leaves


@contextmanager
def forward_leaves(leaves: list[Leaf]) -> Iterator[None]:
    """The parameters and buffers a forward used, put back into their modules for the forward
    run again: ``torch.func.functional_call`` swaps its own tensors in for the forward and back
    before backward (FSDP2 gathers into the tensors it registered, so nothing changes there)."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for table, attr, t, _, _ in leaves:
            current = table.get(attr, _ABSENT)
            if current is not t:
                swapped.append((table, attr, current))
                table[attr] = t
        yield
    finally:
        for table, attr, current in reversed(swapped):
            if current is _ABSENT:
                del table[attr]
            else:
                table[attr] = current


_ABSENT = object()


def never_unpacked(handle: int) -> Tensor:
    raise TapeSACError("a tensor saved while recomputing a TapeSAC block was unpacked")
