"""Steady state for blocks whose sizes follow their data: a loop over the experts that received
tokens, a split by counts read with ``.tolist()``.

Why. Such a block runs the same ops call after call (the router, one segment per expert hit, the
combine), but how many tokens each expert gets comes from the routing: no two calls have the
same sizes, and no size template (``size_templates.py``: sizes as curves of the input's length)
fits them. Recording every call costs a Python dispatch per op; a steady-state call costs none.

Contract. A steady-state call sees what autograd saves, in order (``steady.py``). Recorded calls
of one module under one signature with one structure (everything but their size integers,
``size_templates.skeleton``) make a template once their size integers are told apart:

- the integers of the packed tensors (shape, then strides and storage offset, pack by pack) are
  its symbols: one that is, in every call, ``c0 + c1 * x`` of an earlier symbol ``x`` (integers
  ``c0``, ``c1``) is that symbol's; one that varies and is no earlier symbol's is a new symbol;
- every other size integer (ops' integer arguments, layouts, storage bytes, held views) is the
  same in every call or ``c0 + c1 * x`` of exactly one symbol. One that several symbols fit over
  the calls seen waits for more calls; one that none fits makes no template.

A template is trusted once it predicts a recorded call exactly. A steady-state call then binds
each symbol at the pack that first carries it and checks every other packed integer and dtype
against the bindings so far, and that a packed view of a parameter or buffer lies on that
tensor's storage (which expert's weights the loop took). What it holds from a pack or from a
submodule's output it takes at the bound sizes; at the end of its forward it runs from the tape
at its bindings, with the template's replay closures (they follow the structure, not sizes). A
mismatch is a divergence (``steady.py``): backward recomputes the forward as torch's checkpoint
does, and the next call records, which learns another structure (another set of experts hit) or
finds one already trusted.

Out of sight, as for any steady-state call: a number read from the data that steers an op
without changing what autograd saves, how big it is, its view or its storage (an integer an op
computes with, read by ``.item()``). Blocks that read floats from tensors stay recorded
(``steady.tape_blocker``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .size_templates import (
    EMPTY,
    EXIT_HOLD,
    HOLD,
    NODES,
    PACKS,
    VIEWS,
    Cursor,
    changing,
    flat_ints,
    map_part,
    object_positions,
    rebuilt,
    size_arguments,
    size_integers,
    skeleton,
)
from .steady import Holds, Layout, SteadyTape
from .tape import ReplayMemo

if TYPE_CHECKING:
    from .block import Block

STRUCTURES = 4  # op structures a signature keeps (sets of experts hit), the most recent
POINTS = 16  # recorded calls of one structure a template is fitted from, the most recent
# Recorded calls a template that diverged must predict before calls run from it again: the call
# that diverged ran unrecorded, and calls like it (other experts at the same counts) must get
# recorded, so that a template fits them too, rather than calls it predicts re-trusting it.
DOUBTED_CALLS = 2


class Affine(NamedTuple):
    """A size integer as ``(a * x + b) // d``, ``x`` the call's value of symbol ``symbol``: an
    expert's index is its weight view's offset over the expert's size (``d`` divides exactly in
    every call, ``DataBinding.finish`` checks)."""

    symbol: int
    a: int
    b: int
    d: int

    def at(self, x: Sequence[int]) -> int:
        return (self.a * x[self.symbol] + self.b) // self.d

    def exact(self, x: Sequence[int]) -> bool:
        return (self.a * x[self.symbol] + self.b) % self.d == 0


def _direction(column: Sequence[int]) -> tuple[int, ...]:
    """How ``column`` moves over the calls, up to scale and sign: symbols it may be affine in."""
    steps = [n - column[0] for n in column[1:]]
    g = math.gcd(*steps)
    first = next(s for s in steps if s)
    sign = 1 if first > 0 else -1
    return tuple(sign * s // g for s in steps)


class _Symbols:
    """The symbols found so far: each one's column over the calls, by direction."""

    def __init__(self) -> None:
        self.columns: list[Sequence[int]] = []
        self._by_direction: dict[tuple[int, ...], list[int]] = {}

    def new(self, column: Sequence[int]) -> Affine:
        symbol = len(self.columns)
        self.columns.append(column)
        self._by_direction.setdefault(_direction(column), []).append(symbol)
        return Affine(symbol, 1, 0, 1)

    def fitting(self, column: Sequence[int]) -> list[Affine]:
        """Each symbol that ``column`` is, in every call, an affine function of (rational
        coefficients, integer values)."""
        found = []
        for symbol in self._by_direction.get(_direction(column), ()):
            x = self.columns[symbol]
            i = next(i for i in range(1, len(x)) if x[i] != x[0])
            c1 = Fraction(column[i] - column[0], x[i] - x[0])
            c0 = column[0] - c1 * x[0]
            d = math.lcm(c1.denominator, c0.denominator)
            a, b = int(c1 * d), int(c0 * d)
            if all(a * u + b == v * d for u, v in zip(x, column)):
                found.append(Affine(symbol, a, b, d))
        return found


@dataclass(eq=False)
class DataTemplate:
    """A module's tape at one signature and op structure, as a function of the sizes its calls
    bind from their packs (see the module)."""

    base: SteadyTape  # its first recorded call
    sizes: tuple[Affine | None, ...]  # per size integer of ``base`` (None: the same in every call)
    sources: tuple[int, ...]  # per symbol, the position of the integer that binds it
    trusted: bool = False  # it predicted a recorded call exactly
    doubted: int = 0  # recorded calls it must still predict after a divergence (DOUBTED_CALLS)
    # The calls' replay closures, shared: they follow the structure, not the sizes.
    memo: ReplayMemo = field(default_factory=ReplayMemo, init=False)
    # How far its calls are the same as each other template's but for sizes, found at the
    # first switch between them (``structure_switch.Agreement``), and its tape with its sizes
    # zeroed, for finding that.
    agreements: weakref.WeakKeyDictionary[DataTemplate, Any] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )
    zeroed: SteadyTape | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._changing = changing(self.base, self.sizes)
        self._integers = size_integers(self.base)
        self.entry = replace(self.base, template=self)  # what a steady-state call starts from
        positions = object_positions(self.base)
        source_at = {p: symbol for symbol, p in enumerate(self.sources)}
        # Per pack: its integers (shape, strides, offset) as recorded first, and how a call
        # checks them (None: the same in every call).
        self.pack_ints: list[tuple[int, ...]] = []
        self.pack_specs: list[PackSpec | None] = []
        for own in pack_positions(positions):
            ints = tuple(self._integers[p] for p in own)
            self.pack_ints.append(ints)
            if all(self.sizes[p] is None for p in own):
                self.pack_specs.append(None)
                continue
            fixed = [i for i, p in enumerate(own) if self.sizes[p] is None]
            self.pack_specs.append(
                PackSpec(
                    binds=tuple((i, source_at[p]) for i, p in enumerate(own) if p in source_at),
                    fixed=itemgetter(*fixed) if fixed else None,
                    # What the getter returns: one position's integer, or a tuple of several.
                    fixed_values=ints[fixed[0]]
                    if len(fixed) == 1
                    else tuple(ints[i] for i in fixed),
                    curves=tuple(
                        (i, a)
                        for i, p in enumerate(own)
                        if (a := self.sizes[p]) is not None and p not in source_at
                    ),
                )
            )
        self.rational = tuple({a for a in self.sizes if a is not None and a.d > 1})
        # The ops' size arguments come first among the size integers: what a call's checks
        # gather is compared with them at its symbols (``DataBinding.finish``).
        nodes_end = sum(count for _, count in positions[NODES])
        self.node_ints = self._integers[:nodes_end]
        self.node_varying = tuple(
            (p, a) for p, a in enumerate(self.sizes[:nodes_end]) if a is not None
        )
        self.hold_at = _varying_starts(self.base.hold, positions[HOLD], self.sizes)
        self.exit_at = _varying_starts(self.base.exit_hold, positions[EXIT_HOLD], self.sizes)

    def at(self, x: Sequence[int]) -> SteadyTape:
        """The tape at symbol values ``x``."""
        made = rebuilt(self.base, self._changing, Cursor(self.sizes, x))
        made.template, made.memo = self, self.memo
        return made

    def predicts(self, entry: SteadyTape) -> bool:
        """Whether a recorded call of this structure has the sizes the template gives it at its
        own symbol values."""
        ints = size_integers(entry)
        if len(ints) != len(self._integers):
            return False
        x = [ints[p] for p in self.sources]
        return all(
            (b if s is None else s.at(x)) == n for n, b, s in zip(ints, self._integers, self.sizes)
        )


class PackSpec(NamedTuple):
    """A pack's integers (shape, strides, offset) where some follow the data, as a call checks
    them per pack: those it binds symbols from, those the same in every call (read with one
    ``itemgetter``), and those other symbols' curves give."""

    binds: tuple[tuple[int, int], ...]  # (position, symbol)
    fixed: Any  # an ``itemgetter`` of the positions the same in every call, or None
    fixed_values: Any
    curves: tuple[tuple[int, Affine], ...]


def pack_positions(positions: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Per pack, the positions of its integers: its shape's, then its strides' and offset's."""
    return [
        [*range(start, start + count), *range(vstart, vstart + vcount)]
        for (start, count), (vstart, vcount) in zip(positions[PACKS], positions[VIEWS])
    ]


def _varying_starts(
    keys: Any, objects: list[tuple[int, int]], sizes: Sequence[Affine | None]
) -> dict[int, int]:
    """Per key of a mapping part (holds by pack, by exit), the first position of its object
    where one of its integers varies."""
    return {
        key: start
        for key, (start, count) in zip(keys, objects)
        if any(s is not None for s in sizes[start : start + count])
    }


def fit(points: Sequence[SteadyTape]) -> DataTemplate | None:
    """The template recorded calls of one structure make (see the module), or None."""
    base = points[0]
    columns = list(zip(*(size_integers(e) for e in points)))
    if any(len(size_integers(e)) != len(columns) for e in points):
        return None
    positions = object_positions(base)
    symbols = _Symbols()
    sizes: list[Affine | None] = [None] * len(columns)
    sources: list[int] = []
    bound_at: list[int] = []  # per symbol, the pack that binds it
    packed: set[int] = set()
    for k, own in enumerate(pack_positions(positions)):
        packed.update(own)
        for p in own:
            column = columns[p]
            if len(set(column)) == 1:
                continue
            found = symbols.fitting(column)
            if found:
                sizes[p] = found[0]  # checked in each call: a wrong pick is a divergence
                continue
            sizes[p] = symbols.new(column)
            sources.append(p)
            bound_at.append(k)
    for p, column in enumerate(columns):
        if p in packed or len(set(column)) == 1:
            continue
        found = symbols.fitting(column)
        if len({a.symbol for a in found}) != 1:
            return None  # no symbol's (not seen in any pack), or several's over these calls
        sizes[p] = found[0]

    def bound_before(objects: list[tuple[int, int]], packs: Sequence[int]) -> bool:
        return all(
            bound_at[s.symbol] < n
            for (start, count), n in zip(objects, packs)
            for s in sizes[start : start + count]
            if s is not None
        )

    # Held values are taken as their pack or submodule exit comes: at sizes bound by then.
    if not bound_before(positions[HOLD], [k + 1 for k in base.hold]):
        return None
    if not bound_before(positions[EXIT_HOLD], [base.exit_packs[j] for j in base.exit_hold]):
        return None
    if not bound_before(positions[EMPTY], [0] * len(positions[EMPTY])):
        return None
    return DataTemplate(base, tuple(sizes), tuple(sources))


@dataclass
class _Structure:
    """One op structure's recorded calls (the most recent ``POINTS``) and its template."""

    skeleton: tuple
    points: list[SteadyTape] = field(default_factory=list)
    template: DataTemplate | None = None


@dataclass
class DataFamily:
    """One signature's calls whose sizes follow their data: per op structure seen, its calls
    and template, the most recent last; the trusted template calls run from (``active``)."""

    structures: list[_Structure] = field(default_factory=list)
    active: DataTemplate | None = None
    suspect: DataTemplate | None = None  # the template the last steady-state call diverged from

    def learn(self, entry: SteadyTape) -> None:
        """A recorded call: it trusts (and makes active) the template that predicts it, or joins
        its structure's calls, which fit a template again."""
        shape = skeleton(entry)
        found = next((s for s in self.structures if s.skeleton == shape), None)
        if found is None:
            found = _Structure(shape)
        else:
            self.structures.remove(found)
        self.structures.append(found)
        suspect, self.suspect = self.suspect, None
        if suspect is not None and suspect is not found.template:
            # The call after the divergence (or the diverged call itself, recorded as its
            # backward ran it again) ran another structure: calls of the suspect's start from
            # it again.
            suspect.doubted = 0
            if self.active is None and any(s.template is suspect for s in self.structures):
                self.active = suspect
        for gone in self.structures[:-STRUCTURES]:
            if gone.template is not None and gone.template is self.active:
                self.active = None
        del self.structures[:-STRUCTURES]
        template = found.template
        if template is not None and template.predicts(entry):
            template.trusted = True
            template.doubted = max(template.doubted - 1, 0)
            if not template.doubted:
                self.active = template
            return
        if template is not None:  # it mispredicted a call of its own structure: gone
            found.template = None
            if self.active is template:
                self.active = None
        found.points.append(entry)
        del found.points[:-POINTS]
        if len(found.points) >= 2:
            found.template = fit(found.points)

    def entry(self) -> SteadyTape | None:
        """What a steady-state call starts from, if a template is trusted and active."""
        return self.active.entry if self.active is not None else None

    def others(self, template: DataTemplate) -> list[DataTemplate]:
        """The trusted templates a call of ``template`` may switch to, the most recent first
        (``structure_switch.py``); doubted ones too: a switch checks the call against the
        template as any steady-state call is checked, and a doubt only decides where calls
        start."""
        return [
            s.template
            for s in reversed(self.structures)
            if s.template is not None and s.template is not template and s.template.trusted
        ]

    def ran(self, template: DataTemplate) -> None:
        """A steady-state call ran ``template``'s ops to the end: the next call starts from it."""
        if template.trusted and not template.doubted:
            self.active = template

    def diverged(self, template: DataTemplate) -> None:
        """A call of ``template`` ran another structure or sizes its symbols do not give: the
        next call records (and finds its structure's template, or learns it)."""
        template.doubted = DOUBTED_CALLS
        self.suspect = template
        if self.active is template:
            self.active = None


class DataBinding:
    """One steady-state call's symbols, bound from its packs as they come (see the module)."""

    def __init__(self, template: DataTemplate, block: Block) -> None:
        self.template, self.block = template, block
        self.x = [0] * len(template.sources)
        self.layouts: list[Layout] = []  # of the packs that matched, as the call made them
        self.packed: list[tuple[int, ...]] = []  # their shapes, strides and offsets
        self._leaf_storage: dict[int, int] = {}
        self._made: SteadyTape | None = None

    def check(self, k: int, t: torch.Tensor) -> str | None:
        """Pack ``k`` is ``t``: bind the symbols it carries; what differs from the tape, if
        anything."""
        template = self.template
        if k >= len(template.base.packs):
            return f"saved tensor {k} is {tuple(t.shape)} {t.dtype}, the tape has no pack"
        got = (*t.shape, *t.stride(), t.storage_offset())
        if not self._fits(k, got, t.dtype):
            return (
                f"saved tensor {k} is {tuple(t.shape)} {t.dtype} (strides {t.stride()}, offset "
                f"{t.storage_offset()}): not the sizes, view or dtype its tape's calls give it"
            )
        leaf = template.base.leaf_packs.get(k)
        if leaf is not None and t.untyped_storage().data_ptr() != self._storage_of(leaf):
            name = template.base.tape.values[leaf].name
            return f"saved tensor {k} is not a view of {name!r}, as in its tape"
        self.layouts.append((t.shape, t.dtype))
        self.packed.append(got)
        return None

    def _fits(self, k: int, got: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether pack ``k``'s integers ``got`` (binding the symbols they carry) and ``dtype``
        are the template's."""
        template = self.template
        if dtype is not template.base.packs[k][1]:
            return False
        spec = template.pack_specs[k]
        if spec is None:
            return got == template.pack_ints[k]
        if len(got) != len(template.pack_ints[k]):
            return False
        if spec.fixed is not None and spec.fixed(got) != spec.fixed_values:
            return False
        x = self.x
        for i, symbol in spec.binds:
            x[symbol] = got[i]
        for i, a in spec.curves:
            if a.at(x) != got[i]:
                return False
        return True

    def rebound(self, template: DataTemplate) -> DataBinding | None:
        """This call's packs so far bound into ``template`` instead, if they fit it (a switch
        of template, ``structure_switch.py``, whose agreement makes each pack's parameter the
        same as in this binding's template: checked here already)."""
        other = DataBinding(template, self.block)
        if len(self.packed) > len(template.base.packs):
            return None
        for k, (got, layout) in enumerate(zip(self.packed, self.layouts)):
            if not other._fits(k, got, layout[1]):
                return None
        other.layouts, other.packed = list(self.layouts), list(self.packed)
        return other

    def _storage_of(self, leaf: int) -> int:
        ptr = self._leaf_storage.get(leaf)
        if ptr is None:
            value = self.template.base.tape.values[leaf]  # not the block's: it may switch
            ptr = self._leaf_storage[leaf] = self.block.fetch(value).untyped_storage().data_ptr()
        return ptr

    def holds(self, k: int, holds: Holds) -> Holds:
        """What pack ``k`` holds, at the sizes bound so far."""
        start = self.template.hold_at.get(k)
        if start is None:
            return holds
        mapped: Holds = map_part(HOLD, holds, Cursor(self.template.sizes, self.x), start)
        return mapped

    def exit_held(self, j: int, held: tuple) -> tuple:
        """What submodule exit ``j`` holds, at the sizes bound so far."""
        start = self.template.exit_at.get(j)
        if start is None:
            return held
        mapped: tuple = map_part(EXIT_HOLD, held, Cursor(self.template.sizes, self.x), start)
        return mapped

    # Which of an op's arguments are sizes, gathered by the call's op checks (``op_checks.py``).
    size_arguments = staticmethod(size_arguments)

    def finish(self, sizes: list[Any]) -> str | None:
        """At the end of forward: what the bound sizes do not give, if anything (an index that
        is an offset over a size its offset is no multiple of; ``sizes``, the integers in its
        ops' size arguments, not those of the tape at its bindings)."""
        x = self.x
        if not all(a.exact(x) for a in self.template.rational):
            return (
                "its saved tensors' offsets are no multiples of the sizes its tape divides them by"
            )
        template = self.template
        expected = list(template.node_ints)
        for p, a in template.node_varying:
            expected[p] = a.at(x)
        got: list[int] = []
        flat_ints(sizes, got)
        if got != expected:
            return "its ops' size arguments are not those its saved tensors' sizes give"
        return None

    def tape(self) -> SteadyTape:
        """The tape at this call's sizes (made once its forward ended)."""
        if self._made is None:
            self._made = self.template.at(self.x)
        return self._made
