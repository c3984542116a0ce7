"""Offloading what blocks hold for backward: copied to host memory at the end of a block's
forward, copied back ahead of its backward (issue 42's mechanism). A plan chooses the blocks that
offload (``RegionPlan.offloaded``, ``plan/offload_choice.py``); an ``Offload`` given to ``trace``
with regions forces it for every block of those regions (tests reach the mechanism on CPU so).

Contract. At the end of a block's forward (recorded or steady state, not a diverged call, whose
backward runs the forward again and holds nothing), every value the block holds that an op made
(the plan's saved values and S0; not its inputs, parameters or buffers) is offloaded, storage by
storage: the whole storage is copied once into a host buffer of the step's ``HostPool``, and the
block keeps each value's layout on it instead of the tensor, so the device storage is freed. When
the next block's forward starts, the block offloads what only it holds by then: its inputs (its
caller has handed the next block its output and let go of them), and values it made that were
alive outside at its end; the copies run while that block computes. A storage also alive outside
what the block holds (the block's output, a tensor the caller keeps, an input every block shares)
stays: copying it would free nothing, and a later in-place write into it would race the copy.
The block's own tensors on a storage are those it holds and those it watches for writes after
its forward (``Block.own_tensors``); nothing else can write into a storage only they hold, so an
offloaded value is not watched any more (``Block.let_go``). Values with the conjugate or negative
bit, which a layout does not carry, stay too. At the block's first unpack in backward its storages
are back on the device, each value a view of its layout, bitwise what was copied; the block
before it in forward order (the next in backward) starts its copy back then, so one block's
copies run ahead of its backward. A block that keeps its values tells the step at its first
unpack all the same (``kept``; a block run plain or under torch's checkpoint, as the first of its
outputs' nodes runs, ``watch_outputs``), so the block before it starts its copy back then too.
Backward is taken to run in reverse forward order: a step that runs a later model's backward
first (two backward calls, ``autograd.grad`` of an intermediate) brings the block before back all
the same, and it stays on the device until its own backward, above what the peak model counts.
A value written after the forward (through the block's input or output) stays: backward refuses
it, as without offload. The restored storages are the block's alone: they go with its held
values. Host buffers return to the pool once copied back, when the block is freed without a
backward, and, every buffer still out, when the step ends (``close``), a failed step included;
an unpack after that is an error.

Ordering on accelerators. Copies run on a side stream of their own (not FSDP2's, not the compute
stream): a copy out waits on an event recorded on the compute stream after the block's forward,
and the device tensor it reads is kept until the copy's event completes; a copy back writes into
memory allocated on the compute stream after that stream's event, and the compute stream waits
on the copy's event before the block's backward reads it. Each device storage a copy reads or
writes is marked used by the side stream (``record_stream``), so the allocator does not hand it
out again before the copy completes, whenever the block lets go of it. Nothing waits on a
whole-device synchronize. On CPU there is no separate host memory and no stream: copies are
synchronous (the mechanism runs, and is tested, there; plans on CPU will never offload).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from .._compat import storage_use_count
from ..errors import TapeSACError
from ..tensors import Meta, layout_of, view_on
from .host_pool import HostPool
from .tape import INPUT, OP, ValueKind

if TYPE_CHECKING:
    from .block import Block

Tensor = torch.Tensor


class Offload:
    """One step's offloaded values, in buffers of ``pool``: of the blocks whose plan offloads,
    and of every block of ``regions`` (None: every region; forced). ``bytes`` counts what the
    step copied out."""

    def __init__(self, pool: HostPool, regions: frozenset[str] | None = None) -> None:
        self.pool = pool
        self.regions = regions
        self.bytes = 0
        self._blocks: list[OffloadedBlock] = []  # in forward order
        self._started = 0  # blocks whose forward started in the step, offloading or not
        self._at: dict[int, OffloadedBlock] = {}  # by the block's position among them
        self._copies: dict[torch.device, _Copies] = {}
        self._hooks: list[RemovableHandle] = []  # on nodes of blocks run plain: gone at close

    def store(self, block: Block, *, planned: bool = False) -> None:
        """End of ``block``'s forward: offload the values it holds that ops made, where its plan
        offloads (``planned``) or its region is forced; elsewhere its first unpack starts the
        copy back of the block before it."""
        if not planned and self.regions is not None and block.region not in self.regions:
            self.kept(block)
            return
        record = OffloadedBlock(self, block, self._started - 1)
        # Known before any copy: a failed one leaves what was copied restorable and releasable.
        self._blocks.append(record)
        self._at[record.position] = record
        block.offloaded = record
        weakref.finalize(block, record.release)  # a block freed without its backward
        record.copy_held(block, (OP,))

    def kept(self, block: Block) -> None:
        """``block``, the latest started, offloads nothing: its first unpack starts the copy
        back of the block before it."""
        block.backward_started = self._latest_started_backward()

    def watch_outputs(self, outputs: Sequence[Tensor]) -> None:
        """The latest started block ran plain or under torch's checkpoint (no unpack of ours):
        its backward's start (the first of its outputs' autograd nodes to run) starts the copy
        back of the block before it. A hook on the node, not on the tensor: a tensor's hook would
        stay on a leaf for good, and fire for ``autograd.grad`` of the output, where the block's
        backward does not run. An output written in place after (its node replaced) or returned
        unchanged (the node is not the block's) starts nothing: that block copies back at its own
        first unpack."""
        started = self._latest_started_backward()
        nodes = {t.grad_fn for t in outputs if t.grad_fn is not None}
        self._hooks.extend(node.register_prehook(lambda _: started()) for node in nodes)

    def _latest_started_backward(self) -> Callable[[], None]:
        """``started_backward`` for the block whose forward started last."""
        return functools.partial(self.started_backward, self._started - 1)

    def next_started(self) -> None:
        """A block's forward starts (every block's, offloading or not): the block just before it
        offloads what only it holds now, its inputs among them (its caller has let go of them:
        this block has its output). Only that block: the peak model counts an offloading block
        on the device until the next block's forward is done."""
        before = self._at.get(self._started - 1)
        self._started += 1
        if before is not None and before.state is State.ON_HOST:
            block = before.block()
            if block is not None:
                before.copy_held(block, (OP, INPUT))

    def copies(self, device: torch.device) -> _Copies | None:
        """The side stream of ``device``'s copies; None on CPU (copies are synchronous)."""
        if device.type == "cpu":
            return None
        if device not in self._copies:
            self._copies[device] = _Copies(device)
        return self._copies[device]

    def started_backward(self, position: int) -> None:
        """The block at ``position`` started its backward (its first unpack), offloading or not:
        the block just before it in forward order, where it offloaded and its values are still
        on the host, starts its copy back (one block ahead, as the peak model counts it)."""
        record = self._at.get(position - 1)
        if record is not None and record.state is State.ON_HOST:
            record.copy_back()

    def close(self) -> None:
        """The step ended: every host buffer still out returns to the pool; a later unpack of
        an offloaded value is an error."""
        for record in self._blocks:
            record.release()
        for hook in self._hooks:
            hook.remove()
        self._blocks, self._at, self._hooks = [], {}, []


class State(Enum):
    """Where a block's offloaded values are."""

    ON_HOST = "on host"
    COMING_BACK = "coming back"  # copies back issued, not yet taken by the block
    RESTORED = "restored"  # in the block's held values again
    RELEASED = "released"  # the step ended (or the block was freed) first


@dataclass
class _Stored:
    """One storage copied out: its host buffer (None once given back to the pool), its bytes,
    its device and the layouts of the values the block holds on it."""

    buffer: Tensor | None
    nbytes: int
    device: torch.device
    values: list[tuple[int, Meta]]


class OffloadedBlock:
    """What one block offloaded and where it is (``state``); coming back, the device storages
    and the copies' event."""

    def __init__(self, offload: Offload, block: Block, position: int) -> None:
        self.offload, self.position, self.name = offload, position, block.name
        self.block = weakref.ref(block)  # the block holds its record: no cycle
        self.state = State.ON_HOST
        self._stored: list[_Stored] = []
        self._back: list[torch.UntypedStorage] = []
        self._event: torch.Event | None = None

    def copy_held(self, block: Block, kinds: tuple[ValueKind, ...]) -> None:
        """Copy out every storage of ``block``'s held values of ``kinds`` that nothing else
        holds, and let go of those values."""
        for values in _storages(block, kinds):
            self.copy_out(block.held[values[0]], [(v, layout_of(block.held[v])) for v in values])
            for vid in values:
                block.let_go(vid)

    def copy_out(self, tensor: Tensor, values: list[tuple[int, Meta]]) -> None:
        """Copy ``tensor``'s whole storage to a host buffer; ``values``: the held values on it."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        buffer = self.offload.pool.take(nbytes)
        source = _bytes_of(storage, tensor.device)
        copies = self.offload.copies(tensor.device)
        try:
            if copies is None:
                buffer[:nbytes].copy_(source)
            else:
                with copies.after_compute() as stream:
                    buffer[:nbytes].copy_(source, non_blocking=True)
                source.record_stream(stream)  # not reused before the copy read it
                self._event = copies.done()
        except BaseException:
            self.offload.pool.give(buffer)  # the values stay held
            raise
        self._stored.append(_Stored(buffer, nbytes, tensor.device, values))
        self.offload.bytes += nbytes

    def copy_back(self) -> None:
        """Start copying every stored storage back to its device (synchronous on CPU)."""
        for stored in self._stored:
            assert stored.buffer is not None
            target = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            copies = self.offload.copies(stored.device)
            if copies is None:
                target.copy_(stored.buffer[: stored.nbytes])
            else:
                with copies.after_compute() as stream:  # the target's memory was compute's
                    target.copy_(stored.buffer[: stored.nbytes], non_blocking=True)
                target.record_stream(stream)  # not reused before the copy wrote it
                self._event = copies.done()
            self._back.append(target.untyped_storage())
            self._give(stored)
        self.state = State.COMING_BACK

    def restore(self, block: Block) -> None:
        """``block``'s first unpack: its values back in ``block.held``, and the block before it
        starting its copy back."""
        if self.state is State.RELEASED:
            raise TapeSACError(
                f"block {self.name!r}: its backward ran after the step (trace) it ran its forward "
                "in had ended, and the values offloaded to host memory were given back then. "
                "Fix: run the backward inside the same step"
            )
        if self.state is State.ON_HOST:
            self.copy_back()
        if self._event is not None:
            torch.accelerator.current_stream(self._stored[0].device).wait_event(self._event)
        for stored, storage in zip(self._stored, self._back):
            for vid, meta in stored.values:
                block.held[vid] = view_on(storage, meta)
        block.offloaded = None
        self.state, self._stored, self._back = State.RESTORED, [], []
        self.offload.started_backward(self.position)

    def release(self) -> None:
        """The step ended, or the block was freed, before its values were taken back: host
        buffers still out go back to the pool (after the last copy, on accelerators)."""
        if self.state is State.RESTORED or self.state is State.RELEASED:
            return
        for stored in self._stored:
            self._give(stored)
        self.state, self._stored, self._back = State.RELEASED, [], []

    def _give(self, stored: _Stored) -> None:
        if stored.buffer is not None:
            self.offload.pool.give(stored.buffer, self._event)
            stored.buffer = None


class _Copies:
    """``device``'s side stream for copies, ordered against its compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.Stream(device=device)

    def after_compute(self) -> torch.Stream:
        """The side stream, made to wait for what the compute stream has issued so far."""
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        return self.stream

    def done(self) -> torch.Event:
        """An event after the copies issued on the side stream so far."""
        return self.stream.record_event()


def alone_bytes(block: Block, kinds: tuple[ValueKind, ...]) -> int:
    """Bytes of the storages ``block`` would offload now of its held values of ``kinds``."""
    held = block.held
    return sum(held[values[0]].untyped_storage().nbytes() for values in _storages(block, kinds))


def _storages(block: Block, kinds: tuple[ValueKind, ...]) -> list[list[int]]:
    """The held values to offload, grouped by storage: storages whose every held value is of
    ``kinds`` (an op's output, a block input), without the conjugate or negative bit, that
    nothing but those values holds."""
    groups: dict[int, list[int]] = {}
    stays: set[int] = set()
    values = block.values
    for vid, t in block.held.items():
        key = t.untyped_storage().data_ptr()
        # A value written after the forward stays: backward's check of the write must see it.
        if (
            values[vid].kind in kinds
            and not (t.is_conj() or t.is_neg())
            and not block.written_since_forward(vid)
        ):
            groups.setdefault(key, []).append(vid)
        else:
            stays.add(key)
    held = block.held
    return [
        vids
        for key, vids in groups.items()
        if key not in stays and _held_only(held[vids[0]].untyped_storage(), block.own_tensors(vids))
    ]


def _held_only(storage: torch.UntypedStorage, own: int) -> bool:
    """Whether ``storage`` (not empty) is referenced by the block's ``own`` tensors on it alone:
    its use count counts them and the Python storage objects alive, here ``storage`` itself."""
    return storage.nbytes() > 0 and storage_use_count(storage) == own + 1


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """``storage``'s bytes as a uint8 tensor on it."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
