"""Replay: regenerate, during backward, only the values autograd unpacks.

One ``Replay`` serves one backward pass (one autograd graph task) of one block. At its start it
counts, for every value the replay may produce, how many times it will be read (by replayed nodes
and by autograd). On each unpack of a value that is not available it runs the value's producer
closure, stopping at available values (leaves, held values, values replayed earlier and still
live), in tape order; each replayed value is freed after its last read.

Replay never writes into a tensor it does not own (a held value, a leaf, a value still alive
elsewhere, or one already handed to autograd): such a write goes into a copy of the storage.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .._compat import raw_call
from ..errors import TapeSACError
from ..tensors import SLOT_ARGS, Meta, Slot, flat_tensors, on_storage, view_on
from .ops import rebuild_output
from .tape import ALIAS_OP, Node, layout, producer_closure, read_counts
from .verify import check_replayed, reproducible

if TYPE_CHECKING:
    from .block import Block


def _fill(a: Any, tensors: list[Any]) -> Any:
    if type(a) is Slot:
        return tensors[a.i]
    if type(a) in (list, tuple):
        return type(a)([_fill(x, tensors) for x in a])
    if type(a) is dict:
        return {k: _fill(v, tensors) for k, v in a.items()}
    return a


def _call(node: Node, tensors: list[torch.Tensor]) -> Any:
    """``node``'s op on ``tensors`` in its ``Slot``s."""
    if len(tensors) < len(SLOT_ARGS) and node.args is SLOT_ARGS[len(tensors)]:
        args = tensors  # the arguments are the inputs, in order
    else:
        args = [
            tensors[a.i]
            if type(a) is Slot
            else _fill(a, tensors)
            if type(a) is list or type(a) is tuple
            else a
            for a in node.args
        ]
    kwargs = _fill(node.kwargs, tensors) if node.kwargs else node.kwargs
    return raw_call(node.op)(*args, **kwargs)


@contextmanager
def restored_rng(rng: tuple | None) -> Iterator[None]:
    """Run with a generator set to the state it had when the op was recorded, then put it back."""
    if rng is None:
        yield
        return
    generator, state = rng
    current = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(current)


@contextmanager
def replay_mode(device_types: set[str]) -> Iterator[None]:
    """Grad off, and autocast off: the tape already holds the casts autocast made in forward.

    Only what is on is turned off: in backward grad mode is already off, autocast usually too.
    """
    with ExitStack() as stack:
        if torch.is_grad_enabled():
            stack.enter_context(torch.no_grad())
        for device_type in sorted(device_types):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def view_of_storage(base: torch.Tensor, meta: Meta) -> torch.Tensor:
    """The recorded view ``meta`` of ``base``'s storage: a view read again after a write through an alias."""
    return view_on(base.untyped_storage(), meta)


class LiveStorages:
    """A set of storages, by address, each entry dropped when its storage is freed.

    Bare addresses would outlive their storages, and the caching allocator hands a freed
    address to the next allocation: a fresh replay output would look like a tensor replay
    must not write into and get a needless copy.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        """Track ``t``'s storage until it is freed."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        ref = self._refs.get(ptr)
        if ref is None or ref() is not storage:
            self._refs[ptr] = weakref.ref(storage, _dropper(self._refs, ptr))

    def __contains__(self, t: torch.Tensor) -> bool:
        """``t`` lies on a tracked storage that is still alive."""
        storage = t.untyped_storage()
        ref = self._refs.get(storage.data_ptr())
        return ref is not None and ref() is storage

    def __len__(self) -> int:
        return len(self._refs)


def _dropper(refs: dict[int, weakref.ref], ptr: int) -> Any:
    """A weakref callback removing ``ptr``'s entry, unless a newer storage took the address."""

    def drop(ref: weakref.ref) -> None:
        if refs.get(ptr) is ref:
            del refs[ptr]

    return drop


class Replay:
    """The replay state of one block during one backward pass."""

    def __init__(self, block: Block) -> None:
        # The block keeps its replay state: a weak reference back avoids a cycle that would keep
        # every held tensor alive until the garbage collector runs.
        self.block = weakref.proxy(block)
        self.nodes, self.values, self.trace = block.nodes, block.values, block.trace
        self.timer, self.verify, self.device_types = block.timer, block.verify, block.device_types
        self.kept = block.kept
        self.draws = block.draws
        self.env: dict[int, torch.Tensor] = {}
        # Storages replay must not write into; only a tape with in-place nodes writes at all.
        self.not_ours = LiveStorages()
        self.guards_writes = block.writes_in_place
        self.unpacked: set[int] = set()  # the handles already unpacked in this backward
        # Verifying only: values not compared, since they derive from an op whose bits vary or
        # from a value that already mismatched (only the first mismatch names the hidden write).
        self.uncomparable: set[int] = set()
        self.memo = block.memo
        self._take_alive_values(block)
        # Counted here, not at the end of forward: values taken alive cut the closure.
        self.reads = self._read_counts(block)
        # Autograd reads a taken value once per pack too: released at its first unpack, a
        # value packed twice would be replayed at the second, from producers nobody counted.
        for vid in self.env:
            self.reads[vid] = self.reads.get(vid, 0) + block.pack_count.get(vid, 0)

    def _take_alive_values(self, block: Block) -> None:
        """Demanded values still alive elsewhere (e.g. a block output) are taken, not replayed."""
        for vid, (ref, version) in block.refs.items():
            t = ref()
            if t is not None and t._version == version:
                self.env[vid] = t
                if self.guards_writes:
                    self.not_ours.add(t)
                block.alive_taken.add(vid)

    def _read_counts(self, block: Block) -> dict[int, int]:
        def count() -> dict[int, int]:
            return read_counts(self.nodes, block.demand, block.pack_count, self._available)

        if self.memo is None:
            return count()
        return self.memo.reads(frozenset(self.env), count)

    def _closure(self, vid: int) -> list[int]:
        """The indices of the nodes to run for ``vid``, in tape order."""
        env = self.env
        # With nothing replayed or taken alive yet, availability is a set lookup (no frame).
        available = self._available if env else self.kept.__contains__

        def walk() -> list[int]:
            return sorted(producer_closure(self.nodes, self.values, [vid], available))

        if self.memo is None:
            return walk()
        return self.memo.closure(vid, frozenset(env), walk)

    def _available(self, vid: int) -> bool:
        return vid in self.env or vid in self.kept

    def take(self, vid: int, handle: int) -> torch.Tensor:
        """The value autograd unpacks through ``handle``; a handle's first unpack consumes a read."""
        env = self.env
        if vid not in env:
            # Wall time of the whole replay (closure walk included): what the node times the
            # planner models replay with are checked against (profile.calibrated). Host time:
            # on accelerators it is launch time until the GPU-readiness work gives it events.
            start = time.perf_counter()
            nodes = self.nodes
            with replay_mode(self.device_types):
                for index in self._closure(vid):
                    self._run(nodes[index])
            self.trace.replay_seconds += time.perf_counter() - start
        t = env[vid]
        if self.guards_writes:
            self.not_ours.add(t)
        if handle not in self.unpacked:  # ctx.saved_tensors may unpack one handle twice
            self.unpacked.add(handle)
            self._release(vid)
        return t

    def _release(self, vid: int) -> None:
        left = self.reads.get(vid, 0) - 1
        self.reads[vid] = left
        if left <= 0:
            self.env.pop(vid, None)

    def _input(self, vid: int) -> torch.Tensor:
        t = self.env.get(vid)
        if t is None:
            t = self.block.kept_tensor(vid)
            if self.guards_writes:
                self.not_ours.add(t)
        return t

    def _run(self, node: Node) -> None:
        timer = self.timer
        start = timer.start() if timer is not None else None
        try:
            outs = self._execute(node)
        except TapeSACError:
            raise
        except Exception as e:
            raise TapeSACError(
                f"block {self.block.name!r}: replaying {node.name} (call {node.k}) failed: {e}"
            ) from e
        if timer is not None:
            self.trace.node_times.setdefault(node.index, []).append(timer.stop(start))
        self.trace.replayed.append(node.index)
        if self.verify:
            self._verify(node, outs)
        reads, env = self.reads, self.env
        for vid, t in zip(node.outs, outs):
            if reads.get(vid, 0) > 0:
                env[vid] = t
        for d in node.deps:  # each read done: free a value at its last read (as _release)
            left = reads.get(d, 0) - 1
            reads[d] = left
            if left <= 0:
                env.pop(d, None)

    def _verify(self, node: Node, outs: list[torch.Tensor]) -> None:
        """Compare what the node produced with autograd's saved content (hidden writes)."""
        if not outs:
            return
        if any(d in self.uncomparable for d in node.deps) or not reproducible(
            node, outs[0].device.type
        ):
            self.uncomparable.update(node.outs)
            return
        for vid, t in zip(node.outs, outs):
            if not check_replayed(self.block, node, vid, t):
                self.uncomparable.update(node.outs)

    def _execute(self, node: Node) -> list[torch.Tensor]:
        values = self.values
        if node.name == ALIAS_OP:
            return [view_of_storage(self._input(node.deps[0]), layout(values[node.outs[0]]))]
        if node.rebuild:
            return [self._drawn(node, lambda: self._rebuild(node))]
        env = self.env
        tensors = []
        for v in node.inputs:  # a loop, not a comprehension: cheaper for an op's few inputs
            t = env.get(v)
            tensors.append(t if t is not None else self._input(v))
        for slot in node.writes:
            self._prepare_write(node, slot, tensors)
        if node.rng is None:
            out = _call(node, tensors)
        else:
            out = self._drawn(node, lambda: _call(node, tensors))
        if type(out) is torch.Tensor and not node.extra:
            return [out]
        return flat_tensors(out) + [tensors[slot] for slot in node.extra]

    def _rebuild(self, node: Node) -> torch.Tensor:
        values = self.values
        in_meta = values[node.inputs[0]].meta if node.inputs else None
        return rebuild_output(node.op, node.args, node.kwargs, values[node.outs[0]].meta, in_meta)

    def _drawn(self, node: Node, call: Callable[[], Any]) -> Any:
        """``call()`` for ``node`` from the generator state its op drew from in forward: recorded
        with the node, or read by a steady-state call's checking mode (``draws.py``)."""
        if node.rng is None:
            return call()
        state = node.rng[1] if self.draws is None else self.draws.before[node.index]
        with restored_rng((node.rng[0], state)):
            return call()

    def _prepare_write(self, node: Node, slot: int, tensors: list[torch.Tensor]) -> None:
        """Before an in-place op: never write into a tensor replay does not own; keep old content still read."""
        ptr = tensors[slot].untyped_storage().data_ptr()
        if tensors[slot] in self.not_ours:
            copy = tensors[slot].untyped_storage().clone()
            for i, t in enumerate(tensors):
                if t.untyped_storage().data_ptr() == ptr:
                    tensors[i] = on_storage(t, copy)
            return
        # Values on this storage still read later keep their content on one copy of the whole
        # storage (a copy of the view alone would lose the layout a later alias read relies on).
        reads_here = Counter(node.deps)
        keep = [
            vid
            for vid, t in self.env.items()
            if t.untyped_storage().data_ptr() == ptr and self.reads.get(vid, 0) > reads_here[vid]
        ]
        if keep:
            copy = tensors[slot].untyped_storage().clone()
            for vid in keep:
                self.env[vid] = on_storage(self.env[vid], copy)
