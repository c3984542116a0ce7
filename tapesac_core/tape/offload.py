"""Offloading what blocks hold for backward: copied to host memory at the end of a block's
forward, copied back ahead of its backward (issue 42's mechanism; the planner does not choose
offload yet, an ``Offload`` given to ``trace`` forces it).

Contract. At the end of a block's forward (recorded or steady state, not a diverged call, whose
backward runs the forward again and holds nothing), every value the block holds that an op made
(the plan's saved values and S0; not its inputs, parameters or buffers) is offloaded, storage by
storage: the whole storage is copied once into a host buffer of the step's ``HostPool``, and the
block keeps each value's layout on it instead of the tensor. The device storage is freed with
the block's last reference to it (a storage also alive elsewhere, such as the block's output,
frees nothing). At the block's first unpack in backward its storages are back on the device, each
value a view of its layout, bitwise what was copied; the block before it in forward order (the
next in backward) starts its copy back then, so one block's copies run ahead of its backward. A
block whose copy back did not start early (models whose backward does not run in reverse forward
order) copies at its first unpack. Host buffers return to the pool once copied back, and every
buffer still out returns when the step ends (``close``); an unpack after that is an error.

Ordering on accelerators. Copies run on a side stream of their own (not FSDP2's, not the compute
stream): a copy out waits on an event recorded on the compute stream after the block's forward,
and the device tensor it reads is kept until the copy's event completes; a copy back writes into
memory allocated on the compute stream after that stream's event, and the compute stream waits
on the copy's event before the block's backward reads it. Nothing waits on a whole-device
synchronize. On CPU there is no separate host memory and no stream: copies are synchronous (the
mechanism runs, and is tested, there; plans on CPU will never offload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import TapeSACError
from ..tensors import Meta, layout_of, view_on
from .host_pool import HostPool
from .tape import OP

if TYPE_CHECKING:
    from .block import Block

Tensor = torch.Tensor


class Offload:
    """One step's offloaded values, for the blocks of ``regions`` (None: every region), in
    buffers of ``pool``. ``bytes`` counts what the step copied out."""

    def __init__(self, pool: HostPool, regions: frozenset[str] | None = None) -> None:
        self.pool = pool
        self.regions = regions
        self.bytes = 0
        self._blocks: list[OffloadedBlock] = []  # in forward order
        self._copies: dict[torch.device, _Copies] = {}
        self._closed = False

    def store(self, block: Block) -> None:
        """End of ``block``'s forward: offload the values it holds that ops made."""
        if self.regions is not None and block.region not in self.regions:
            return
        for earlier in self._blocks:
            earlier.settle()
        groups = _storages(block)
        if not groups:
            return
        record = OffloadedBlock(self, block, len(self._blocks))
        for values in groups:
            tensor = block.held[values[0]]
            record.copy_out(tensor, [(vid, layout_of(block.held[vid])) for vid in values])
            for vid in values:
                del block.held[vid]
        block.offloaded = record
        self._blocks.append(record)

    def copies(self, device: torch.device) -> _Copies | None:
        """The side stream of ``device``'s copies; None on CPU (copies are synchronous)."""
        if device.type == "cpu":
            return None
        if device not in self._copies:
            self._copies[device] = _Copies(device)
        return self._copies[device]

    def started_backward(self, index: int) -> None:
        """The block stored ``index``-th started its backward: the latest block stored before
        it whose values are still on the host starts its copy back."""
        for record in reversed(self._blocks[:index]):
            if record.on_host:
                record.copy_back()
                return

    def close(self) -> None:
        """The step ended: every host buffer still out returns to the pool; a later unpack of
        an offloaded value is an error."""
        self._closed = True
        for record in self._blocks:
            record.release()
        self._blocks = []

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass
class _Stored:
    """One storage copied out: its host buffer, its bytes, its device and the layouts of the
    values the block holds on it."""

    buffer: Tensor
    nbytes: int
    device: torch.device
    values: list[tuple[int, Meta]]


class OffloadedBlock:
    """What one block offloaded, and the state of its copies: on the host, on the way back
    (``_back``: the device storages and the copies' event), restored, or released at the step's
    end."""

    def __init__(self, offload: Offload, block: Block, index: int) -> None:
        self.offload, self.index, self.name = offload, index, block.name
        self.stored: list[_Stored] = []
        self._back: tuple[list[torch.UntypedStorage], torch.Event | None] | None = None
        self._pending: list[tuple[Tensor, torch.Event]] = []  # device tensors copies still read
        self.released = False

    @property
    def on_host(self) -> bool:
        return self._back is None and not self.released

    def copy_out(self, tensor: Tensor, values: list[tuple[int, Meta]]) -> None:
        """Copy ``tensor``'s whole storage to a host buffer; ``values``: the held values on it."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        buffer = self.offload.pool.take(nbytes)
        source = _bytes_of(storage, tensor.device)
        copies = self.offload.copies(tensor.device)
        if copies is None:
            buffer[:nbytes].copy_(source)
        else:
            with copies.after_compute():
                buffer[:nbytes].copy_(source, non_blocking=True)
            self._pending.append((source, copies.done()))  # freed once the copy read it
        self.stored.append(_Stored(buffer, nbytes, tensor.device, values))
        self.offload.bytes += nbytes

    def settle(self) -> None:
        """Let go of the device tensors whose copies out have completed: their memory is free
        once nothing else holds them."""
        self._pending = [(t, event) for t, event in self._pending if not event.query()]

    def copy_back(self) -> None:
        """Start copying every stored storage back to its device (synchronous on CPU)."""
        storages, event = [], None
        for stored in self.stored:
            target = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            copies = self.offload.copies(stored.device)
            if copies is None:
                target.copy_(stored.buffer[: stored.nbytes])
                self.offload.pool.give(stored.buffer)
            else:
                with copies.after_compute():  # the target's memory was the compute stream's
                    target.copy_(stored.buffer[: stored.nbytes], non_blocking=True)
                event = copies.done()
                self.offload.pool.give(stored.buffer, event)
            storages.append(target.untyped_storage())
        self._back = (storages, event)
        self._pending = []

    def restore(self, block: Block) -> None:
        """``block``'s first unpack: its values back in ``block.held``, and the block before it
        starting its copy back."""
        if self.released:
            raise TapeSACError(
                f"block {self.name!r}: its backward ran after the step (trace) it ran its forward "
                "in had ended, and the values offloaded to host memory were given back then. "
                "Fix: run the backward inside the same step"
            )
        if self._back is None:
            self.copy_back()
        assert self._back is not None
        storages, event = self._back
        if event is not None:
            torch.accelerator.current_stream(self.stored[0].device).wait_event(event)
        for stored, storage in zip(self.stored, storages):
            for vid, meta in stored.values:
                block.held[vid] = view_on(storage, meta)
        block.offloaded = None
        self.stored = []
        self.offload.started_backward(self.index)

    def release(self) -> None:
        """The step ended: buffers still holding values go back to the pool."""
        if self._back is None:
            for stored in self.stored:
                self.offload.pool.give(stored.buffer, _event_of(self._pending))
        self.stored, self._pending, self._back = [], [], None
        self.released = True


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


def _storages(block: Block) -> list[list[int]]:
    """The held values to offload, grouped by storage: storages whose every held value an op
    made (a storage shared with an input stays, with all its values)."""
    groups: dict[int, list[int]] = {}
    stays: set[int] = set()
    values = block.values
    for vid, t in block.held.items():
        key = t.untyped_storage().data_ptr()
        if values[vid].kind == OP and t.untyped_storage().nbytes() > 0:
            groups.setdefault(key, []).append(vid)
        else:
            stays.add(key)
    return [vids for key, vids in groups.items() if key not in stays]


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """``storage``'s bytes as a uint8 tensor on it."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _event_of(pending: list[tuple[Tensor, torch.Event]]) -> torch.Event | None:
    """The last pending copy's event: the side stream runs copies in order."""
    return pending[-1][1] if pending else None
