"""Recording: a dispatch mode that writes each op of a block into its tape, and the pack hook.

Contract (what makes replay exact):

* Every tensor the block touches gets a value id. Identity is weak: the recorder keeps
  ``id(tensor) -> (weakref, vid)`` and a signature map (storage, offset, shape, strides, dtype) for
  aliases it never saw, and never a strong reference to an intermediate it does not save.
* A value is a tensor's content at one version. An in-place op produces a new value; a view read
  after its storage was written through another alias becomes a new value too (a synthetic
  ``tapesac.alias`` node that depends on the write).
* Parameters and buffers are recorded by name and fetched again at replay; block inputs are kept.
* Saved values (S0 and the plan) are held strongly. If forward later writes into a held value's
  storage, the held tensor is replaced by a copy first, so it keeps the content autograd saw.

Failure modes that raise ``TapeSACError``: an op writing into a block input, parameter or buffer;
a random op whose generator cannot be captured; a tensor subclass inside the block.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import TapeSACError
from .ops import arg, has_dynamic_shape, is_random_call, op_info
from .tape import (ALIAS_OP, BUFFER, COLLECTIVE, DYNAMIC_SHAPE, EXTERNAL, INPUT,
                   INVISIBLE_WRITE, NO_PRODUCER, OP, PARAM, Meta, Node, Slot, Value)


def default_generator(device: torch.device) -> torch.Generator:
    """The default random generator of a device, or a clear error if it cannot be captured."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        raise TapeSACError(f"cannot capture the random generator of device {device}: "
                           f"torch.{device.type}.default_generators is not available")
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


def on_storage(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """``t``'s view (offset, shape, strides) of another storage, e.g. a copy of its own.

    Copying whole storages rather than views keeps every alias of a storage addressable.
    """
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        view.set_(storage, t.storage_offset(), t.shape, t.stride())
    return view


def flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    return []


class Recorder(TorchDispatchMode):
    """Records one block's forward into ``block``'s tape; also provides the pack hook."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block
        self.by_id: dict[int, tuple[weakref.ref, int]] = {}
        self.by_sig: dict[tuple, int] = {}
        self.ptrs: list[int] = []              # storage data_ptr per value
        self.last_write: dict[int, int] = {}   # sid -> value id of the latest write into it
        self.held_by_sid: dict[int, set[int]] = {}
        self.leaf_sids: set[int] = set()
        self.uninitialised: set[int] = set()
        self.calls: Counter[str] = Counter()
        self.leaf_names: dict[int, tuple[str, str]] | None = None  # id(param) -> (kind, name)
        self.leaf_sigs: dict[tuple, tuple[str, str]] = {}

    # ------------------------------------------------------------------ values

    def _sig(self, t: torch.Tensor, ptr: int) -> tuple:
        return (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype)

    def new_value(self, t: torch.Tensor, node: int, j: int, kind: str, name: Any = None,
                  sid: int | None = None, version: int | None = None) -> int:
        """Give ``t`` a new value id (``version``: the version it will have once the op returns)."""
        block = self.block
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if sid is None:
            sid = len(block.storage_bytes)
            block.storage_bytes.append(storage.nbytes())
        vid = len(block.values)
        if version is None:
            version = t._version
        block.values.append(Value(vid, node, j, sid, Meta.of(t), version, kind, name))
        self.ptrs.append(ptr)
        self.by_id[id(t)] = (weakref.ref(t), vid)
        self.by_sig[self._sig(t, ptr)] = vid
        if kind in (INPUT, PARAM, BUFFER):
            self.leaf_sids.add(sid)
        return vid

    def vid_of(self, t: torch.Tensor) -> int:
        """The value id of ``t`` as it is now, registering leaves and re-read aliases."""
        entry = self.by_id.get(id(t))
        if entry is not None and entry[0]() is t:
            vid = entry[1]
        else:
            ptr = t.untyped_storage().data_ptr()
            vid = self.by_sig.get(self._sig(t, ptr)) if ptr else None
            if vid is None:
                return self._new_leaf(t)
        if self.block.values[vid].version != t._version:
            return self._reread(t, vid)
        return vid

    def _new_leaf(self, t: torch.Tensor) -> int:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TapeSACError(
                f"block {self.block.name!r}: tensor subclass {type(t).__name__} inside a TapeSAC "
                "block is not supported; checkpoint a module whose forward sees plain tensors "
                "(apply FSDP2/DTensor outside the checkpointed block)")
        kind, name = self._leaf_name(t)
        vid = self.new_value(t, -1, 0, kind, name)
        if kind == EXTERNAL:
            self.hold(vid, t, NO_PRODUCER)
        return vid

    def _leaf_name(self, t: torch.Tensor) -> tuple[str, Any]:
        if self.leaf_names is None:
            self.leaf_names = {}
            module = self.block.module
            if module is not None:
                for kind, named in ((PARAM, module.named_parameters(remove_duplicate=False)),
                                    (BUFFER, module.named_buffers(remove_duplicate=False))):
                    for name, p in named:
                        self.leaf_names[id(p)] = (kind, name)
                        self.leaf_sigs[self._sig(p, p.untyped_storage().data_ptr())] = (kind, name)
        found = self.leaf_names.get(id(t))
        if found is None:
            found = self.leaf_sigs.get(self._sig(t, t.untyped_storage().data_ptr()))
        return found if found is not None else (EXTERNAL, None)

    def _reread(self, t: torch.Tensor, stale: int) -> int:
        """``t`` was written through another alias since it was recorded: a new value."""
        block = self.block
        sid = block.values[stale].sid
        write = self.last_write.get(sid)
        if write is None:  # written by something the tape cannot see: keep its current content
            vid = self.new_value(t, -1, 0, EXTERNAL, sid=sid)
            self.hold(vid, t, NO_PRODUCER)
            return vid
        index = len(block.nodes)
        vid = self.new_value(t, index, 0, OP, sid=sid)
        block.nodes.append(Node(index, None, ALIAS_OP, self._count(ALIAS_OP), (Slot(0),), {},
                                [write], [write], [vid], (), (), None, False, None))
        return vid

    def hold(self, vid: int, t: torch.Tensor, reason: str | None = None) -> None:
        """Keep ``t`` for backward: saved by the plan, or mandatory (``reason``)."""
        block = self.block
        block.held[vid] = t
        self.held_by_sid.setdefault(block.values[vid].sid, set()).add(vid)
        if reason is not None:
            block.mandatory.setdefault(vid, reason)

    def register_inputs(self, tensors: list[torch.Tensor]) -> None:
        """Block inputs are leaves, kept strongly (as torch's checkpoint keeps them)."""
        for i, t in enumerate(tensors):
            entry = self.by_id.get(id(t))
            if entry is None or entry[0]() is not t:
                vid = self.new_value(t, -1, 0, INPUT, i)
                self.block.held[vid] = t

    # ------------------------------------------------------------------ pack hook

    def pack(self, t: torch.Tensor) -> Any:
        """Autograd saves ``t``: record it in the demand set and hand autograd a handle."""
        block = self.block
        vid = self.vid_of(t)
        block.demand.add(vid)
        block.pack_count[vid] += 1
        value = block.values[vid]
        if value.sid in self.uninitialised and value.kind == OP:
            self.hold(vid, t, INVISIBLE_WRITE)
        if vid not in block.held and value.kind == OP:
            block.refs.setdefault(vid, weakref.ref(t))
        return block.handle(vid)

    # ------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        info = op_info(func)
        if info.unrecorded or (info.collective and not self._reads_recorded(args, kwargs)):
            return func(*args, **kwargs)
        inputs: list[int] = []
        targs = tuple([self._template(a, inputs) for a in args])
        tkwargs = {k: self._template(v, inputs) for k, v in kwargs.items()} if kwargs else kwargs
        writes = self._before_write(func, info, args, kwargs, inputs) if info.mutated else ()
        rng = self._capture_rng(func, args, kwargs, inputs) if is_random_call(info, args, kwargs) else None
        out = func(*args, **kwargs)
        if not info.metadata_only and not info.aliasing:
            self._check_initialised(args, kwargs, inputs, writes)
        self._add_node(func, info, targs, tkwargs, inputs, writes, rng, out, args, kwargs)
        return out

    def _reads_recorded(self, args: tuple, kwargs: dict) -> bool:
        """FSDP's collectives move FSDP's own buffers; user collectives read recorded values."""
        for t in flat_tensors(list(args) + list(kwargs.values())):
            entry = self.by_id.get(id(t))
            if entry is not None and entry[0]() is t:
                return True
        return False

    def _template(self, a: Any, inputs: list[int]) -> Any:
        if isinstance(a, torch.Tensor):
            inputs.append(self.vid_of(a))
            return Slot(len(inputs) - 1)
        if type(a) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)([self._template(x, inputs) for x in a])
        return a

    def _mutated_tensors(self, info: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [t for position, name in info.mutated
                for t in flat_tensors(arg(args, kwargs, position, name))]

    def _before_write(self, func: Any, info: Any, args: tuple, kwargs: dict,
                      inputs: list[int]) -> tuple[int, ...]:
        """Refuse writes into leaves; copy held values the write would change. Returns slots written."""
        block = self.block
        written = self._mutated_tensors(info, args, kwargs)
        slots = []
        for t in written:
            vid = self.vid_of(t)
            slots.append(inputs.index(vid))
            value = block.values[vid]
            if value.sid in self.leaf_sids:
                self._refuse_leaf_write(func, t)
            held = self.held_by_sid.get(value.sid, ())
            if held:
                copy = block.held[next(iter(held))].untyped_storage().clone()
                for vid in held:
                    block.held[vid] = on_storage(block.held[vid], copy)
            self.uninitialised.discard(value.sid)
        return tuple(slots)

    def _refuse_leaf_write(self, func: Any, t: torch.Tensor) -> None:
        leaf = next((v for v in self.block.values
                     if v.kind in (INPUT, PARAM, BUFFER) and v.sid == self.block.values[self.vid_of(t)].sid))
        what = (f"block input {leaf.name}" if leaf.kind == INPUT
                else f"{leaf.kind} {leaf.name!r}")
        raise TapeSACError(
            f"block {self.block.name!r}: {func} writes in place into {what}; replay cannot "
            "reproduce a mutation of a block input, parameter or buffer. Fix: make the op "
            "out-of-place (e.g. `x = x + y` instead of `x += y`), or do not checkpoint this module")

    def _capture_rng(self, func: Any, args: tuple, kwargs: dict, inputs: list[int]) -> tuple:
        generator = kwargs.get("generator")
        if generator is None:
            device = kwargs.get("device")
            if device is None:
                device = (self.block.values[inputs[0]].meta.device if inputs
                          else torch.get_default_device())
            generator = default_generator(torch.device(device))
        return (generator, generator.get_state())

    def _check_initialised(self, args: tuple, kwargs: dict, inputs: list[int],
                           writes: tuple[int, ...]) -> None:
        """A recorded read of a never-written allocation: an invisible kernel filled it."""
        if not self.uninitialised:
            return
        values = self.block.values
        tensors = flat_tensors(list(args) + list(kwargs.values()))
        for slot, (vid, t) in enumerate(zip(inputs, tensors)):
            if slot not in writes and values[vid].sid in self.uninitialised:
                self.hold(vid, t, INVISIBLE_WRITE)

    def _count(self, name: str) -> int:
        k = self.calls[name]
        self.calls[name] = k + 1
        return k

    def _add_node(self, func: Any, info: Any, targs: tuple, tkwargs: dict, inputs: list[int],
                  writes: tuple[int, ...], rng: Any, out: Any, args: tuple, kwargs: dict) -> None:
        block = self.block
        returned = flat_tensors(out)
        mutated = self._mutated_tensors(info, args, kwargs) if writes else []
        extra = tuple(slot for slot, t in zip(writes, mutated)
                      if not any(t is r for r in returned))
        written = [t for t in mutated if not any(t is r for r in returned)]
        if not returned and not written:
            return
        index = len(block.nodes)
        name = info.name
        k = self._count(name)
        deps = [] if info.metadata_only else list(dict.fromkeys(inputs))
        before_write = {id(t): inputs[slot] for slot, t in zip(writes, mutated)}
        outs: list[int] = []
        for j, t in enumerate(returned + written):
            sid, version = self._storage_and_version(t, info, inputs + outs, before_write)
            vid = self.new_value(t, index, j, OP, sid=sid, version=version)
            outs.append(vid)
            if id(t) in before_write:
                self.last_write[sid] = vid
            if info.allocation:
                self.uninitialised.add(sid)
            self._maybe_hold(func, info, name, k, j, vid, t, args, kwargs)
        block.nodes.append(Node(index, func, name, k, targs, tkwargs, inputs, deps, outs, writes,
                                extra, rng, info.metadata_only, block.current_module))

    def _storage_and_version(self, t: torch.Tensor, info: Any, inputs: list[int],
                             before_write: dict[int, int]) -> tuple[int | None, int | None]:
        """The storage an output shares with an input (None: a new one), and its version.

        Inside the dispatch mode the autograd layer above has not yet run: it will bump the
        version of every tensor the op wrote and make view outputs share their base's counter.
        """
        values = self.block.values
        written = before_write.get(id(t))
        if written is not None:
            return values[written].sid, values[written].version + 1
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            for vid in inputs:
                if self.ptrs[vid] == ptr:
                    return values[vid].sid, values[vid].version if info.view else None
        return None, None

    def _maybe_hold(self, func: Any, info: Any, name: str, k: int, j: int, vid: int,
                    t: torch.Tensor, args: tuple, kwargs: dict) -> None:
        if info.collective:
            self.hold(vid, t, COLLECTIVE)
        elif has_dynamic_shape(func, info, args, kwargs):
            self.hold(vid, t, DYNAMIC_SHAPE)
        elif (name, k, j) in self.block.plan_coords:
            self.block.planned_seen.add((name, k, j))
            if self.block.values[vid].sid in self.leaf_sids:
                return  # a view of a leaf is replayed for free; saving it could pin an FSDP parameter
            self.hold(vid, t)
            self.block.planned.add(vid)
