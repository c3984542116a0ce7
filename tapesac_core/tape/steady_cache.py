"""Each module's steady-state tapes: by signature, and across sizes by template.

A module block's recorded calls leave their tapes here (``SteadyCache.put``); a later call finds
the tape of its signature (``get``), or, where its signature differs from recorded ones only in
one size (the batch's length), the tape a trusted template gives at that size
(``size_templates.py``). Tapes whose sizes follow their data (a MoE's routing) go to their
signature's family of op structures instead, whose trusted template a call binds its sizes
into as it runs (``data_sizes.py``). A tape recorded again under a cached signature replaces the
cached one; one recorded at a size a template predicts is compared with the template's tape,
and a template that mispredicts is dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..tensors import Slot
from .data_sizes import DataFamily, DataTemplate
from .signature import Signature
from .size_templates import FIT_POINTS, SizeTemplate, fit, split_signature
from .steady import Recorded, SteadyTape, data_dependent
from .tape import Node, Tape, comparable

logger = logging.getLogger(__name__)

# Per module. A Controller's run cycles through its token buckets, each with its own plan entry
# per block (the main job: 8 planned buckets and must-only control steps); with 8 of each, kinds
# evicted each other and 30-37% of its block calls recorded, with 16 about 22% (the first calls
# of each kind, which templates need). Each entry is a tape of Python objects, no activations.
CACHED_SIGNATURES = 16  # signatures (exact shapes)
CACHED_KINDS = 16  # kinds of call (plan entry, training flags) with size templates
TEMPLATES_PER_KIND = 2  # e.g. two batch sizes, each over many lengths
FAILED_FITS = 3  # fits that made no template, or templates that failed, before giving up
MAX_RECORDED = 64  # calls recorded in a row after tapes' first steady-state calls diverged


def differences(old: Tape, new: Tape) -> str | None:
    """Where a tape recorded again under one signature differs from the cached one, if it does."""
    for a, b in zip(old.nodes, new.nodes):
        if _node_key(a) != _node_key(b):
            return f"op {a.index}: {a.name}{_args(a)} recorded before, {b.name}{_args(b)} now"
    if len(old.nodes) != len(new.nodes):
        return f"{len(old.nodes)} ops recorded before, {len(new.nodes)} now"
    return None


def _node_key(node: Node) -> tuple:
    return (
        node.name,
        tuple(node.inputs),
        tuple(node.outs),
        comparable(node.args),
        comparable(node.kwargs),
    )


def _args(node: Node) -> str:
    shown = [f"t{a.i}" if type(a) is Slot else repr(a) for a in node.args]
    return f"({', '.join(shown)})"


@dataclass
class _Sizes:
    """One kind of call (a signature without its integers): its templates, the recorded calls
    at sizes no template covers yet (signature integers, tape), and how many fits failed."""

    templates: list[SizeTemplate] = field(default_factory=list)
    pending: list[tuple[tuple[int, ...], SteadyTape]] = field(default_factory=list)
    failures: int = 0

    def covering(self, ints: tuple[int, ...]) -> tuple[SizeTemplate, int] | None:
        """The template whose curves ``ints`` lie on, and their size there."""
        for template in self.templates:
            s = template.size_of(ints)
            if s is not None:
                return template, s
        return None


class SteadyCache:
    """One module's steady-state tapes by signature, the most recent ``CACHED_SIGNATURES``; for
    signatures that cannot run in steady state, why; and its size templates. Never copied or
    pickled with the module (a copy records afresh)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Signature, SteadyTape | Recorded] = OrderedDict()
        self._told = False
        # Per signature whose tapes' first steady-state calls diverged, twice or more in a row (a
        # number the forward reads changes every call or two): [divergences in a row, calls
        # still recorded before a tape is tried again]. Recording is cheaper than a steady-state
        # call that diverges (its backward runs the forward again), and right either way.
        self._doubted: dict[Signature, list[int]] = {}
        self._sizes: OrderedDict[Signature, _Sizes] = OrderedDict()
        self._data: OrderedDict[Signature, DataFamily] = OrderedDict()

    def diverged(self, signature: Signature, entry: SteadyTape, name: str, what: str) -> None:
        """A steady-state call ran other ops than its tape: its next call records, and a template
        that gave the tape is dropped. Said once per module at warning level (then at debug
        level): a branch that flips once often flips again. A call whose sizes follow its data
        ran another op structure (another set of experts hit): said at debug level, as routing
        changes it."""
        if isinstance(entry.template, DataTemplate):
            family = self._data.get(signature)
            if family is not None:
                family.diverged(entry.template)
            logger.debug("TapeSAC block %r ran another op structure than its tape (%s)", name, what)
            return
        self._entries.pop(signature, None)
        if not entry.confirmed:
            doubt = self._doubted.setdefault(signature, [0, 0])
            doubt[0] += 1
            doubt[1] = min(2 ** doubt[0], MAX_RECORDED) if doubt[0] >= 2 else 0
        source = "cached tape under the same signature"
        if entry.template is not None:
            source = "tape that calls at other sizes predicted"
            for sizes in self._sizes.values():
                if entry.template in sizes.templates:
                    self._drop(sizes, entry.template)
        logger.log(
            logging.DEBUG if self._told else logging.WARNING,
            "TapeSAC block %r ran other ops than its %s (%s): its backward recomputes its "
            "forward, as torch.utils.checkpoint does, and its next call is recorded",
            name,
            source,
            what,
        )
        self._told = True

    def confirmed(self, signature: Signature, entry: SteadyTape) -> None:
        """A steady-state call of ``signature`` ran ``entry``'s ops: its tapes are trusted
        again, and a template it ran (another than it started from, ``structure_switch.py``)
        is where the next call starts."""
        self._doubted.pop(signature, None)
        family = self._data.get(signature)
        if family is not None and isinstance(entry.template, DataTemplate):
            family.ran(entry.template)

    def family(self, signature: Signature) -> DataFamily | None:
        """The op structures of ``signature``'s calls whose sizes follow their data."""
        return self._data.get(signature)

    def __reduce__(self) -> tuple:
        return (SteadyCache, ())

    def tapes(self) -> list[Tape]:
        """The tapes cached now."""
        tapes = [e.tape for e in self._entries.values() if isinstance(e, SteadyTape)]
        for family in self._data.values():
            for structure in family.structures:
                tapes.extend(p.tape for p in structure.points)
                if structure.template is not None:
                    tapes.append(structure.template.base.tape)
        return tapes

    def get(self, signature: Signature) -> SteadyTape | Recorded:
        """The entry for ``signature`` (made by a trusted template if need be), or why its call
        must record."""
        entry = self._entries.get(signature)
        if entry is not None:
            self._entries.move_to_end(signature)
            doubt = self._doubted.get(signature)
            if isinstance(entry, SteadyTape) and doubt is not None and doubt[1] > 0:
                doubt[1] -= 1
                return Recorded.GRAPH_DIFFERS
            return entry
        family = self._data.get(signature)
        if family is not None:
            self._data.move_to_end(signature)
            return family.entry() or Recorded.DATA_SIZES
        masked, ints = split_signature(signature)
        sizes = self._sizes.get(masked)
        if sizes is None:
            return Recorded.FIRST_CALL
        covered = sizes.covering(ints)
        if covered is None or not covered[0].trusted:
            return Recorded.SIZES if sizes.failures >= FAILED_FITS else Recorded.FIRST_CALL
        template, s = covered
        made = template.at(s)
        self._store(signature, made)
        return made

    def put(self, signature: Signature, entry: SteadyTape | Recorded, name: str) -> None:
        """What a recorded call of ``signature`` gave: it replaces the cached entry."""
        if isinstance(entry, SteadyTape) and data_dependent(entry.tape):
            self._entries.pop(signature, None)
            family = self._data.get(signature)
            if family is None:
                family = self._data[signature] = DataFamily()
                while len(self._data) > CACHED_SIGNATURES:
                    self._data.popitem(last=False)
            self._data.move_to_end(signature)
            family.learn(entry)
            return
        old = self._entries.get(signature)
        changed = None
        if isinstance(old, SteadyTape) and isinstance(entry, SteadyTape):
            changed = differences(old.tape, entry.tape)
            if changed is not None:
                # Calls between ran checked (``op_checks.py``): the forward changed since.
                logger.debug(
                    "TapeSAC block %r recorded other ops than its cached tape under the same "
                    "signature (%s): the new tape replaces it",
                    name,
                    changed,
                )
        self._store(signature, entry)
        if isinstance(entry, SteadyTape):
            self._learn_sizes(signature, entry, name, told=changed is not None)

    def _store(self, signature: Signature, entry: SteadyTape | Recorded) -> None:
        self._entries[signature] = entry
        self._entries.move_to_end(signature)
        while len(self._entries) > CACHED_SIGNATURES:
            evicted, _ = self._entries.popitem(last=False)
            self._doubted.pop(evicted, None)

    def _learn_sizes(self, signature: Signature, entry: SteadyTape, name: str, told: bool) -> None:
        """A recorded tape: checks the template whose curves its signature lies on (trusted
        when it predicts the tape exactly, dropped otherwise), or joins the calls the next
        template is fitted from."""
        masked, ints = split_signature(signature)
        sizes = self._sizes.get(masked)
        if sizes is None:
            sizes = self._sizes[masked] = _Sizes()
            while len(self._sizes) > CACHED_KINDS:
                self._sizes.popitem(last=False)
        self._sizes.move_to_end(masked)
        if sizes.failures >= FAILED_FITS:
            return
        covered = sizes.covering(ints)
        if covered is not None:
            template, s = covered
            if template.predicts(s, entry):
                template.trusted = template.trusted or s not in template.fitted
                return
            if template.trusted and not told:
                logger.warning(
                    "TapeSAC block %r ran other ops at its size %d than its calls at other "
                    "sizes predicted; calls at sizes not seen are recorded again",
                    name,
                    s,
                )
            self._drop(sizes, template)
        if any(known == ints for known, _ in sizes.pending):
            return
        sizes.pending.append((ints, entry))
        if len(sizes.pending) < FIT_POINTS:
            return
        fitted = fit(sizes.pending)
        if fitted is None:
            sizes.failures += 1
            sizes.pending.pop(0)  # the oldest call may be from another line (batch size)
            return
        sizes.pending.clear()
        sizes.templates.append(fitted)
        del sizes.templates[:-TEMPLATES_PER_KIND]

    def _drop(self, sizes: _Sizes, template: SizeTemplate) -> None:
        """A template that failed: gone, with the tapes it gave."""
        sizes.templates.remove(template)
        sizes.failures += 1
        for signature in [s for s, e in self._entries.items() if _made_by(e, template)]:
            del self._entries[signature]


def _made_by(entry: SteadyTape | Recorded, template: SizeTemplate) -> bool:
    return isinstance(entry, SteadyTape) and entry.template is template


_CACHE = "_tapesac_steady"  # the module attribute that holds its cache


def steady_cache(module: torch.nn.Module) -> SteadyCache:
    """The module's cache, made on first use."""
    cache = module.__dict__.get(_CACHE)
    if cache is None:
        cache = module.__dict__[_CACHE] = SteadyCache()
    return cache


def forget_steady_cache(module: torch.nn.Module) -> None:
    """Drop the module's cache (restoring a block)."""
    module.__dict__.pop(_CACHE, None)
