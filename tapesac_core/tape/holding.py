"""The holding policy while recording: which tensors a block keeps for backward, and why.

A block keeps (``block.held``, value id -> tensor) its inputs, the mandatory set S0 and the
values its plan names; every other value autograd saves is replayed from the tape in backward.
The recorder tells ``Holding`` what it recorded; ``Holding`` decides:

* S0, with the reason recorded in ``block.mandatory``: outputs of collectives
  (``COLLECTIVE``) and of ops whose output shape depends on data (``DYNAMIC_SHAPE``), which a
  replay could not reproduce without communication or a host sync; values with no recorded
  producer (``NO_PRODUCER``); and content an invisible kernel wrote (``INVISIBLE_WRITE``): an
  allocation read before any recorded write into it, a coordinate the hidden-write check named
  (``block.forced``), or such a value first packed by autograd;
* the plan: a value named by coordinate ``(op name, k, j)`` (``block.plan_coords``) or by anchored
  coordinate within a submodule (``block.plan_anchors``), unless it lies on a leaf's storage (a
  view of a parameter replays for free; holding it could pin an FSDP parameter).

Contract: what is held is detached (``tensors.detached``): nothing a block holds may keep its own
graph alive, since the graph holds the block through its unpack hook. Before forward writes into
a held value's storage, the held tensors on it move to one copy of the storage, so each keeps
the content autograd saw (``before_write``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from ..tensors import detached, flat_tensors, on_storage
from .ops import OpInfo, has_dynamic_shape
from .tape import COLLECTIVE, DYNAMIC_SHAPE, INVISIBLE_WRITE, NO_PRODUCER, OP, Mandatory
from .verify import fingerprint

if TYPE_CHECKING:
    from .block import Block

Tensor = torch.Tensor


class Holding:
    """What one recording block holds (into ``block.held``, ``block.mandatory``,
    ``block.planned``, ``block.anchored``), decided value by value as the recorder makes them.

    ``uninitialised``: storages allocated uninitialised (``empty``) and not yet written by a
    recorded op; the recorder adds them and sends every op to its checking path while any is
    pending. ``first_packed``: values already seen by ``first_pack``.
    """

    def __init__(self, block: Block, leaf_sids: Collection[int]) -> None:
        self.block = block
        self.values = block.values
        self.leaf_sids = leaf_sids  # storages of leaves (``ValueIds`` adds them as it sees them)
        self.held_by_sid: dict[int, set[int]] = {}
        self.uninitialised: set[int] = set()
        self.first_packed: set[int] = set()  # values packed while verifying or initialising
        # Held values the block read from outside (externals), each as the forward read it:
        # code after the block may write into it (``Block.watch_writes``).
        self.outside: dict[int, Tensor] = {}

    def hold(self, vid: int, t: Tensor, reason: Mandatory | None = None) -> None:
        """Keep ``t`` for backward: saved by the plan, or mandatory (``reason``)."""
        block = self.block
        block.held[vid] = detached(t)
        self.held_by_sid.setdefault(self.values[vid].sid, set()).add(vid)
        if reason is not None:
            block.mandatory.setdefault(vid, reason)

    def keep_input(self, vid: int, t: Tensor) -> None:
        """A block input: kept strongly, as torch's checkpoint keeps it (no writes reach it: the
        recorder refuses writes into leaves)."""
        self.block.held[vid] = detached(t)

    def no_producer(self, vid: int, t: Tensor) -> None:
        """A value no recorded op made (external, or written unseen): replay cannot make it."""
        self.hold(vid, t, NO_PRODUCER)
        self.outside[vid] = t

    def maybe_hold(
        self,
        func: Any,
        info: OpInfo,
        name: str,
        k: int,
        km: int,
        j: int,
        vid: int,
        t: Tensor,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """Output ``j`` of the ``k``-th call of ``name`` (``km``: its call within the current
        submodule, -1 when the plan has no anchors): held if mandatory or planned."""
        if info.collective:
            self.hold(vid, t, COLLECTIVE)
        elif info.dynamic_shape and has_dynamic_shape(func, info, args, kwargs):
            self.hold(vid, t, DYNAMIC_SHAPE)
        elif (name, k, j) in self.block.forced:
            self.hold(vid, t, INVISIBLE_WRITE)
        else:
            self.hold_if_planned(name, k, km, j, vid, t)

    def hold_if_planned(self, name: str, k: int, km: int, j: int, vid: int, t: Tensor) -> None:
        """Hold a value the plan names by coordinate ``(name, k, j)`` or, for a block whose op
        sequence turns out to differ (known only at its end), by anchored coordinate (``km``:
        the call of ``name`` within the current submodule, -1 when the plan has no anchors)."""
        block = self.block
        by_coord = (name, k, j) in block.plan_coords
        by_anchor = km >= 0 and (block.current_module or "", name, km, j) in block.plan_anchors
        if not (by_coord or by_anchor):
            return
        if by_coord:
            block.planned_seen.add((name, k, j))
        if self.values[vid].sid in self.leaf_sids:
            return  # a view of a leaf is replayed for free; saving it could pin an FSDP parameter
        self.hold(vid, t)
        if by_coord:
            block.planned.add(vid)
        if by_anchor:
            block.anchored.add(vid)

    def before_write(self, storage: torch.UntypedStorage, sid: int) -> None:
        """A recorded op is about to write ``storage`` (storage id ``sid``): held values on it
        move to one copy of it (content kept), and it is no longer uninitialised."""
        held = self.block.held
        ptr = storage.data_ptr()
        on_it = [
            h
            for h in self.held_by_sid.get(sid, ())
            if h in held and held[h].untyped_storage().data_ptr() == ptr
        ]
        if on_it:
            copy = storage.clone()
            for h in on_it:
                held[h] = on_storage(held[h], copy)
        self.uninitialised.discard(sid)

    def check_initialised(
        self, args: tuple, kwargs: dict, inputs: list[int], writes: tuple[int, ...]
    ) -> None:
        """A recorded read of a never-written allocation: an invisible kernel filled it."""
        for slot, t in enumerate(flat_tensors((args, kwargs))):
            vid = inputs[slot]
            if slot not in writes and self.values[vid].sid in self.uninitialised:
                self.hold(vid, t, INVISIBLE_WRITE)

    def first_pack(self, vid: int, t: Tensor) -> None:
        """A value's first pack while verifying, or while an uninitialised allocation is pending
        (a value first packed before that lies on an older storage, which needs no holding)."""
        self.first_packed.add(vid)
        block = self.block
        value = self.values[vid]
        if value.kind != OP or vid in block.held:
            return
        if block.verify:
            block.fingerprints[vid] = fingerprint(t)
        if self.uninitialised and value.sid in self.uninitialised:
            self.hold(vid, t, INVISIBLE_WRITE)
