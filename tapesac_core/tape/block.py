"""One call of a checkpointed block: its tape, the tensors it keeps, and its unpack entry point."""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._compat import graph_task_id
from ..errors import COPY_FIX, LEAF_FIX, TapeSACError, moved_after_forward, written_after_forward
from ..measure.timeline import BlockProbe
from ..measure.timing import NodeTimer
from ..plan.coords import Anchor, Coord
from ..plan.plan import BlockKind
from ..tensors import detached, is_subclass_with_dispatch
from .lifetimes import StorageLifetimes
from .op_checks import submodule_at
from .replay import Replay
from .tape import (
    BUFFER,
    DYNAMIC_SHAPE,
    INPUT,
    OP,
    PARAM,
    Mandatory,
    Node,
    ReplayMemo,
    Tape,
    Value,
)
from .values import where
from .verify import HiddenWrites

if TYPE_CHECKING:
    from .draws import Draws
    from .offload import OffloadedBlock
    from .recompute import Recompute
    from .steady import SteadyTape

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class BlockTrace:
    """What one block call recorded and replayed; holds no tensors."""

    tape: Tape
    saved: frozenset[int] = (
        frozenset()
    )  # op values held for backward (S0 and planned) after forward
    replayed: list[int] = field(default_factory=list)  # node indices run by replay, in order
    node_times: dict[int, list[Any]] = field(default_factory=dict)  # replayed node -> timer samples
    forward_times: dict[int, Any] = field(default_factory=dict)  # node -> its forward timer sample
    alive_taken: set[int] = field(default_factory=set)  # demanded values taken alive, not replayed
    unpacked: set[int] = field(default_factory=set)  # demanded values autograd actually read
    sequence_changed: bool = False  # another op sequence than the plan's: anchored coordinates used
    over_budget: int = 0  # planned values not kept: their bytes exceeded the block's budget
    replay_seconds: float = 0.0  # wall time its replays took in backward (host clock)
    forward_seconds: float | None = None  # wall time of its recorded forward (CPU profile steps)
    invisible_writes: list = field(default_factory=list)  # coordinates replay did not reproduce
    steady: bool = False  # run from a cached tape (its checks passed: not ``diverged``)
    recorded_because: str | None = None  # why a module block was recorded (``steady.Recorded``)
    diverged: str | None = None  # a steady-state call that ran other ops than its tape: what
    draws_bytes: int = 0  # generator states a steady-state call keeps for its random ops
    # Bytes of its held inputs that nothing else held when the next block's forward started
    # (profiling steps; None: not measured): what offloading can take off beyond its own values.
    inputs_alone: int | None = None
    # Its place among the blocks of its region whose forward started in the trace, in order,
    # those a plan ran plain or under torch's checkpoint (no trace) included.
    position: int = 0
    # Its block, weakly: autograd's saved tensors hold the block until it frees the graph.
    block: weakref.ReferenceType[Block] | None = field(default=None, repr=False)

    @property
    def released(self) -> bool:
        """Whether autograd has freed the block's saved values: after its backward, or with the
        graph of a forward that reached none (then ``unpacked`` is empty)."""
        return self.block is not None and self.block() is None

    @property
    def saved_bytes(self) -> int:
        """Bytes this block keeps for backward beyond its leaves (storages counted once)."""
        return self.tape.bytes_of(self.saved)

    @property
    def rng_bytes(self) -> int:
        """Bytes of the generator states this call keeps to replay its random ops: one per random
        op recorded, one per generator in steady state."""
        return self.tape.rng_bytes + self.draws_bytes


# Plan entries for a block that is not recorded: run as without checkpointing (autograd keeps
# everything it saves until the block's backward), or under torch.utils.checkpoint.
PLAIN = BlockKind.PLAIN
TORCH_CHECKPOINT = BlockKind.TORCH_CHECKPOINT


class BlockPlan(NamedTuple):
    """What one block call saves: coordinates, the op sequence they are valid for (None: any),
    the bytes they may keep beyond S0 (None: no bound), and the same set anchored on submodules
    with those submodules' op digests (for a block that runs another op sequence); how the
    block runs (``kind``: when not recorded, the rest is empty); and whether it offloads what it
    holds to host memory after its forward (``offload.py``)."""

    coords: frozenset[Coord] = frozenset()
    sequence: str | None = None
    budget: int | None = None
    anchors: frozenset[Anchor] = frozenset()
    modules: Mapping[str, str] = {}
    kind: BlockKind = BlockKind.TAPE
    offload: bool = False


class Block:
    """State of one checkpointed block call, from its forward to the end of its backward."""

    def __init__(
        self,
        name: str,
        region: str,
        module: torch.nn.Module | None,
        plan: BlockPlan,
        recording: Callable[[], Any],
        hidden_writes: HiddenWrites,
    ) -> None:
        self.name, self.region, self.module = name, region, module
        self.hidden_writes = hidden_writes
        (
            self.plan_coords,
            self.plan_sequence,
            self.plan_budget,
            self.plan_anchors,
            self.plan_modules,
            _,
            _,
        ) = plan  # a Block exists because its entry is recorded; offloading is the step's
        self.anchored: set[int] = set()  # held for an anchored coordinate of the plan
        self.module_calls: dict[tuple[str, str], int] = {}  # (module, op) -> calls so far
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.storage_bytes: list[int] = []
        self.lifetimes = StorageLifetimes(self.nodes)  # when the forward frees its storages
        self.demand: frozenset[int] = frozenset()  # P: the values autograd packed (set in finish)
        self.mandatory: dict[int, Mandatory] = {}
        self.planned: set[int] = set()
        self.planned_seen: set[tuple] = set()
        self.held: dict[int, torch.Tensor] = {}
        self.kept: frozenset[int] = frozenset()  # held, or fetched by name: set in finish
        # Demanded values alive at the end of forward, set in finish: a weak reference and the
        # version the value has (backward takes it if it is still alive with that version).
        self.refs: dict[int, tuple[weakref.ref, int]] = {}
        self.pack_count: Mapping[int, int] = {}  # packs per value, set in finish: keys are P
        # Per pack, the value packed: autograd's handle is the pack's index (an int, which the
        # garbage collector does not track), and the block's unpack hook resolves it.
        self.handles: Sequence[int] = []
        self.host_sync = False  # an op returned a number: the data may steer the ops
        self.host_floats = False  # a float among them: it may be a number ops compute with
        # Per submodule exit, in order, each tensor it returned: its value (None: unrecorded)
        # and its shape and dtype.
        self.exits: list[tuple[tuple[int | None, tuple[torch.Size, torch.dtype]], ...]] = []
        self.on_exit: Callable[[Any], None] | None = None
        # A steady-state call whose forward diverged from its tape: backward recomputes it.
        self.recompute: Recompute | None = None
        self.draws: Draws | None = None  # a steady-state call's random ops' generator states
        self.current_module: str | None = None
        self._module_stack: list[str] = []
        self.timer: NodeTimer | None = None
        self.recording = True
        self._active_recording = recording
        self._replay: tuple[int, Replay] | None = None
        self.memo: ReplayMemo | None = None  # a steady-state call's: its cached tape's closures
        # Some node writes in place: only then must replay guard what it must not write into.
        self.writes_in_place = False
        # leaf -> (its submodule, None where no longer registered; its attribute)
        self._owners: dict[str, tuple[torch.nn.Module | None, str]] = {}
        # The parameters and buffers backward fetches by name, as the forward used them and
        # with their versions then (``note_leaves``), for the forward's own where the module
        # holds another at backward; and, while a recording runs, each as the forward first
        # read it (``ValueIds``).
        self._leaves_used: dict[str, tuple[torch.Tensor, int]] = {}
        self.leaves_read: dict[str, torch.Tensor] = {}
        self.device_types: set[str] = set()  # of the recorded layouts (ValueIds.layout)
        self.verify = False  # fingerprint packed values; replay compares (see verify.py)
        self.deterministic_ops: frozenset[str] = frozenset()  # custom ops declared not random
        self.fingerprints: dict[int, torch.Tensor] = {}
        self.forced = hidden_writes.of(region)  # coordinates held as mandatory: hidden writes
        self.probe: BlockProbe | None = None  # on metered sample steps
        # What the step's ``Offload`` copied to host memory (``offload.py``): back at the first
        # unpack.
        self.offloaded: OffloadedBlock | None = None
        # A block of such a step that keeps its values tells the ``Offload`` at its first unpack
        # instead: the block before it starts its copy back then, one block ahead.
        self.backward_started: Callable[[], None] | None = None
        # Per held value on a storage the block's outputs or inputs are on, or read from
        # outside, one of those tensors and its version at the end of forward
        # (``watch_writes``), checked as backward reads the value.
        self._watched: dict[int, tuple[torch.Tensor, int]] = {}
        # Per watched tensor read from outside that autograd saved, ``where`` it was at the end
        # of forward: one moved since (``.data =``) is read by plain autograd where it is now;
        # one held only for replay keeps the bytes the forward read.
        self._outside_at: dict[int, tuple] = {}
        self._droppable: dict[int, tuple[torch.Tensor, int]] = {}  # those replay can make
        self.trace = BlockTrace(
            Tape(
                name,
                region,
                self.nodes,
                self.values,
                self.storage_bytes,
                frozenset(),
                {},
                frozenset(),
            ),
            block=weakref.ref(self),
        )

    # ------------------------------------------------------------------ bookkeeping

    @property
    def alive_taken(self) -> set[int]:
        return self.trace.alive_taken

    def is_running(self) -> bool:
        """This block's forward (or its recomputation) is the one running in this context."""
        return self._active_recording() is self

    def enter_module(self, path: str) -> None:
        """A submodule's forward starts: ops recorded now are issued by ``path``."""
        self._module_stack.append(path)
        self.current_module = path

    def exit_module(self, output: Any = None) -> None:
        """A submodule's forward returned ``output``: told to the recorder or the steady-state
        forward (``on_exit``), which may hold values from it."""
        if self._module_stack:
            self._module_stack.pop()
        self.current_module = self._module_stack[-1] if self._module_stack else None
        if self.on_exit is not None:
            self.on_exit(output)

    def is_kept(self, vid: int) -> bool:
        """Available without replay: held by the block, or a parameter/buffer fetched by name."""
        return vid in self.kept

    def kept_tensor(self, vid: int) -> torch.Tensor:
        t = self.held.get(vid)
        if t is None:
            return self.fetch(self.values[vid])
        return self._unwritten(vid, t) if self._watched else t

    def fetch(self, value: Value) -> torch.Tensor:
        """A parameter or buffer by name: as the forward used it once the forward ended
        (``note_leaves``), else as the module holds it now."""
        # A parameter or buffer value is named by its path in the block's module (by name, not
        # value id: a call that switches templates, ``structure_switch.py``, renames values).
        assert isinstance(value.name, str) and self.module is not None
        used = self._leaves_used.get(value.name)
        if used is not None:  # backward: no walk to the owning submodule per call
            return self._unwritten_leaf(value, *used)
        owner = self._owners.get(value.name)
        if owner is None:
            path, _, attr = value.name.rpartition(".")
            owner = self._owners[value.name] = (submodule_at(self.module, path), attr)
        module, attr = owner
        # The registry first: Module.__getattr__ is a Python frame per unpack of a parameter.
        t = None
        if module is not None:
            t = (module._parameters if value.kind == PARAM else module._buffers).get(attr)
            if t is None:
                t = getattr(module, attr, None)
        if t is None:
            raise TapeSACError(
                f"block {self.name!r}: {value.kind} {value.name!r}, which its forward read, is "
                "not on the module. Fix: keep it registered until the block's backward"
            )
        if is_subclass_with_dispatch(t):
            raise TapeSACError(
                f"block {self.name!r}: {value.kind} {value.name!r} is a {type(t).__name__}, not "
                "the unsharded tensor its forward reads. Fix: shard with FSDP2 at the "
                "checkpointed module or above it (fully_shard(block) after checkpoint_module)"
            )
        return t

    def _unwritten_leaf(self, value: Value, t: torch.Tensor, version: int) -> torch.Tensor:
        """``t``, parameter or buffer ``value`` as the forward used it, unless code wrote into it
        in place since (an optimizer step before backward): backward recomputes from it, so
        it would read the new values where autograd raises (or, for a tensor autograd did not
        save, reads the old ones); or unless its storage is freed (FSDP2 resharded it and has
        not gathered it again). Then a TapeSACError naming the fix."""
        if t._version != version:
            raise written_after_forward(
                self.name, f"its {value.kind} {value.name!r}", version, t._version, LEAF_FIX
            )
        if not t.untyped_storage().nbytes() and t.numel():
            raise TapeSACError(
                f"block {self.name!r}: {value.kind} {value.name!r}, which its forward read, has "
                "no storage in its backward (FSDP freed it and has not gathered it again). Fix: "
                "shard with FSDP2 at the checkpointed module or above it (fully_shard(block) "
                "after checkpoint_module)"
            )
        return t

    def note_leaves(self, read: Mapping[str, torch.Tensor]) -> None:
        """End of forward: the parameters and buffers backward fetches by name, as the forward
        first read them (``read``, by name), else as the module holds them now, each with its
        version, which backward checks (``_unwritten_leaf``). Backward takes
        these where the module holds other tensors by then: ``torch.func.functional_call``
        swaps its tensors in for the forward and back before backward, and a forward may
        replace a buffer it read (``self.scale = self.scale * 0.5``). FSDP2 gathers into the
        same tensors it registered in forward, so under it nothing changes."""
        values = self.values
        self._leaves_used = {}
        used = {}
        for vid in self.kept:
            value = values[vid]
            if value.kind == PARAM or value.kind == BUFFER:
                name = str(value.name)
                first = read.get(name)
                t = first if first is not None else self.fetch(value)
                used[name] = (t, t._version)
        self._leaves_used = used

    def finish(
        self, outputs: frozenset[int], alive: Callable[[Collection[int]], dict[int, Any]]
    ) -> None:
        """End of forward: freeze the tape; drop kept tensors no replay or unpack can reach.
        ``alive`` gives weak references to the tensors of values still alive (``Recorder.alive``)."""
        self.recording = False
        self.pack_count = Counter(self.handles)
        tape = Tape(
            self.name,
            self.region,
            self.nodes,
            self.values,
            self.storage_bytes,
            frozenset(self.pack_count),
            dict(self.mandatory),
            frozenset(self.planned),
            outputs,
            frozenset(v for returned in self.exits for v, _ in returned if v is not None),
            self.host_sync,
            self.lifetimes.stop(),
            self.host_floats,
        )
        self.demand = tape.demand
        if self.plan_sequence is not None and tape.fingerprint != self.plan_sequence:
            self.trace.sequence_changed = True
            self.planned = self._matching_anchors(tape)
        if self.plan_budget is not None and tape.saved_bytes(self.planned) > self.plan_budget:
            self.planned = self._within_budget(tape, self.plan_budget)
        tape.planned = frozenset(self.planned)
        available = tape.always_available | tape.planned
        self._drop_unread(tape, available)
        values = self.values
        self.refs = alive({v for v in tape.demand if values[v].kind == OP and v not in self.held})
        fetched = {v for v in available if values[v].kind in (PARAM, BUFFER)}
        self.kept = frozenset(self.held) | fetched
        missing = self.plan_coords - self.planned_seen
        if missing and not self.trace.sequence_changed:
            logger.warning(
                "block %r (region %r): the plan names coordinates this block does not "
                "have, nothing saved for them: %s",
                self.name,
                self.region,
                ", ".join(str(tuple(c)) for c in sorted(missing)),  # as use_plan takes them
            )
        self.trace.tape = tape
        self.trace.saved = frozenset(v for v in self.held if self.values[v].kind == OP)
        self.note_leaves(self.leaves_read)
        self.leaves_read = {}

    def outliving(
        self, alive: Callable[[Collection[int]], dict[int, Any]]
    ) -> list[tuple[int, Any]]:
        """At the end of forward, the values whose tensors are still alive that the block does
        not hold, on storages of its own (not of its leaves): one per storage, its latest
        value, with the storage. A caller may keep them a while (a returned tuple, a cache);
        the memory timeline notes when each is freed. ``alive`` as ``finish`` takes it."""
        values = self.values
        held = {values[v].sid for v in self.held}
        held |= {v.sid for v in values if v.kind != OP}
        candidates = {v.vid for v in values if v.kind == OP and v.sid not in held}
        latest: dict[int, tuple[int, Any]] = {}
        for vid, (ref, _) in sorted(alive(candidates).items()):
            t = ref()
            if t is not None:
                latest[values[vid].sid] = (vid, t.untyped_storage())
        return list(latest.values())

    def adopt(self, entry: SteadyTape) -> None:
        """Run from a cached tape (steady state): what a recorded call's ``finish`` set, but the
        held tensors and the values backward may take alive, which the call itself supplies."""
        tape = entry.tape
        self.nodes, self.values, self.storage_bytes = tape.nodes, tape.values, tape.storage_bytes
        # Copies where recording mutates its own (a few values: S0 and the plan's).
        self.demand, self.mandatory, self.planned = (
            tape.demand,
            dict(tape.mandatory),
            set(tape.planned),
        )
        self.handles, self.pack_count, self.kept = entry.handles, entry.pack_count, entry.kept
        self.writes_in_place, self.device_types = entry.writes_in_place, set(entry.device_types)
        self.trace.tape, self.trace.saved, self.trace.steady = tape, entry.saved, True
        self.memo = entry.memo

    def _drop_unread(self, tape: Tape, available: frozenset[int]) -> None:
        """Release held tensors one backward never reads: a kept value is demanded or read by a
        replayed node (``tape.needed_sources``). Where every held value is demanded and
        available, nothing can go, and the sweep over the tape is left to backward
        (``Replay``), which counts reads anyway."""
        demand, held = tape.demand, self.held
        if all(v in demand and v in available for v in held):
            return
        needed = tape.needed_sources(tape.planned)
        for vid in [v for v in held if v not in needed]:
            del held[vid]

    def _matching_anchors(self, tape: Tape) -> set[int]:
        """The plan's coordinates were solved on another op sequence and may name other tensors
        here; its anchored coordinates in submodules whose own ops match the reference's still
        name the values the plan chose."""
        digests = tape.module_fingerprints
        modules = {v: anchor[0] for v in self.anchored if (anchor := tape.anchor(v)) is not None}
        return {v for v, m in modules.items() if digests[m] == self.plan_modules.get(m)}

    def _within_budget(self, tape: Tape, budget: int) -> set[int]:
        """The planned values, in forward order, that fit the plan's bytes for this block.

        Sizes that depend on data (tokens routed to one expert) can exceed what the plan was
        solved for; keeping them all could break the memory limit. Values are held
        until here, so the excess lives only during this block's forward.
        """
        kept: set[int] = set()
        for vid in sorted(self.planned):
            if tape.saved_bytes(kept | {vid}) <= budget:
                kept.add(vid)
        self.trace.over_budget = len(self.planned) - len(kept)
        logger.debug(
            "block %r: %d planned values over the plan's %d bytes, not kept",
            self.name,
            self.trace.over_budget,
            budget,
        )
        return kept

    def anchor_call(self, name: str) -> int:
        """Count a call of op ``name`` by the current submodule: its anchored ``k``."""
        key = (self.current_module or "", name)
        k = self.module_calls.get(key, 0)
        self.module_calls[key] = k + 1
        return k

    def enable_timing(self, device: torch.device) -> None:
        """Time every op this block runs, in forward and in replay (events on accelerators)."""
        self.timer = NodeTimer(device)

    # ------------------------------------------------------------------ backward

    def unpack(self, handle: int) -> torch.Tensor:
        """The block's saved-tensor unpack hook: the value of ``handle``, replaying its producers
        if needed. Autograd holds the hook with every saved tensor, and so the block."""
        active = self._active_recording()
        if self.recording or active is not None:
            raise TapeSACError(
                f"block {self.name!r}: a saved tensor was unpacked (a backward pass ran) during the "
                f"forward of block {(active or self).name!r}. Reentrant use is not supported: do not "
                "call backward or torch.autograd.grad inside a checkpointed module"
            )
        if torch.is_grad_enabled():
            # Backward with create_graph=True (double backward): autograd attaches the saved
            # tensor's forward history to what this returns, so the value is all it needs; a
            # replay that recorded its own graph would hold memory and time for nothing.
            with torch.no_grad():
                return self._unpack(handle)
        return self._unpack(handle)

    def watch_writes(
        self, tensors: Sequence[torch.Tensor], outside: Mapping[int, torch.Tensor]
    ) -> None:
        """End of forward: the held values on storages that ``tensors`` (the block's outputs and
        inputs) are on, each with one of those tensors and its version, and the held values
        read from outside the block (``outside``: value id -> the tensor as the forward read
        it). Code after the block may write into them in place (``_drop_written``,
        ``_unwritten``). Each tensor is kept as the caller's or a ``detach`` made here, which
        shares the caller's version counter (views of it share it too; a value the block
        holds was detached inside the recorder's dispatch mode and has a counter of its own).
        Empty values are not watched: every empty storage's address is 0."""
        by_storage = {t.untyped_storage().data_ptr(): t for t in tensors}
        self._watched, self._outside_at = {}, {}
        for vid, t in self.held.items():
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            seen = by_storage.get(ptr) if ptr else None
            if seen is not None:
                self._watched[vid] = (detached(seen), seen._version)
            source = outside.get(vid)
            if source is not None and ptr and source.untyped_storage().data_ptr() == ptr:
                self._watched[vid] = (source, source._version)
                if vid in self.demand:  # autograd saved it: plain autograd reads it moved
                    self._outside_at[vid] = where(source)
        # Looked through at every unpack: only outputs replay can make (most blocks: none).
        self._droppable = {v: w for v, w in self._watched.items() if self._replayable(v)}

    def own_tensors(self, vids: Sequence[int]) -> int:
        """How many tensors of the block's own are on the storage of held values ``vids``: those
        it holds and those it watches for writes (``watch_writes``)."""
        watched = (self._watched[v][0] for v in vids if v in self._watched)
        return len({id(self.held[v]) for v in vids} | {id(t) for t in watched})

    def written_since_forward(self, vid: int) -> bool:
        """Whether code after the forward wrote into held value ``vid`` through a tensor the
        block watches (``watch_writes``): backward will refuse it (``_unwritten``)."""
        watched = self._watched.get(vid)
        return watched is not None and watched[0]._version != watched[1]

    def let_go(self, vid: int) -> None:
        """Stop holding value ``vid`` (offloaded, ``offload.py``): where the block was its only
        holder, no code can write into it any more, so it is not watched either."""
        del self.held[vid]
        self._watched.pop(vid, None)
        self._droppable.pop(vid, None)

    def _drop_written(self) -> None:
        """Held values that code after the block wrote into in place, through one of the
        block's outputs or inputs: backward would read the new values. One the tape can make
        (an output the plan kept) is dropped and replayed from its producers, as where the plan
        does not keep it (``_droppable``); an input, a tensor read from outside, or a value
        replay cannot make is left to ``_unwritten``, where backward reads it."""
        for vid, (seen, version) in list(self._droppable.items()):
            if seen._version == version:
                continue
            del self._droppable[vid], self._watched[vid], self.held[vid]
            self.kept = self.kept - {vid}
            self.memo = None  # its closures and read counts assume the cached tape's held values
            self._replay = None

    def _replayable(self, vid: int) -> bool:
        """Whether replay can make held value ``vid`` again: an op's output that is not in S0,
        or is there only for its data-dependent shape (replay reads it from the data)."""
        reason = self.mandatory.get(vid)
        return self.values[vid].kind == OP and (reason is None or reason == DYNAMIC_SHAPE)

    def _unwritten(self, vid: int, t: torch.Tensor) -> torch.Tensor:
        """``t``, held value ``vid``, unless code after the block wrote into its storage through
        one of the block's inputs, a tensor it read from outside, or an output replay cannot
        make: then a TapeSACError naming the fix, as autograd raises for the tensors it saves
        itself."""
        watched = self._watched.get(vid)
        if watched is not None and self.written_since_forward(vid):
            seen, version = watched
            shown = f"{tuple(seen.shape)} {seen.dtype}"
            kind = self.values[vid].kind
            if kind == INPUT:
                what = f"its input {shown}, whose storage the block keeps for backward,"
            elif kind == OP:
                what = (
                    f"its output {shown}, which the block keeps for backward and replay cannot "
                    f"make again ({self.mandatory[vid]}),"
                )
            else:
                what = (
                    f"a tensor {shown} it read from outside the block (not its input, a "
                    "parameter or a buffer), which it keeps for backward,"
                )
            raise written_after_forward(self.name, what, version, seen._version)
        at = self._outside_at.get(vid)
        if at is not None and watched is not None and where(watched[0]) != at:
            shown = f"{tuple(watched[0].shape)} {watched[0].dtype}"
            raise moved_after_forward(
                self.name, f"a tensor {shown} it read from outside the block", COPY_FIX
            )
        return t

    def _unpack(self, handle: int) -> torch.Tensor:
        gid = graph_task_id()
        if self.offloaded is not None:
            self.offloaded.restore(self)
        elif self.backward_started is not None:
            started, self.backward_started = self.backward_started, None
            started()
        if self.recompute is not None:
            return self.recompute.take(handle, self)
        if self._droppable:
            self._drop_written()
        vid = self.handles[handle]
        self.trace.unpacked.add(vid)
        if self.probe is not None:
            return self.probe.unpack(vid, lambda: self._take(vid, handle, gid))
        return self._take(vid, handle, gid)

    def _take(self, vid: int, handle: int, gid: int) -> torch.Tensor:
        t = self.held.get(vid)
        if t is not None:
            return self._unwritten(vid, t) if self._watched else t
        if self.is_kept(vid):
            return self.fetch(self.values[vid])
        return self._replay_for(gid).take(vid, handle)

    def _replay_for(self, gid: int) -> Replay:
        """One replay state per backward pass; a second backward (retain_graph) replays again."""
        if gid == -1:
            return Replay(self)
        if self._replay is None or self._replay[0] != gid:
            self._replay = (gid, Replay(self))
        return self._replay[1]
