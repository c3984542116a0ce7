"""Recording: a dispatch mode that writes each op of a block into its tape, and the pack hook.

Contract (what makes replay exact):

* Every tensor the block touches gets a value id. Identity is weak: the recorder keeps
  ``id(tensor) -> (weakref, vid)``, and never a strong reference to an intermediate it does not
  save. An alias it never saw (``x.data``) is matched by storage, offset, shape, strides and dtype.
* A value is a tensor's content at one version. An in-place op produces a new value; a view read
  after its storage was written through another alias becomes a new value too (a synthetic
  ``tapesac.alias`` node that depends on the write).
* Parameters and buffers are recorded by name and fetched again at replay; block inputs are kept.
* Saved values (S0 and the plan) are held strongly, detached: nothing a block holds may keep its
  own graph alive (the graph holds the block through its unpack hook). If forward
  later writes into a held value's storage, the held tensor is moved to a copy of the storage
  first, so it keeps the content autograd saw.

Failure modes that raise ``TapeSACError``: an op writing into a block input, parameter or buffer;
a random op whose generator cannot be captured; a tensor subclass inside the block.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import TapeSACError
from .ops import OpInfo, arg, has_dynamic_shape, is_random_call, op_info
from .tape import (
    ALIAS_OP,
    BUFFER,
    COLLECTIVE,
    DYNAMIC_SHAPE,
    EXTERNAL,
    INPUT,
    INVISIBLE_WRITE,
    NO_PRODUCER,
    OP,
    PARAM,
    Meta,
    Node,
    Value,
)
from .tensors import (
    default_generator,
    detached,
    flat_tensors,
    has_default_generator,
    is_subclass_with_dispatch,
    layout_of,
    on_storage,
)
from .tensors import slot as _slot
from .tensors import slot_args as _slot_args
from .verify import fingerprint

Tensor = torch.Tensor


_new_tuple = tuple.__new__


class Recorder(TorchDispatchMode):
    """Records one block's forward into ``block``'s tape; also provides the pack hook."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo, which costs
        # microseconds per op; recording only ever runs eagerly.
        return False

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block
        self.values: list[Value] = block.values
        # id(tensor) -> (weakref, vid, the value's version): what each op checks its inputs by.
        self.by_id: dict[int, tuple[weakref.ref, int, int]] = {}
        self.ptrs: list[int] = []  # storage data_ptr per value
        self.last_write: dict[int, int] = {}  # sid -> value id of the latest write into it
        self.held_by_sid: dict[int, set[int]] = {}
        self.leaf_sids: set[int] = set()
        self.uninitialised: set[int] = set()
        self.epochs: dict[int, int] = {}  # sid -> number of recorded writes into it so far
        self.calls: dict[str, int] = {}
        self.first_packed: set[int] = set()  # values packed while verifying or initialising
        self._leaves: dict[int, tuple[str, str]] | None = None  # rebuilt in this block, if it was
        self.timer = block.timer  # set before recording when node times are wanted
        # Whether the hot path in __torch_dispatch__ may record this block's ops: nothing is
        # timed and hidden writes name nothing to hold (fixed for the block); and whether it
        # looks up the plan's coordinates (a planned block's ops take the hot path too: on the
        # slow one a plan's forward cost more than its replay saved, on many small ops).
        self.fast = block.timer is None and not block.forced
        self.holds_planned = bool(block.plan_coords)  # as _add_node and _reread hold
        self.counts_anchors = bool(block.plan_anchors)
        # OpOverload hashes in Python: look ops up by id (they live as long as the process).
        self.infos: dict[int, OpInfo] = {}
        self.hot: dict[int, OpInfo] = {}  # the ops of ``infos`` the hot path records

    # ------------------------------------------------------------------ values

    def new_value(
        self,
        t: Tensor,
        node: int,
        j: int,
        kind: str,
        name: Any = None,
        sid: int | None = None,
        version: int | None = None,
    ) -> int:
        """Give ``t`` a new value id (``version``: the version it will have once the op returns)."""
        block = self.block
        storage = t.untyped_storage()
        if sid is None:
            sid = len(block.storage_bytes)
            block.storage_bytes.append(storage.nbytes())
        vid = len(self.values)
        if version is None:
            version = t._version
        self.values.append(
            Value(vid, node, j, sid, self.epochs.get(sid, 0), self._layout(t), version, kind, name)
        )
        self.ptrs.append(storage.data_ptr())
        self.by_id[id(t)] = (weakref.ref(t), vid, version)
        if kind != OP and kind != EXTERNAL:
            self.leaf_sids.add(sid)
        return vid

    def _layout(self, t: Tensor) -> Meta:
        """``t``'s recorded layout; replay turns autocast off on the device types of layouts."""
        meta = layout_of(t)
        self.block.device_types.add(meta.device.type)
        return meta

    def vid_of(self, t: Tensor) -> int:
        """The value id of ``t`` as it is now, registering leaves and re-read aliases."""
        entry = self.by_id.get(id(t))
        if entry is not None and entry[0]() is t:
            vid = entry[1]
        else:
            vid = self._unseen(t)
        if self.values[vid].version != t._version:
            return self._reread(t, vid)
        return vid

    def _unseen(self, t: Tensor) -> int:
        """A tensor object first seen: a parameter or buffer, an alias of a value, or external."""
        self._refuse_subclass(t)
        leaf = self._leaf_name(t)
        if leaf is not None:
            return self.new_value(t, -1, 0, leaf[0], leaf[1])
        alias = self._same_view(t)
        if alias is not None:
            self.by_id[id(t)] = (weakref.ref(t), alias, self.values[alias].version)
            return alias
        leaf = self._leaf_view(t)
        if leaf is not None:
            return self.new_value(t, -1, 0, leaf[0], leaf[1])
        vid = self.new_value(t, -1, 0, EXTERNAL)
        self.hold(vid, t, NO_PRODUCER)
        return vid

    def _refuse_subclass(self, t: Tensor) -> None:
        if is_subclass_with_dispatch(t):
            raise TapeSACError(
                f"block {self.block.name!r}: tensor subclass {type(t).__name__} inside a TapeSAC "
                "block is not supported; checkpoint a module whose forward sees plain tensors "
                "(apply FSDP2/DTensor outside the checkpointed block)"
            )

    def _same_view(self, t: Tensor) -> int | None:
        """The newest value with ``t``'s storage, offset, shape, strides and dtype (an alias object)."""
        ptr = t.untyped_storage().data_ptr()
        if not ptr:
            return None
        layout = layout_of(t)[:4]
        # Only a value whose own tensor is alive proves the storage is the same one: a freed
        # storage's address is reused by new allocations.
        for ref, vid, _ in sorted(self.by_id.values(), key=lambda e: -e[1]):
            live = ref()
            if live is not None and self.ptrs[vid] == ptr and layout_of(live)[:4] == layout:
                return vid
        return None

    def _leaf_view(self, t: Tensor) -> tuple[str, str] | None:
        """A parameter or buffer seen through another tensor object (``p.data``)."""
        module = self.block.module
        if module is None:
            return None
        ptr, meta = t.untyped_storage().data_ptr(), layout_of(t)
        for kind, named in ((PARAM, module.named_parameters()), (BUFFER, module.named_buffers())):
            for name, p in named:
                if p.untyped_storage().data_ptr() == ptr and layout_of(p)[:4] == meta[:4]:
                    return kind, name
        return None

    def _leaf_name(self, t: Tensor) -> tuple[str, str] | None:
        """A parameter or buffer of the block's module, by identity.

        The map is kept on the module across calls (walking a module with many experts costs
        more than recording its ops); a miss rebuilds it once per block, since FSDP2 and users
        may swap parameter objects between steps. Entries hold weak references, so a freed
        parameter's id taken by a new tensor is not mistaken for it.
        """
        module = self.block.module
        if module is None:
            return None
        cached = getattr(module, "_tapesac_leaves", None)
        entry = cached.get(id(t)) if cached is not None else None
        if entry is None and self._leaves is None:
            cached = self._leaves = {}
            for kind, named in (
                (PARAM, module.named_parameters(remove_duplicate=False)),
                (BUFFER, module.named_buffers(remove_duplicate=False)),
            ):
                for name, p in named:
                    cached.setdefault(id(p), (weakref.ref(p), kind, name))
            module._tapesac_leaves = cached
            entry = cached.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    def _reread(self, t: Tensor, stale: int) -> int:
        """``t`` was written through another alias since it was recorded: a new value."""
        block = self.block
        sid = self.values[stale].sid
        write = self.last_write.get(sid)
        if write is None:  # written by something the tape cannot see: keep its current content
            vid = self.new_value(t, -1, 0, EXTERNAL, sid=sid)
            self.hold(vid, t, NO_PRODUCER)
            return vid
        index = len(block.nodes)
        vid = self.new_value(t, index, 0, OP, sid=sid)
        k = self._count(ALIAS_OP)
        block.nodes.append(
            Node(
                index,
                None,
                ALIAS_OP,
                k,
                (_slot(0),),
                {},
                [write],
                [write],
                [vid],
                (),
                (),
                None,
                False,
                block.current_module,
            )
        )
        if block.plan_coords:
            km = block.anchor_call(ALIAS_OP) if block.plan_anchors else -1
            self._hold_if_planned(ALIAS_OP, k, km, 0, vid, t)
        return vid

    def hold(self, vid: int, t: Tensor, reason: str | None = None) -> None:
        """Keep ``t`` for backward: saved by the plan, or mandatory (``reason``)."""
        block = self.block
        block.held[vid] = detached(t)
        self.held_by_sid.setdefault(self.values[vid].sid, set()).add(vid)
        if reason is not None:
            block.mandatory.setdefault(vid, reason)

    def register_inputs(self, tensors: list[Tensor]) -> None:
        """Block inputs are leaves, kept strongly (as torch's checkpoint keeps them)."""
        for i, t in enumerate(tensors):
            self._refuse_subclass(t)
            entry = self.by_id.get(id(t))
            if entry is None or entry[0]() is not t:
                vid = self.new_value(t, -1, 0, INPUT, i)
                self.block.held[vid] = detached(t)

    # ------------------------------------------------------------------ pack hook

    def pack(self, t: Tensor) -> int:
        """Autograd saves ``t``: record it in the demand set and hand autograd a handle (the
        pack's index in ``block.handles``)."""
        block = self.block
        entry = self.by_id.get(id(t))
        if entry is not None and entry[0]() is t and entry[2] == t._version:
            vid = entry[1]
        else:
            vid = self.vid_of(t)
        handles = block.handles
        handles.append(vid)
        block.pack_layouts.append((t.shape, t.dtype))
        if (block.verify or self.uninitialised) and vid not in self.first_packed:
            self._first_pack(vid, t)
        return len(handles) - 1

    def _first_pack(self, vid: int, t: Tensor) -> None:
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

    def module_exit(self, output: Any) -> None:
        """A submodule returned ``output``: the values of its tensors, where recorded, are what a
        steady-state call can hold from that exit (values on their storages)."""
        by_id, exit_values = self.by_id, []
        for t in flat_tensors(output):
            entry = by_id.get(id(t))
            known = entry is not None and entry[0]() is t and entry[2] == t._version
            exit_values.append((entry[1] if known else None, (t.shape, t.dtype)))
        self.block.exits.append(tuple(exit_values))

    def alive(self, vids: Collection[int]) -> dict[int, tuple[weakref.ref, int]]:
        """A weak reference per value of ``vids`` whose tensor is alive now (a block output,
        say): backward takes it as it is, if still alive there, instead of replaying it.

        Collected once at the end of forward rather than at each pack, so that the pack hook,
        run per saved tensor, stays short. Only a tensor that still has the value's version
        counts: an alias seen by storage (``x.data``) has a counter of its own."""
        refs: dict[int, tuple[weakref.ref, int]] = {}
        values = self.values
        for ref, vid, _ in self.by_id.values():
            if vid in vids and vid not in refs:
                t = ref()
                if t is not None and t._version == values[vid].version:
                    refs[vid] = (ref, values[vid].version)
        return refs

    # ------------------------------------------------------------------ dispatch

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        info = self.hot.get(id(func))
        if info is None or self.uninitialised:
            info = self.infos.get(id(func)) or self._info(func)
            return self._record(func, info, args, kwargs)
        # The hot path: an op with one tensor output, fresh or a view of its first input, and
        # nothing to capture, copy, refuse or time, recorded (and held, if the plan names it)
        # as ``_record`` would, with fewer calls.
        inputs: list[int] = []
        targs: list | None = None  # built only once an argument is not a tensor
        by_id, values = self.by_id, self.values
        for a in args:  # _template, unrolled for plain tensor arguments
            if isinstance(a, Tensor):
                entry = by_id.get(id(a))
                if entry is not None and entry[0]() is a and entry[2] == a._version:
                    inputs.append(entry[1])
                else:
                    inputs.append(self.vid_of(a))
                if targs is not None:
                    targs.append(_slot(len(inputs) - 1))
            else:
                if targs is None:
                    targs = list(_slot_args(len(inputs)))
                targs.append(self._template(a, inputs) if type(a) in (list, tuple) else a)
        targs = _slot_args(len(inputs)) if targs is None else tuple(targs)
        tkwargs = {k: self._template(v, inputs) for k, v in kwargs.items()} if kwargs else kwargs
        out = info.call(*args, **kwargs)
        if type(out) is not Tensor:
            self._add_node(func, info, targs, tkwargs, inputs, (), None, out, args, kwargs)
            return out
        block = self.block
        storage = out.untyped_storage()
        ptr = storage.data_ptr()
        if info.simple_view:  # it shares its base's storage and, once autograd ran, its version
            base = inputs[0] if inputs else -1
            if base < 0 or self.ptrs[base] != ptr:
                self._add_node(func, info, targs, tkwargs, inputs, (), None, out, args, kwargs)
                return out
            sid, version = values[base].sid, values[base].version
            epoch = self.epochs.get(sid, 0) if self.epochs else 0
        else:
            sid, version, epoch = len(block.storage_bytes), out._version, 0
            block.storage_bytes.append(storage.nbytes())
        nodes, calls, name = block.nodes, self.calls, info.name
        index, vid, key = len(nodes), len(values), id(out)
        k = calls.get(name, 0)
        calls[name] = k + 1
        values.append(_new_tuple(Value, (vid, index, 0, sid, epoch, None, version, OP, None)))
        self.ptrs.append(ptr)
        self.by_id[key] = (weakref.ref(out), vid, version)
        nodes.append(
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
                    inputs,
                    [vid],
                    (),
                    (),
                    None,
                    False,
                    block.current_module,
                ),
            )
        )
        km = block.anchor_call(name) if self.counts_anchors else -1  # every node, as _add_node
        if self.holds_planned:
            self._hold_if_planned(name, k, km, 0, vid, out)
        return out

    def _record(self, func: Any, info: OpInfo, args: tuple, kwargs: dict) -> Any:
        """Every op the fast path in ``__torch_dispatch__`` does not take: not plain nor a simple
        view, or any op while timing or while an uninitialised allocation is pending."""
        if info.unrecorded or (info.collective and not self._reads_recorded(args, kwargs)):
            return func(*args, **kwargs)
        if info.identity:
            return self._same_value(func, args, kwargs)
        inputs: list[int] = []
        targs = tuple([self._template(a, inputs) for a in args])
        tkwargs = {k: self._template(v, inputs) for k, v in kwargs.items()} if kwargs else kwargs
        writes = self._before_write(func, info, args, kwargs, inputs) if info.mutated else ()
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
            self._check_initialised(args, kwargs, inputs, writes)
        index = self._add_node(func, info, targs, tkwargs, inputs, writes, rng, out, args, kwargs)
        if timer is not None and index >= 0:
            self.block.trace.forward_times[index] = sample
        return out

    def _same_value(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """``detach``-like ops return the same content, storage and layout: no node, same value.

        Autograd dispatches such ops on its own (``make_variable`` detaches a factory function's
        result when the recorder holds it); recording them would make the op sequence, and every
        plan coordinate after it, depend on what the plan saves.
        """
        vid = self.vid_of(args[0])
        out = func(*args, **kwargs)
        self.by_id[id(out)] = (weakref.ref(out), vid, self.values[vid].version)
        return out

    def _info(self, func: Any) -> OpInfo:
        info = self.infos[id(func)] = op_info(func)
        if self.fast and (info.plain or info.simple_view):
            self.hot[id(func)] = info
        return info

    def _keep_meta(self, vid: int, t: Tensor) -> None:
        """A metadata-only op's input: its layout is what replay rebuilds from."""
        value = self.values[vid]
        if value.meta is None:
            self.values[vid] = value._replace(meta=self._layout(t))

    def _reads_recorded(self, args: tuple, kwargs: dict) -> bool:
        """FSDP's collectives move FSDP's own buffers; user collectives read recorded values."""
        for t in flat_tensors((args, kwargs)):
            entry = self.by_id.get(id(t))
            if entry is not None and entry[0]() is t:
                return True
        return False

    def _template(self, a: Any, inputs: list[int]) -> Any:
        if isinstance(a, Tensor):
            entry = self.by_id.get(id(a))
            if entry is not None and entry[0]() is a and entry[2] == a._version:
                inputs.append(entry[1])
            else:
                inputs.append(self.vid_of(a))
            i = len(inputs) - 1
            return _slot(i)
        if type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, Tensor):
                    return type(a)([self._template(x, inputs) for x in a])
        return a

    def _mutated_tensors(self, info: OpInfo, args: tuple, kwargs: dict) -> list[Tensor]:
        return [
            t
            for position, name in info.mutated
            for t in flat_tensors(arg(args, kwargs, position, name))
        ]

    def _before_write(
        self, func: Any, info: OpInfo, args: tuple, kwargs: dict, inputs: list[int]
    ) -> tuple[int, ...]:
        """Refuse writes into leaves; move held values the write would change. Returns slots written."""
        slots = []
        for t in self._mutated_tensors(info, args, kwargs):
            vid = self.vid_of(t)
            slots.append(inputs.index(vid))
            sid = self.values[vid].sid
            if sid in self.leaf_sids:
                self._refuse_leaf_write(func, sid)
            self._move_held_off(t.untyped_storage(), sid)
            self.epochs[sid] = self.epochs.get(sid, 0) + 1
            self.uninitialised.discard(sid)
        return tuple(slots)

    def _move_held_off(self, storage: torch.UntypedStorage, sid: int) -> None:
        """Held values on a storage about to be written move to one copy of it (content kept)."""
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

    def _refuse_leaf_write(self, func: Any, sid: int) -> None:
        leaf = next(v for v in self.values if v.sid == sid and v.kind in (INPUT, PARAM, BUFFER))
        what = f"block input {leaf.name}" if leaf.kind == INPUT else f"{leaf.kind} {leaf.name!r}"
        raise TapeSACError(
            f"block {self.block.name!r}: {func} writes in place into {what}; replay cannot "
            "reproduce a mutation of a block input, parameter or buffer. Fix: make the op "
            "out-of-place (e.g. `x = x + y` instead of `x += y`), or do not checkpoint this module"
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
        return (generator, generator.get_state())

    def _check_initialised(
        self, args: tuple, kwargs: dict, inputs: list[int], writes: tuple[int, ...]
    ) -> None:
        """A recorded read of a never-written allocation: an invisible kernel filled it."""
        for slot, t in enumerate(flat_tensors((args, kwargs))):
            vid = inputs[slot]
            if slot not in writes and self.values[vid].sid in self.uninitialised:
                self.hold(vid, t, INVISIBLE_WRITE)

    def _count(self, name: str) -> int:
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        return k

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
        returned = [out] if isinstance(out, Tensor) else flat_tensors(out)
        extra: tuple[int, ...] = ()
        before_write: dict[int, int] = {}
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
            return -1
        if writes:
            block.writes_in_place = True
        for t in returned:
            if is_subclass_with_dispatch(t):
                raise TapeSACError(
                    f"block {block.name!r}: {func} returned a {type(t).__name__}; tensor subclasses "
                    "inside a TapeSAC block are not supported. Fix: wait for or unwrap it (e.g. "
                    "funcol.wait_tensor) inside the op that produces it, or do not checkpoint this module"
                )
        index = len(block.nodes)
        name = info.name
        calls = self.calls
        k = calls.get(name, 0)
        calls[name] = k + 1
        plan_coords = block.plan_coords
        km = block.anchor_call(name) if block.plan_anchors else -1
        outs: list[int] = []
        for j, t in enumerate(returned):
            vid = self._new_output(t, index, j, info, inputs, outs, before_write)
            outs.append(vid)
            if info.holds_outputs or plan_coords or block.forced:
                self._maybe_hold(func, info, name, k, km, j, vid, t, args, kwargs)
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
        before_write: dict[int, int],
    ) -> int:
        """A value for output ``j``: in the storage it shares with an input, or in a new one.

        Inside the dispatch mode the autograd layer above has not run yet: it will bump the
        version of every tensor the op wrote and make view outputs share their base's counter.
        """
        values, ptrs = self.values, self.ptrs
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = id(t)
        sid = version = None
        epoch = 0
        written = before_write.get(key) if before_write else None
        if written is not None:
            sid, version = values[written].sid, values[written].version + 1
            self.last_write[sid] = len(values)
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
            sid = len(self.block.storage_bytes)
            self.block.storage_bytes.append(storage.nbytes())
            if info.allocation:
                self.uninitialised.add(sid)
        elif self.epochs:
            epoch = self.epochs.get(sid, 0)
        vid = len(values)
        if version is None:
            version = t._version
        # Layouts are kept only where replay needs them (they cost recording time).
        meta = self._layout(t) if info.metadata_only else None
        values.append(_new_tuple(Value, (vid, index, j, sid, epoch, meta, version, OP, None)))
        ptrs.append(ptr)
        self.by_id[key] = (weakref.ref(t), vid, version)
        return vid

    def _maybe_hold(
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
        if info.collective:
            self.hold(vid, t, COLLECTIVE)
        elif info.dynamic_shape and has_dynamic_shape(func, info, args, kwargs):
            self.hold(vid, t, DYNAMIC_SHAPE)
        elif (name, k, j) in self.block.forced:
            self.hold(vid, t, INVISIBLE_WRITE)
        else:
            self._hold_if_planned(name, k, km, j, vid, t)

    def _hold_if_planned(self, name: str, k: int, km: int, j: int, vid: int, t: Tensor) -> None:
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
