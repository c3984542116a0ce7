"""Recording: a dispatch mode that writes each op of a block into its tape, and the pack hook.

``Recorder`` is the block's ``TorchDispatchMode`` while its forward runs, and its saved-tensor
pack hook. Per op it makes the node (op, call number ``k``, arguments with tensors replaced by
``Slot``s, input and output value ids, writes, the random state it drew from) and the values of
its outputs; it asks ``ValueIds`` (``values.py``) which value each input is, and tells
``Holding`` (``holding.py``) each output, which it keeps if S0 or the plan names it. Per pack it
records the packed value in the demand set.

Contract (what makes replay exact): every tensor the block touches has a value id, a tensor's
content at one version (``values.py``); an output shares the storage id of an input it aliases
(a view, an in-place result), else has a storage of its own, and a view shares its base's
version; a random op's generator state is captured before it runs, and replay restores it.

One implementation records every op: ``_record`` (arguments, writes, random state, timing) then
``_add_node`` (outputs, holding, the node). The fast path in ``__torch_dispatch__`` is
``_record`` for an op that is plain or a simple view (``OpInfo``) while nothing is timed and no
allocation awaits its first write: of ``_record``'s steps only templating, the call and
``_add_node`` apply to such an op, and it runs just those. ``tests/test_recording_paths.py``
records the same blocks both ways (``Recorder.fast_path``) and compares the tapes.

Failure modes that raise ``TapeSACError``: an op writing into a block input, parameter or buffer;
a random op whose generator cannot be captured; a tensor subclass inside the block.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .._compat import DispatchModeWithoutDynamoGuard, dispatch_disabled, torch_function_disabled
from ..errors import TapeSACError
from ..measure.memory import not_counted
from ..tensors import (
    Meta,
    default_generator,
    flat_tensors,
    has_default_generator,
    is_subclass_with_dispatch,
    view_on,
)
from .holding import Holding
from .op_checks import OpLog, Sources
from .ops import OpInfo, arg, is_random_call, op_info
from .steady import PackLog
from .tape import BUFFER, INPUT, OP, PARAM, Node, Value
from .values import ValueIds, refuse_layout, where

if TYPE_CHECKING:
    from .block import Block

Tensor = torch.Tensor

_new_tuple = tuple.__new__  # skips NamedTuple's Python-level __new__ for every node and value


class Recorder(DispatchModeWithoutDynamoGuard):
    """Records one block's forward into ``block``'s tape (as a dispatch mode); also provides
    the pack hook (``pack``), the submodule exit hook (``module_exit``) and, at the end of
    forward, ``vid_of`` for the block's outputs and ``alive`` for ``Block.finish``."""

    # False: every op takes ``_record`` (tests compare the tapes of both paths).
    fast_path: ClassVar[bool] = True

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block
        self.calls: dict[str, int] = {}  # op name -> calls so far: a node's ``k``
        leaf_sids: set[int] = set()  # ValueIds adds the storages of leaves; Holding reads them
        self.holding = Holding(block, leaf_sids)
        self.ids = ValueIds(block, self.holding, self.calls, leaf_sids)
        # The same set object as the holding policy's (never rebound): checked on every op.
        self.uninitialised = self.holding.uninitialised
        self.timer = block.timer  # set before recording when node times are wanted
        # Whether the fast path may record this block's ops: nothing is timed (fixed for the
        # block). A planned block's ops take it too: on the checking path a plan's forward cost
        # more than its replay saved, on many small ops.
        self.fast = self.fast_path and block.timer is None
        # OpOverload hashes in Python: look ops up by id (they live as long as the process).
        self.infos: dict[int, OpInfo] = {}
        self.hot: dict[int, OpInfo] = {}  # the ops of ``infos`` the fast path records
        self.log = PackLog()  # what steady-state calls check and bind at their packs
        self.ops: OpLog | None = None  # what a module block's steady-state calls check
        self.call_sources: Sources | None = None  # where its calls' log knows tensors from
        # The last op's writes, each (tensor, its version before, its values before and after,
        # the packs so far), until ``settle_writes`` sees whether autograd bumped the version.
        self.pending_writes: list[tuple[Tensor, int, int, int, int]] = []
        # Per pack, the tensor autograd saved, the base it is a view of (which shares its
        # version counter), its version and ``where`` it was then: what it reads in backward
        # if no write bumps that version (``settle_writes``) and no ``.data =`` moves it
        # (``settle_swaps``); and the packs on each storage.
        self.packed: list[tuple[weakref.ref[Tensor], weakref.ref[Tensor] | None, int, tuple]] = []
        self.packs_on: dict[int, list[int]] = {}
        self.moved = False  # a pack's tensor moved to other bytes (``settle_swaps``)

    def forget(self) -> None:
        """The forward ended: drop the per-tensor bookkeeping. Autograd keeps the pack hook,
        and with it this recorder, until the block's graph is freed."""
        self.ids.by_id.clear()
        self.ids.ptrs.clear()
        self.infos.clear()
        self.hot.clear()

    def vid_of(self, t: Tensor) -> int:
        """The value id of ``t`` as it is now (``ValueIds.vid_of``): the block's outputs."""
        return self.ids.vid_of(t)

    def register_inputs(self, tensors: list[Tensor]) -> None:
        """Block inputs are leaves, kept strongly (as torch's checkpoint keeps them)."""
        ids = self.ids
        for t in tensors:
            ids.refuse_unsupported(t)
        if self.block.module is not None:
            self.ops = OpLog(tensors, self.block.module)
        for i, t in enumerate(tensors):
            entry = ids.by_id.get(id(t))
            if entry is None or entry[0]() is not t:
                self.holding.keep_input(ids.new_value(t, -1, 0, INPUT, i), t)

    def pack(self, t: Tensor) -> int:
        """Autograd saves ``t``: record it in the demand set and hand autograd a handle (the
        pack's index in ``block.handles``)."""
        # Unseen by the call log, whose mode is on where a custom ``autograd.Function`` saves
        # (no torch function runs then): its reads (``t._base``) are bookkeeping, not calls.
        with torch_function_disabled():
            return self._pack(t)

    def _pack(self, t: Tensor) -> int:
        if self.pending_writes:  # autograd packs an op's inputs before the op dispatches
            self.settle_writes()
        block = self.block
        entry = self.ids.by_id.get(id(t))  # ValueIds.recorded, inlined: runs per saved tensor
        if (
            entry is not None
            and entry[0]() is t
            and entry[2] == t._version
            and entry[3] == where(t)
        ):
            vid = entry[1]
        else:
            vid = self.ids.vid_of(t)
        # A recording block's handles are a list (a steady one's a tuple); no cast(): a call.
        handles: list[int] = block.handles  # type: ignore[assignment]
        handles.append(vid)
        base = t._base
        self.packed.append(
            (weakref.ref(t), None if base is None else weakref.ref(base), t._version, where(t))
        )
        self.packs_on.setdefault(self.ids.values[vid].sid, []).append(len(handles) - 1)
        log = self.log
        if self.ops is not None:
            calls = self.call_sources
            log.sources.append(
                (None if calls is None else calls.pack_key(t), self.ops.sources.pack_key(t))
            )
        log.layouts.append((t.shape, t.dtype))
        log.views.append((t.stride(), t.storage_offset()))  # type: ignore[arg-type]  # eager: int
        holding = self.holding
        if (block.verify or self.uninitialised) and vid not in holding.first_packed:
            holding.first_pack(vid, t)
        return len(handles) - 1

    def module_exit(self, output: Any) -> None:
        """A submodule returned ``output``: the values of its tensors, where recorded, are what a
        steady-state call can hold from that exit (values on their storages)."""
        self.log.exit_packs.append(len(self.block.handles))
        self.block.exits.append(
            tuple((self.ids.recorded(t), (t.shape, t.dtype)) for t in flat_tensors(output))
        )

    def alive(self, vids: Collection[int]) -> dict[int, tuple[weakref.ref[Tensor], int]]:
        """A weak reference per value of ``vids`` whose tensor is alive now (a block output,
        say): backward takes it as it is, if still alive there, instead of replaying it.

        Collected once at the end of forward rather than at each pack, so that the pack hook,
        run per saved tensor, stays short. Only a tensor that still has the value's version
        counts: an alias seen by storage (``x.data``) has a counter of its own."""
        refs: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        values = self.ids.values
        for ref, vid, _, at in self.ids.by_id.values():
            if vid in vids and vid not in refs:
                t = ref()
                if t is not None and t._version == values[vid].version and where(t) == at:
                    refs[vid] = (ref, values[vid].version)
        return refs

    # ------------------------------------------------------------------ dispatch: per op

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.pending_writes:
            self.settle_writes()
        info = self.hot.get(id(func))
        if info is None or self.uninitialised:
            info = self.infos.get(id(func)) or self._info(func)
            return self._record(func, info, args, kwargs)
        # The fast path: ``_record`` for an op in ``hot`` (plain or a simple view, nothing
        # timed, no allocation pending), whose other steps provably do nothing for it: it is
        # neither unrecorded, collective nor an identity; it writes nothing, draws no random
        # number and reads more than metadata.
        targs, tkwargs, inputs = self.ids.arguments(args, kwargs)
        out = info.call(*args, **kwargs)
        index = self._add_node(func, info, targs, tkwargs, inputs, (), None, out, args, kwargs)
        if self.ops is not None:
            self.ops.op(func, args, kwargs, out, index, (targs, tkwargs), True)
        return out

    def _record(self, func: Any, info: OpInfo, args: tuple, kwargs: dict) -> Any:
        """Record one op: every op the fast path in ``__torch_dispatch__`` does not take (not
        plain nor a simple view, or any op while timing or while an allocation is pending)."""
        if info.unrecorded or (info.collective and not self._reads_recorded(args, kwargs)):
            if self.ops is not None:
                self.ops.pass_over(func)
            return func(*args, **kwargs)
        if info.identity:
            return self._same_value(func, args, kwargs)
        if info.retargets:
            self._refuse_retarget(func)
        targs, tkwargs, inputs = self.ids.arguments(args, kwargs)
        mutated = self._mutated_tensors(info, args, kwargs) if info.mutated else []
        writes = self._before_write(func, info, mutated, inputs) if mutated else ()
        versions = [t._version for t in mutated]
        rng = (
            self._capture_rng(info, args, kwargs)
            if info.random
            and is_random_call(info, args, kwargs)
            and not (info.unannounced and info.qualname in self.block.deterministic_ops)
            else None
        )
        if info.metadata_only and inputs:
            self._keep_meta(inputs[0], args[0])
        timer = self.timer
        if timer is None:
            out = func(*args, **kwargs)
        else:
            start = timer.start()
            out = func(*args, **kwargs)
            sample = timer.stop(start)
        if self.uninitialised and not info.metadata_only and not info.aliasing:
            self.holding.check_initialised(args, kwargs, inputs, writes)
        index = self._add_node(func, info, targs, tkwargs, inputs, writes, rng, out, args, kwargs)
        if writes:
            by_id, n = self.ids.by_id, len(self.block.handles)
            self.pending_writes = [
                (t, version, inputs[slot], by_id[id(t)][1], n)
                for slot, t, version in zip(writes, mutated, versions)
            ]
        if self.ops is not None:
            inert = not info.random and not info.mutated
            self.ops.op(func, args, kwargs, out, index, (targs, tkwargs), inert)
        if timer is not None and index >= 0:
            self.block.trace.forward_times[index] = sample
        return out

    def _same_value(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """``detach``-like ops return the same content, storage and layout: no node, same value.

        Autograd dispatches such ops on its own (``make_variable`` detaches a factory function's
        result when the recorder holds it); recording them would make the op sequence, and every
        plan coordinate after it, depend on what the plan saves.
        """
        vid = self.ids.vid_of(args[0])
        out = func(*args, **kwargs)
        self.ids.same_as(out, vid)
        if self.ops is not None:
            self.ops.same(func, out, args[0])
        return out

    def _info(self, func: Any) -> OpInfo:
        info = self.infos[id(func)] = op_info(func)
        if self.fast and (info.plain or info.simple_view):
            self.hot[id(func)] = info
        return info

    def _keep_meta(self, vid: int, t: Tensor) -> None:
        """A metadata-only op's input: its layout is what replay rebuilds from."""
        values = self.ids.values
        value = values[vid]
        if value.meta is None:
            values[vid] = value._replace(meta=self.ids.layout(t))

    def _reads_recorded(self, args: tuple, kwargs: dict) -> bool:
        """FSDP's collectives move FSDP's own buffers; user collectives read recorded values."""
        by_id = self.ids.by_id
        for t in flat_tensors((args, kwargs)):
            entry = by_id.get(id(t))
            if entry is not None and entry[0]() is t:
                return True
        return False

    def _mutated_tensors(self, info: OpInfo, args: tuple, kwargs: dict) -> list[Tensor]:
        if info.writes_if is not None and not arg(args, kwargs, *info.writes_if):
            return []
        return [
            t
            for position, name in info.mutated
            for t in flat_tensors(arg(args, kwargs, position, name))
        ]

    def _before_write(
        self, func: Any, info: OpInfo, mutated: list[Tensor], inputs: list[int]
    ) -> tuple[int, ...]:
        """Refuse writes into leaves; move held values the write into ``mutated`` would change.
        Returns slots written."""
        ids = self.ids
        slots = []
        for t in mutated:
            vid = ids.vid_of(t)
            slots.append(inputs.index(vid))
            sid = ids.values[vid].sid
            if sid in ids.leaf_sids:
                self._refuse_leaf_write(func, info, sid)
            self.holding.before_write(t.untyped_storage(), sid)
            ids.epochs[sid] = ids.epochs.get(sid, 0) + 1
        return tuple(slots)

    def settle_writes(self) -> None:
        """Works around writes that leave a version counter as it was, so that autograd unpacks
        what they wrote without an error: kernels that bump none (``aten.rrelu_with_noise``
        fills ``noise``, which autograd saved before the op ran), and a write through a tensor
        with a counter of its own (``h.data.clamp_()`` after ``h`` was saved). Every tensor
        still on the written storage whose counter the write left while it changed its bytes
        now holds the written content: a value read again (an alias of the write,
        ``ValueIds.reread``), and the packs made before stand for the written content too.
        Seen at the next op or pack, or the end of forward: inside the dispatch mode, the
        autograd layer above has not bumped any version yet."""
        pending, self.pending_writes = self.pending_writes, []
        ids = self.ids
        values, by_id = ids.values, ids.by_id
        for t, version, old, new, packed in pending:
            unbumped = t._version == version
            if unbumped:
                values[new] = values[new]._replace(version=version)
                ids.register(t, new, version)
            sid = values[old].sid
            written = _extent(t)
            for key in list(ids.on_storage.get(sid, ())):
                entry = by_id.get(key)
                other = entry[0]() if entry is not None else None
                if (
                    entry is not None
                    and other is not None
                    and other is not t
                    and values[entry[1]].sid == sid
                    and other._version == entry[2]
                    and where(other) == entry[3]  # not moved off it (``other.data = x``)
                    and _overlap(written, _extent(other))
                ):
                    ids.reread(other, entry[1])
            self._repack(packed, t, written, sid, unbumped)

    def settle_swaps(self) -> None:
        """End of forward: a saved tensor the forward moved to other bytes after its pack
        (``h.data = other``: no op, no version bump) is read by autograd where it is now, so its
        pack stands for what it holds now (``ValueIds.vid_of``)."""
        handles: list[int] = self.block.handles  # type: ignore[assignment]  # recording: a list
        for h, (ref, _, version, at) in enumerate(self.packed):
            p = ref()
            if p is not None and p._version == version and where(p) != at:
                handles[h] = self.ids.vid_of(p)
                self.moved = True

    def _repack(
        self, packed: int, t: Tensor, written: tuple[int, int], sid: int, unbumped: bool
    ) -> None:
        """The packs on storage ``sid`` among the first ``packed`` whose tensor's counter
        ``t``'s write (spanning bytes ``written``) left (``settle_writes``): a live one stands
        for the value its tensor is now; a freed one is read again at its layout where the write
        overlaps it, unless its base, alive, shows the write moved their counter."""
        handles: list[int] = self.block.handles  # type: ignore[assignment]  # recording: a list
        by_id, log = self.ids.by_id, self.log
        for h in self.packs_on.get(sid, ()):
            if h >= packed:
                break
            ref, base_ref, version, _ = self.packed[h]
            p = ref()
            if p is not None:
                entry = by_id.get(id(p))
                if p._version == version and entry is not None and entry[0]() is p:
                    handles[h] = entry[1]
                continue
            # Read again unless its base shows the write moved its counter. With the pack's
            # tensor and base freed, nothing tells whether the writer shares their counter
            # (``d = h.data; del h; d.clamp_()`` does not); if it does, plain autograd raises at
            # backward, and no reading is right.
            base = base_ref() if base_ref is not None else None
            if not unbumped and base is not None and base._version != version:
                continue
            (shape, dtype), (stride, offset) = log.layouts[h], log.views[h]
            with dispatch_disabled():  # bookkeeping, not an op of the forward
                view = view_on(t.untyped_storage(), Meta(shape, stride, offset, dtype, t.device))
            if _overlap(written, _extent(view)):
                handles[h] = self.ids.reread(view, handles[h])

    def _refuse_leaf_write(self, func: Any, info: OpInfo, sid: int) -> None:
        leaf = next(v for v in self.ids.values if v.sid == sid and v.kind in (INPUT, PARAM, BUFFER))
        what = f"block input {leaf.name}" if leaf.kind == INPUT else f"{leaf.kind} {leaf.name!r}"
        fix = (
            "make the op out-of-place (e.g. `x = x + y` instead of `x += y`), or do not "
            "checkpoint this module"
        )
        if info.writes_if is not None:  # batch norm updating its running statistics
            fix = (
                "checkpoint the modules around the batch norm rather than one containing it, "
                "or run it in eval mode or with track_running_stats=False"
            )
        raise TapeSACError(
            f"block {self.block.name!r}: {func} writes in place into {what}; replay cannot "
            f"reproduce a mutation of a block input, parameter or buffer. Fix: {fix}"
        )

    def _refuse_retarget(self, func: Any) -> None:
        raise TapeSACError(
            f"block {self.block.name!r}: {func} points a tensor at other bytes inside the "
            "forward; replay cannot follow such a tensor (a storage argument would be the "
            "recorded call's, kept alive). Fix: make the tensor as a view of one on those bytes "
            "(`h.view(...)`, `h.as_strided(...)`), or do not checkpoint this module"
        )

    def _capture_rng(self, info: OpInfo, args: tuple, kwargs: dict) -> tuple | None:
        """The generator a random call draws from (its ``Generator`` argument, else the default
        generator of its device) and that generator's state now; None for an op random only
        for want of a declaration on a device without one (it cannot draw there)."""
        generator = (
            arg(args, kwargs, *info.generator_arg)
            if info.generator_arg is not None
            else kwargs.get("generator")
        )
        if generator is None:
            device = kwargs.get("device")
            if device is None:
                tensors = flat_tensors((args, kwargs))
                device = tensors[0].device if tensors else torch.get_default_device()
            if info.unannounced and not has_default_generator(torch.device(device)):
                return None
            generator = default_generator(torch.device(device))
        state = generator.get_state()
        not_counted(state)  # bookkeeping, not the step's memory (and no op a meter sees)
        return (generator, state)

    def _add_node(
        self,
        func: Any,
        info: OpInfo,
        targs: tuple,
        tkwargs: dict,
        inputs: list[int],
        writes: tuple[int, ...],
        rng: Any,
        out: Any,
        args: tuple,
        kwargs: dict,
    ) -> int:
        """Record the call as a node; its index, or -1 when it produced and wrote no tensor."""
        block = self.block
        returned = [out] if type(out) is Tensor else flat_tensors(out)
        extra: tuple[int, ...] = ()
        before_write: dict[int, int] | None = None  # id(tensor) -> its value before the write
        if writes:
            mutated = self._mutated_tensors(info, args, kwargs)
            before_write = {id(t): inputs[slot] for slot, t in zip(writes, mutated)}
            extra = tuple(
                slot for slot, t in zip(writes, mutated) if not any(t is r for r in returned)
            )
            returned = returned + [t for t in mutated if not any(t is r for r in returned)]
        if not returned:
            if out is not None and not isinstance(out, (list, tuple)):
                block.host_sync = True  # a number read from a tensor may steer the next ops
                block.host_floats = block.host_floats or isinstance(out, float)
            return -1
        if writes:
            block.writes_in_place = True
        for t in returned:
            if t.layout is not torch.strided:
                refuse_layout(t, repr(block.name))
            # A plain Tensor intercepts nothing: the type check spares the attribute lookups.
            if type(t) is not Tensor and is_subclass_with_dispatch(t):
                raise TapeSACError(
                    f"block {block.name!r}: {func} returned a {type(t).__name__}; tensor subclasses "
                    "inside a TapeSAC block are not supported. Fix: wait for or unwrap it (e.g. "
                    "funcol.wait_tensor) inside the op that produces it, or do not checkpoint this module"
                )
        index = len(block.nodes)
        name, calls = info.name, self.calls
        k = calls.get(name, 0)
        calls[name] = k + 1
        km = block.anchor_call(name) if block.plan_anchors else -1
        holds = info.holds_outputs or block.plan_coords or block.forced
        outs: list[int] = []
        for j, t in enumerate(returned):
            vid = self._new_output(t, index, j, info, inputs, outs, before_write)
            outs.append(vid)
            if holds:
                self.holding.maybe_hold(func, info, name, k, km, j, vid, t, args, kwargs)
        block.nodes.append(
            _new_tuple(
                Node,
                (
                    index,
                    func,
                    name,
                    k,
                    targs,
                    tkwargs,
                    inputs,
                    [] if info.metadata_only else inputs,
                    outs,
                    writes,
                    extra,
                    rng,
                    info.metadata_only,
                    block.current_module,
                ),
            )
        )
        return index

    def _new_output(
        self,
        t: Tensor,
        index: int,
        j: int,
        info: OpInfo,
        inputs: list[int],
        outs: list[int],
        before_write: dict[int, int] | None,
    ) -> int:
        """A value for output ``j``: in the storage it shares with an input, or in a new one.

        Inside the dispatch mode the autograd layer above has not run yet: it will bump the
        version of every tensor the op wrote and make view outputs share their base's counter.
        """
        ids = self.ids
        values, ptrs = ids.values, ids.ptrs
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = id(t)
        sid = version = None
        epoch = 0
        written = before_write.get(key) if before_write else None
        if written is not None:
            sid, version = values[written].sid, values[written].version + 1
            ids.last_write[sid] = len(values)
        elif ptr:
            for vid in inputs:
                if ptrs[vid] == ptr:
                    sid = values[vid].sid
                    if info.view:
                        version = values[vid].version
                    break
            else:
                for vid in outs:
                    if ptrs[vid] == ptr:
                        sid = values[vid].sid
                        break
        if sid is None:
            storage_bytes = self.block.storage_bytes
            sid = len(storage_bytes)
            storage_bytes.append(storage.nbytes())
            self.block.lifetimes.watch(storage, sid)
            if info.allocation:
                self.uninitialised.add(sid)
        elif ids.epochs:
            epoch = ids.epochs.get(sid, 0)
        vid = len(values)
        if version is None:
            version = t._version
        # Layouts are kept only where replay needs them (they cost recording time).
        meta = ids.layout(t) if info.metadata_only else None
        values.append(_new_tuple(Value, (vid, index, j, sid, epoch, meta, version, OP, None)))
        ptrs.append(ptr)
        ids.register(t, vid, version)
        return vid


def _extent(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage a strided tensor spans, as [start, end) (empty: start == end)."""
    if t.numel() == 0:
        return (0, 0)
    first = int(t.storage_offset())
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (first * t.element_size(), (last + 1) * t.element_size())


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]
