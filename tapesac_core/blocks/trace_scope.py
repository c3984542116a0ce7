"""What blocks tell the code around them: ``trace`` collects a ``BlockTrace`` for every block
recorded inside (and says whether blocks may run from a cached tape), ``torch_checkpointing``
runs blocks under torch's own checkpoint instead and names them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..errors import TapeSACError
from ..tape.block import BlockTrace
from ..tape.offload import Offload

TRACE: ContextVar[TraceScope | None] = ContextVar("tapesac_trace", default=None)
TORCH_CHECKPOINTING: ContextVar[list[str] | None] = ContextVar(
    "tapesac_torch_checkpoint", default=None
)


class TraceScope:
    def __init__(
        self,
        time_nodes: bool,
        one_micro_batch: bool,
        verify: bool,
        probe: Any = None,
        plain: list[str] | None = None,
        torch_checkpointed: list[str] | None = None,
        record: bool = False,
        offload: Offload | None = None,
    ) -> None:
        self.time_nodes = time_nodes
        self.offload = offload
        self.one_micro_batch = one_micro_batch
        self.verify = verify
        self.probe = probe
        # Whether blocks with a cached tape may run from it: not where ops are timed, values
        # verified or memory probed, nor where the caller asks every block to record.
        self.steady = not (time_nodes or verify or probe is not None or record)
        self.blocks: list[BlockTrace] = []
        self.started: Counter[str] = Counter()  # per region, blocks whose forward started
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
    offload: Offload | None = None,
) -> Iterator[list[BlockTrace]]:
    """Collect a ``BlockTrace`` for every block recorded inside (and what its backward replays).

    With ``one_micro_batch``, a block recorded after another block of the trace ran its backward
    is a ``TapeSACError`` (one forward and backward per trace, as a controller step is).
    ``verify``: compare every value replay produces with the content autograd saved, to find
    writes the dispatcher cannot see (``tapesac_core.tape.verify``); costs a fingerprint per saved
    value and a host sync per replayed value. ``probe`` (a ``timeline.StepProbe``) is told when
    each block's forward starts and ends, around each unpack, and when the block's saved values
    are freed: the memory timeline. ``plain`` and ``torch_checkpointed`` receive the names of the
    blocks a plan ran plain or under torch.utils.checkpoint. ``record``: every block records,
    none runs from a cached tape (steady state); a tape that differs from the cached one under
    the same signature is said at warning level. Timing, verifying and probing record too.
    ``offload`` (internal: a controller's steps pass one where their plan offloads): blocks
    whose plan offloads, and every block of the regions it forces, copy what they hold to host
    memory after their forward (``tapesac_core.tape.offload``); its host buffers go back to
    their pool when the trace ends.
    """
    scope = TraceScope(
        time_nodes, one_micro_batch, verify, probe, plain, torch_checkpointed, record, offload
    )
    token = TRACE.set(scope)
    try:
        yield scope.blocks
    finally:
        TRACE.reset(token)
        if offload is not None:
            offload.close()


def traced_blocks() -> list[BlockTrace] | None:
    """The list the innermost open ``trace`` collects into (it grows as blocks record), or
    None outside any: for code that sees a controller step only from outside its ``with``."""
    scope = TRACE.get()
    return scope.blocks if scope is not None else None


@contextmanager
def torch_checkpointing() -> Iterator[list[str]]:
    """Blocks run inside are not recorded: each runs under ``torch.utils.checkpoint(...,
    use_reentrant=False)`` as full checkpointing would, for steps that measure what users would
    otherwise run. Yields the names of the blocks so run."""
    names: list[str] = []
    token = TORCH_CHECKPOINTING.set(names)
    try:
        yield names
    finally:
        TORCH_CHECKPOINTING.reset(token)
