"""Value identity while recording: which value id a tensor is, as the recorder sees it.

A value is a tensor's content at one version. The recorder asks ``ValueIds.vid_of`` for every
tensor an op reads; ``ValueIds`` answers from what it has seen and registers what it has not:

* a tensor object it recorded (an op's output, a block input): its value, while the tensor's
  version counter and ``where`` (data address and layout) are the value's (``t.data = other``
  moves a tensor to other bytes or another layout unseen, ``h.data = h.data.t()`` to another
  layout at the same address: then it is what the tensor holds now, as below). Identity is
  weak: ``id(tensor) -> (weakref, vid, version, where)``, never a strong reference to a tensor,
  so recording keeps no intermediate alive;
* a parameter or buffer of the block's module (by identity, else by storage and layout, as
  ``p.data`` is): a leaf value recorded by name, fetched again at replay;
* another tensor object on a recorded value's storage with its layout (``x.data``): that value;
* anything else: an external value, whose content is kept as it is now (``Holding.no_producer``);
* a recorded tensor whose version moved on (its storage was written through another alias): a
  new value, made by a synthetic ``tapesac.alias`` node that depends on the write (replay makes
  it as a view of the written storage), or an external value if no recorded op wrote it.

It also keeps, per storage id, the recorded writes into it (``epochs``, ``last_write``) and adds
the storages of leaves to ``leaf_sids`` (the recorder refuses writes into those; ``Holding``
never holds their views). Whether a value's tensor is held is ``Holding``'s decision
(``holding.py``); nodes of ops are the recorder's (``recorder.py``).

Nothing here refers back to the recorder: autograd keeps the recorder's pack hook, and so the
recorder, as long as the block's graph, and a cycle through it would keep the block, and what it
holds, alive until the garbage collector ran after that. The recorder forgets this bookkeeping
once the forward ends (``Recorder.forget``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..errors import TapeSACError
from ..tensors import Meta, is_subclass_with_dispatch, layout_of, slot, slot_args
from .tape import ALIAS_OP, BUFFER, EXTERNAL, OP, PARAM, Node, Value, ValueKind

if TYPE_CHECKING:
    from .block import Block
    from .holding import Holding

Tensor = torch.Tensor

# The attribute of a block's module that keeps its leaf map across calls (``_leaf_name``).
_LEAVES = "_tapesac_leaves"


def where(t: Tensor) -> tuple:
    """Where ``t`` reads its bytes from and how: its data address, strides, shape, dtype and
    conjugate and negative bits. The setter ``t.data = other`` changes them without an op the
    dispatcher sees or a version bump."""
    return (t.data_ptr(), t.stride(), t.shape, t.dtype, t.is_conj(), t.is_neg())


def refuse_layout(t: Tensor, block: str) -> None:
    """A sparse (or other non-strided) tensor inside ``block``: a tape holds and replays
    tensors on storages, which it has none of."""
    if t.layout is not torch.strided:
        raise TapeSACError(
            f"block {block}: a {t.layout} tensor of shape {tuple(t.shape)} inside a TapeSAC "
            "block is not supported (tapes hold and replay strided tensors only). Fix: make "
            "the sparse tensor and the ops on it outside the checkpointed module, or checkpoint "
            "a submodule whose forward sees dense tensors only"
        )


def forget_leaves(module: torch.nn.Module) -> None:
    """Drop the leaf map recording keeps on ``module`` (restoring a block)."""
    vars(module).pop(_LEAVES, None)


class ValueIds:
    """The value ids of one block's tensors while it records.

    ``values`` is the block's list (the tape's values); ``ptrs`` the storage address of each, as
    it was made; ``by_id`` what each op checks its inputs by. ``epochs`` (sid -> recorded writes
    into it so far) and ``last_write`` (sid -> the value the latest one made) are updated by the
    recorder as it records writes. ``holding`` is told of values without a recorded producer and
    of alias values (which a plan may name); ``calls`` are the recorder's op call counts, which
    an alias node counts in; ``leaf_sids`` the set ``holding`` reads leaf storages from.
    """

    def __init__(
        self, block: Block, holding: Holding, calls: dict[str, int], leaf_sids: set[int]
    ) -> None:
        self.block = block
        self.holding = holding
        self.calls = calls
        self.values: list[Value] = block.values
        # id(tensor) -> (weakref, vid, the value's version, ``where`` the tensor reads): what
        # each op checks its inputs by.
        self.by_id: dict[int, tuple[weakref.ref[Tensor], int, int, tuple]] = {}
        self.ptrs: list[int] = []  # storage data_ptr per value
        self.last_write: dict[int, int] = {}  # sid -> value id of the latest write into it
        self.leaf_sids = leaf_sids  # storages of leaves, added by new_value
        self.epochs: dict[int, int] = {}  # sid -> number of recorded writes into it so far
        # sid -> the ids (``by_id`` keys) of the tensor objects recorded on it: a write through
        # one may leave the others' counters as they were (``Recorder.settle_writes``).
        self.on_storage: dict[int, dict[int, None]] = {}  # (a dict: ordered, no duplicates)
        # The module's map of its leaves, if this block rebuilt it (``_leaf_name``).
        self._leaves: dict[int, tuple[weakref.ref[Tensor], ValueKind, str]] | None = None

    def new_value(
        self,
        t: Tensor,
        node: int,
        j: int,
        kind: ValueKind,
        name: str | int | None = None,
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
            Value(vid, node, j, sid, self.epochs.get(sid, 0), self.layout(t), version, kind, name)
        )
        self.ptrs.append(storage.data_ptr())
        self.register(t, vid, version)
        if kind != OP and kind != EXTERNAL:
            self.leaf_sids.add(sid)
        return vid

    def layout(self, t: Tensor) -> Meta:
        """``t``'s recorded layout; replay turns autocast off on the device types of layouts."""
        meta = layout_of(t)
        self.block.device_types.add(meta.device.type)
        return meta

    def recorded(self, t: Tensor) -> int | None:
        """The value of ``t`` if this tensor object was recorded at its current version, else
        None; registers nothing. (Inlined where it runs per argument of every op.)"""
        entry = self.by_id.get(id(t))
        if (
            entry is not None
            and entry[0]() is t
            and entry[2] == t._version
            and entry[3] == where(t)
        ):
            return entry[1]
        return None

    def same_as(self, t: Tensor, vid: int) -> None:
        """``t`` is another tensor object with value ``vid``'s content, storage and layout."""
        self.register(t, vid, self.values[vid].version)

    def register(self, t: Tensor, vid: int, version: int) -> None:
        """``t`` holds value ``vid`` at ``version`` (and lies on its storage, where a write
        through another tensor may leave its counter as it was: ``Recorder.settle_writes``)."""
        self.by_id[id(t)] = (weakref.ref(t), vid, version, where(t))
        self.on_storage.setdefault(self.values[vid].sid, {})[id(t)] = None

    def arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[int]]:
        """A call's recorded arguments and keyword arguments (each tensor replaced by the slot of
        its position among the call's tensors) and the value ids of those tensors, in order. A
        call whose arguments are exactly its tensors gets the shared ``SLOT_ARGS`` tuple."""
        inputs: list[int] = []
        targs: list[Any] | None = None  # built only once an argument is not a tensor
        by_id = self.by_id
        for a in args:
            if isinstance(a, Tensor):
                entry = by_id.get(id(a))  # recorded(), inlined: runs per tensor argument
                if (
                    entry is not None
                    and entry[0]() is a
                    and entry[2] == a._version
                    and entry[3] == where(a)
                ):
                    inputs.append(entry[1])
                else:
                    inputs.append(self.vid_of(a))
                if targs is not None:
                    targs.append(slot(len(inputs) - 1))
            else:
                if targs is None:
                    targs = list(slot_args(len(inputs)))
                targs.append(self._argument(a, inputs))
        # Counted before keyword arguments add their tensors to ``inputs``.
        template = slot_args(len(inputs)) if targs is None else tuple(targs)
        tkwargs = {k: self._argument(v, inputs) for k, v in kwargs.items()} if kwargs else kwargs
        return template, tkwargs, inputs

    def _argument(self, a: Any, inputs: list[int]) -> Any:
        """One recorded argument: a tensor (appended to ``inputs``) becomes its slot, a list or
        tuple with tensors a list or tuple of templates; anything else is kept as it is."""
        if isinstance(a, Tensor):
            entry = self.by_id.get(id(a))
            if (
                entry is not None
                and entry[0]() is a
                and entry[2] == a._version
                and entry[3] == where(a)
            ):
                inputs.append(entry[1])
            else:
                inputs.append(self.vid_of(a))
            return slot(len(inputs) - 1)
        if type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, Tensor):
                    return type(a)([self._argument(x, inputs) for x in a])
        return a

    def vid_of(self, t: Tensor) -> int:
        """The value id of ``t`` as it is now, registering leaves and re-read aliases."""
        entry = self.by_id.get(id(t))
        if entry is not None and entry[0]() is t and entry[3] == where(t):
            vid = entry[1]
        else:  # unseen, or moved (``t.data = other``): what it holds now
            vid = self._unseen(t)
        value = self.values[vid]
        # A leaf's content does not change in the forward (the recorder refuses writes into it):
        # another version is another counter (``p.data`` has its own), not other content.
        if value.version != t._version and value.sid not in self.leaf_sids:
            return self.reread(t, vid)
        return vid

    def _unseen(self, t: Tensor) -> int:
        """A tensor object first seen: a parameter or buffer, an alias of a value, or external."""
        self.refuse_unsupported(t)
        leaf = self._leaf_name(t)
        if leaf is not None:
            self.block.leaves_read.setdefault(leaf[1], t)
            return self.new_value(t, -1, 0, leaf[0], leaf[1])
        alias = self._same_view(t)
        if alias is not None:
            self.same_as(t, alias)
            return alias
        viewed = self._leaf_view(t)
        if viewed is not None:
            kind, name, registered = viewed
            # The registered tensor, not ``t``: a write into the leaf bumps its version, not the
            # alias's (``Block.note_leaves``); the same storage and layout for backward.
            self.block.leaves_read.setdefault(name, registered)
            return self.new_value(t, -1, 0, kind, name)
        vid = self.new_value(t, -1, 0, EXTERNAL)
        self.holding.no_producer(vid, t)
        return vid

    def refuse_unsupported(self, t: Tensor) -> None:
        """A tensor subclass's ops would reach its own ``__torch_dispatch__``, not the tape; a
        sparse tensor has no storage to hold or to replay into (``refuse_layout``)."""
        if is_subclass_with_dispatch(t):
            raise TapeSACError(
                f"block {self.block.name!r}: tensor subclass {type(t).__name__} inside a TapeSAC "
                "block is not supported; checkpoint a module whose forward sees plain tensors "
                "(apply FSDP2/DTensor outside the checkpointed block)"
            )
        refuse_layout(t, repr(self.block.name))

    def _same_view(self, t: Tensor) -> int | None:
        """The newest value recorded where ``t`` is (``where``: an alias object)."""
        if not t.untyped_storage().data_ptr():
            return None
        at = where(t)
        # Only a value whose own tensor is alive, and still where it was recorded, proves the
        # storage is the same one: a freed storage's address is reused by new allocations, and
        # ``h.data = h.data.t()`` leaves ``h`` alive on its storage in another layout.
        for ref, vid, _, then in sorted(self.by_id.values(), key=lambda e: -e[1]):
            live = ref()
            if live is not None and then == at and where(live) == then:
                return vid
        return None

    def _leaf_view(self, t: Tensor) -> tuple[ValueKind, str, Tensor] | None:
        """A parameter or buffer seen through another tensor object (``p.data``): its kind, name
        and the tensor the module registers."""
        module = self.block.module
        if module is None:
            return None
        ptr, meta = t.untyped_storage().data_ptr(), layout_of(t)
        for kind, named in ((PARAM, module.named_parameters()), (BUFFER, module.named_buffers())):
            for name, p in named:
                if p.untyped_storage().data_ptr() == ptr and layout_of(p)[:4] == meta[:4]:
                    return kind, name, p
        return None

    def _leaf_name(self, t: Tensor) -> tuple[ValueKind, str] | None:
        """A parameter or buffer of the block's module, by identity.

        The map is kept on the module across calls (walking a module with many experts costs
        more than recording its ops); a miss rebuilds it once per block, since FSDP2 and users
        may swap parameter objects between steps. Entries hold weak references, so a freed
        parameter's id taken by a new tensor is not mistaken for it.
        """
        module = self.block.module
        if module is None:
            return None
        cached = getattr(module, _LEAVES, None)
        entry = cached.get(id(t)) if cached is not None else None
        # A stale entry (a freed leaf whose id Python gave ``t``) is a miss too.
        if (entry is None or entry[0]() is not t) and self._leaves is None:
            cached = self._leaves = {}
            for kind, named in (
                (PARAM, module.named_parameters(remove_duplicate=False)),
                (BUFFER, module.named_buffers(remove_duplicate=False)),
            ):
                for name, p in named:
                    cached.setdefault(id(p), (weakref.ref(p), kind, name))
            # setattr: Module.__setattr__ as ever (a plain attribute), which mypy types for
            # tensors and modules only.
            setattr(module, _LEAVES, cached)
            entry = cached.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    def reread(self, t: Tensor, stale: int) -> int:
        """``t`` was written through another alias since it was recorded: a new value."""
        sid = self.values[stale].sid
        write = self.last_write.get(sid)
        if write is None:  # written by something the tape cannot see: keep its current content
            vid = self.new_value(t, -1, 0, EXTERNAL, sid=sid)
            self.holding.no_producer(vid, t)
            return vid
        block = self.block
        index = len(block.nodes)
        vid = self.new_value(t, index, 0, OP, sid=sid)
        k = self.calls.get(ALIAS_OP, 0)
        self.calls[ALIAS_OP] = k + 1
        module = block.current_module
        block.nodes.append(
            Node(
                index,
                None,
                ALIAS_OP,
                k,
                (slot(0),),
                {},
                [write],
                [write],
                [vid],
                (),
                (),
                None,
                False,
                module,
            )
        )
        if block.plan_coords:
            km = block.anchor_call(ALIAS_OP) if block.plan_anchors else -1
            self.holding.hold_if_planned(ALIAS_OP, k, km, 0, vid, t)
        return vid
