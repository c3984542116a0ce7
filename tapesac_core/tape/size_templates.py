"""Steady state across sizes: one module's cached tapes as a function of one varying size.

Why. Steady state (``steady.py``) runs a call from the tape an earlier call with the same
signature recorded. Batches whose length changes from step to step (text packed without padding,
or padded to each batch's longest sequence) seldom repeat a signature, so nearly every call
would record. But a decoder layer runs the same ops at every length: only the integers in its
ops' size arguments (view sizes, slice ends), its values' layouts and its storages' bytes change,
each as a polynomial of the length (attention's scores grow with its square).

Contract. ``FIT_POINTS`` recorded calls of one module whose signatures differ only in integers
(their inputs' shapes, strides and offsets, integer arguments; ``split_signature``), with the
same ops, values, packs and holds, differing only in size integers (``skeleton``), make a
template: every size integer as ``c0 + c1 * s + c2 * s * s`` with integer coefficients, ``s``
the first signature integer that differs. Only integer-typed op arguments may vary (sizes, dims,
ends; ``size_arguments``): a number an op computes with must be the same at every size. An
integer on no such curve (half a length) makes no template. A template is trusted once it
predicts a recorded tape exactly at a size it was not fitted at; from then on a call whose
signature lies on its curves runs in steady state from the tape the template gives at its size
(``SizeTemplate.at``), without recording. Four exact points make any relation of degree three
or less in ``s`` exact everywhere.

What a template cannot promise: an integer that follows a curve over the sizes seen but not
beyond them (a length clamped to a window). Where that changes the shape of a saved tensor, the
steady path's check of every pack sees it (the call's backward recomputes its forward, as after
any divergence) and the template is dropped; verification steps record and compare with the
template's tape too (``steady_cache``). A clamp that changes an op's integers without changing
any saved tensor's shape (a slice's start moving while its length stays) is seen only there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import torch

from .._compat import OpOverload, op_schema
from ..tensors import Meta
from .signature import Signature
from .steady import Holds, Layout, SteadyTape
from .tape import Node, Value, comparable


class Curve(NamedTuple):
    """An integer as a function of the varying size ``s``: ``c0 + c1 * s + c2 * s * s``
    (attention's scores grow with the square of the length)."""

    c0: int
    c1: int
    c2: int

    def at(self, s: int) -> int:
        return self.c0 + (self.c1 + self.c2 * s) * s


def split_signature(signature: Signature) -> tuple[Signature, tuple[int, ...]]:
    """``signature`` with the integers of its arguments taken out, and those integers in order:
    calls whose signatures differ only in the second run the same ops at other sizes."""
    found: list[int] = []
    masked = _map_ints(signature.arguments, _collect(found, 0))
    return signature._replace(arguments=masked), tuple(found)


def _collect(found: list[int], replacement: int | None) -> Callable[[int], int]:
    """A map of integers that notes each one, and returns it or ``replacement``."""

    def note(n: int) -> int:
        found.append(n)
        return n if replacement is None else replacement

    return note


def _map_ints(x: Any, f: Callable[[int], int]) -> Any:
    """``x`` with every ``int`` (not ``bool``) in its tuples and lists replaced by ``f(int)``, in
    depth-first order; other objects as they are."""
    kind = type(x)
    if kind is int:
        return f(x)
    if kind is tuple or kind is list:
        return kind(_map_ints(y, f) for y in x)
    if kind is torch.Size:
        return torch.Size([f(n) for n in x])
    if kind is dict:
        return {k: _map_ints(v, f) for k, v in x.items()}
    return x


def _meta(meta: Meta, f: Callable[[int], int]) -> Meta:
    shape = torch.Size([f(n) for n in meta.shape])
    return meta._replace(
        shape=shape, stride=tuple(f(n) for n in meta.stride), offset=f(meta.offset)
    )


def _layout(layout: Layout, f: Callable[[int], int]) -> Layout:
    return (torch.Size([f(n) for n in layout[0]]), layout[1])


def _holds(holds: Holds, f: Callable[[int], int]) -> Holds:
    values = tuple((vid, None if m is None else _meta(m, f)) for vid, m in holds.values)
    return holds._replace(values=values)


def _node(node: Node, f: Callable[[int], int]) -> Node:
    positions, names = size_arguments(node.op)
    if not positions and not names:
        return node
    args = type(node.args)(
        _map_ints(a, f) if i in positions else a for i, a in enumerate(node.args)
    )
    kwargs = {k: _map_ints(v, f) if k in names else v for k, v in node.kwargs.items()}
    return node._replace(args=args, kwargs=kwargs)


@functools.cache
def size_arguments(op: object) -> tuple[frozenset[int], frozenset[str]]:
    """The positions and names of ``op``'s integer arguments (sizes, dims, ends): the only
    integers a template lets vary. A number an op computes with (``mul(x, n)``) must be the
    same at every size: off the sizes seen, a clamped one would change values, not shapes,
    and no check would see it."""
    if not isinstance(op, OpOverload):
        return frozenset(), frozenset()
    arguments = op_schema(op).arguments
    return (
        frozenset(i for i, a in enumerate(arguments) if not a.kwarg_only and _integer_type(a.type)),
        frozenset(a.name for a in arguments if _integer_type(a.type)),
    )


def flat_ints(values: Sequence[Any], out: list[int]) -> None:
    """The integers in ``values`` (size arguments: integers, lists of them, None), in
    ``_map_ints``' order, appended to ``out``."""
    for v in values:
        if type(v) is int:
            out.append(v)
        elif type(v) is list or type(v) is tuple or type(v) is torch.Size:
            flat_ints(v, out)


def _integer_type(t: torch.JitType) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        t = t.getElementType()
    return isinstance(t, (torch.IntType, torch.SymIntType))


def _value(value: Value, f: Callable[[int], int]) -> Value:
    return value if value.meta is None else value._replace(meta=_meta(value.meta, f))


def _exit_held(held: tuple, f: Callable[[int], int]) -> tuple:
    return tuple((i, _layout(layout, f), _holds(h, f)) for i, layout, h in held)


def _empty(item: tuple[int, Meta], f: Callable[[int], int]) -> tuple[int, Meta]:
    return (item[0], _meta(item[1], f))


def _storage_bytes(n: int, f: Callable[[int], int]) -> int:
    return f(n)


def _view(view: tuple[tuple[int, ...], int], f: Callable[[int], int]) -> tuple:
    return (tuple(f(n) for n in view[0]), f(view[1]))


# The parts of a steady-state tape that hold size integers, in the order they are visited: per
# part, how one of its objects is mapped.
_MAPS: tuple[Callable[[Any, Callable[[int], int]], Any], ...] = (
    _node,
    _value,
    _storage_bytes,
    _layout,
    _view,
    _holds,
    _exit_held,
    _empty,
)


def _parts(entry: SteadyTape) -> list[list[Any]]:
    """The objects of each part of ``entry`` that ``_MAPS`` maps, as fresh lists."""
    tape = entry.tape
    return [
        list(tape.nodes),
        list(tape.values),
        list(tape.storage_bytes),
        list(entry.packs),
        list(entry.views),
        list(entry.hold.values()),
        list(entry.exit_hold.values()),
        list(entry.empty),
    ]


def _from_parts(entry: SteadyTape, parts: list[list[Any]]) -> SteadyTape:
    nodes, values, storage_bytes, packs, views, hold, exit_hold, empty = parts
    return replace(
        entry,
        tape=replace(entry.tape, nodes=nodes, values=values, storage_bytes=storage_bytes),
        packs=tuple(packs),
        views=tuple(views),
        hold=dict(zip(entry.hold, hold)),
        exit_hold=dict(zip(entry.exit_hold, exit_hold)),
        empty=tuple(empty),
        random=tuple(nodes[n.index] for n in entry.random),
        confirmed=False,
    )


def map_sizes(entry: SteadyTape, f: Callable[[int], int]) -> SteadyTape:
    """``entry`` with each of its size integers (ops' integer arguments, layouts, storage
    bytes) replaced by ``f(integer)``, always visited in the same order."""
    parts = [[m(x, f) for x in objects] for m, objects in zip(_MAPS, _parts(entry))]
    return _from_parts(entry, parts)


class Sized(Protocol):
    """A size integer as a function of what varies (``Curve``: one size ``s``)."""

    def at(self, s: Any) -> int: ...


class Cursor:
    """Maps size integers from ``position`` on, each by its curve at ``s`` (None: as it is)."""

    __slots__ = ("curves", "position", "s")

    def __init__(self, curves: Sequence[Sized | None], s: Any) -> None:
        self.curves, self.position, self.s = curves, 0, s

    def __call__(self, n: int) -> int:
        curve = self.curves[self.position]
        self.position += 1
        return n if curve is None else curve.at(self.s)


def object_positions(entry: SteadyTape) -> list[list[tuple[int, int]]]:
    """Per part of ``entry`` (``_MAPS``' order), per object: the position of its first size
    integer in ``size_integers`` order, and how many it has."""
    out: list[list[tuple[int, int]]] = []
    position = 0
    for m, objects in zip(_MAPS, _parts(entry)):
        found = []
        for x in objects:
            count: list[int] = []
            m(x, _collect(count, None))
            found.append((position, len(count)))
            position += len(count)
        out.append(found)
    return out


def changing(entry: SteadyTape, sizes: Sequence[Sized | None]) -> tuple[tuple, ...]:
    """Per part of ``entry``, its objects with a size integer that ``sizes`` changes: (index in
    the part, position of its first size integer)."""
    return tuple(
        tuple(
            (i, start)
            for i, (start, count) in enumerate(objects)
            if any(c is not None for c in sizes[start : start + count])
        )
        for objects in object_positions(entry)
    )


def rebuilt(base: SteadyTape, changed: tuple[tuple, ...], cursor: Cursor) -> SteadyTape:
    """``base`` with the objects ``changed`` names (``changing``) mapped by ``cursor``."""
    parts = _parts(base)
    for m, objects, part in zip(_MAPS, parts, changed):
        for i, position in part:
            cursor.position = position
            objects[i] = m(objects[i], cursor)
    return _from_parts(base, parts)


def map_part(part: int, x: Any, cursor: Cursor, position: int) -> Any:
    """Object ``x`` of part ``part`` (``_MAPS``' order) mapped by ``cursor`` from ``position``."""
    cursor.position = position
    return _MAPS[part](x, cursor)


# Parts of a steady-state tape by position in ``_MAPS`` (``object_positions``' lists).
NODES, PACKS, VIEWS, HOLD, EXIT_HOLD, EMPTY = 0, 3, 4, 5, 6, 7


def size_integers(entry: SteadyTape) -> list[int]:
    """Every size integer of ``entry``, in ``map_sizes`` order."""
    found: list[int] = []
    map_sizes(entry, _collect(found, None))
    return found


def zeroed_sizes(entry: SteadyTape) -> SteadyTape:
    """``entry`` with every size integer 0: what calls of one op structure share."""
    return map_sizes(entry, lambda n: 0)


def skeleton(entry: SteadyTape) -> tuple:
    """Everything of ``entry`` but its size integers, comparable with ``==``."""
    zeroed = zeroed_sizes(entry)
    tape = zeroed.tape
    nodes = tuple(
        (n.op, n.k, tuple(n.inputs), tuple(n.deps), tuple(n.outs), n.writes, n.extra)
        + (n.rng is not None, n.rebuild, n.module, comparable(n.args), comparable(n.kwargs))
        for n in tape.nodes
    )
    graph = (
        tape.name,
        tape.region,
        # Versions count every in-place write a tensor ever had (an optimizer's step into a
        # parameter): recording reads them, replay does not, and epochs order a call's writes.
        tuple(v._replace(version=0) for v in tape.values),
        tape.demand,
        tuple(sorted(tape.mandatory.items())),
        tape.planned,
        tape.outputs,
        tape.returned,
        tape.host_sync,
        tape.host_floats,
        # Not ``tape.freed``: when the forward dropped its storages says nothing of what replay
        # computes, and a diverged call's recomputation, recorded (``running._learned_again``),
        # keeps its packs alive to the end.
    )
    calls = (
        zeroed.handles,
        zeroed.packs,
        zeroed.views,
        tuple(sorted(zeroed.leaf_packs.items())),
        zeroed.exit_packs,
        tuple(sorted(zeroed.hold.items())),
        tuple(sorted(zeroed.exit_hold.items())),
        zeroed.exits,
        zeroed.empty,
        zeroed.inputs,
        zeroed.outputs,
        zeroed.kept,
        zeroed.saved,
        tuple(sorted(zeroed.pack_count.items())),
        zeroed.writes_in_place,
        zeroed.device_types,
        zeroed.autograd,
        tuple(
            (c.op, c.node, comparable(c.args), comparable(c.kwargs), c.sources)
            for c in zeroed.checks
        ),
        zeroed.op_kinds,
    )
    return nodes, graph, calls, len(tape.storage_bytes)


def _curve(points: Sequence[tuple[int, int]]) -> Curve | None:
    """The integer curve of degree at most two through three ``(s, value)`` points, if any."""
    (s0, y0), (s1, y1), (s2, y2) = points
    d01, d12 = Fraction(y1 - y0, s1 - s0), Fraction(y2 - y1, s2 - s1)
    c2 = (d12 - d01) / (s2 - s0)
    c1 = d01 - c2 * (s0 + s1)
    c0 = y0 - d01 * s0 + c2 * s0 * s1
    if any(c.denominator != 1 for c in (c0, c1, c2)):
        return None
    return Curve(int(c0), int(c1), int(c2))


FIT_POINTS = 3  # recorded calls at distinct sizes a template is made from


@dataclass(eq=False)
class SizeTemplate:
    """A module's tape as a function of one varying signature integer ``s`` (see the module)."""

    base: SteadyTape
    position: int  # which signature integer is ``s``
    signature: tuple[Curve, ...]  # per signature integer
    sizes: tuple[Curve | None, ...]  # per size integer of ``base`` (None: the same at every s)
    fitted: frozenset[int]  # the sizes it was fitted at
    trusted: bool = False  # it predicted a recorded tape exactly at a size not fitted

    def __post_init__(self) -> None:
        # Made once: a tape at a new size rebuilds only the objects whose sizes change, and a
        # recorded tape is checked against the base's skeleton and integers.
        self._changing = changing(self.base, self.sizes)
        self._skeleton = skeleton(self.base)
        self._integers = size_integers(self.base)

    def size_of(self, ints: Sequence[int]) -> int | None:
        """The ``s`` of a signature's integers, None if they do not lie on the template's curves."""
        if len(ints) != len(self.signature):
            return None
        s = ints[self.position]
        return s if all(n == c.at(s) for n, c in zip(ints, self.signature)) else None

    def at(self, s: int) -> SteadyTape:
        """The tape the template gives at size ``s``."""
        made = rebuilt(self.base, self._changing, Cursor(self.sizes, s))
        return replace(made, template=self)

    def predicts(self, s: int, entry: SteadyTape) -> bool:
        """Whether the template's tape at ``s`` is ``entry``, integer for integer."""
        expected = [n if c is None else c.at(s) for n, c in zip(self._integers, self.sizes)]
        return size_integers(entry) == expected and skeleton(entry) == self._skeleton


def fit(points: Sequence[tuple[Sequence[int], SteadyTape]]) -> SizeTemplate | None:
    """The template ``FIT_POINTS`` recorded calls (signature integers, tape) at distinct sizes
    make, or None if they make none."""
    (ints, base), *others = points
    shape = skeleton(base)
    if any(len(i) != len(ints) or skeleton(e) != shape for i, e in others):
        return None
    position = next((k for k in range(len(ints)) if any(i[k] != ints[k] for i, _ in others)), None)
    if position is None:
        return None
    s = [i[position] for i, _ in points]
    if len(set(s)) != len(points):
        return None
    signature = [_curve(list(zip(s, column))) for column in zip(*(i for i, _ in points))]
    sized = [size_integers(e) for _, e in points]
    sizes = [
        None if len(set(column)) == 1 else _curve(list(zip(s, column))) for column in zip(*sized)
    ]
    if any(len(other) != len(sized[0]) for other in sized) or any(
        curve is None and len(set(column)) > 1 for curve, column in zip(sizes, zip(*sized))
    ):
        return None
    exact = [c for c in signature if c is not None]
    if len(exact) != len(signature):
        return None
    return SizeTemplate(base, position, tuple(exact), tuple(sizes), frozenset(s))
