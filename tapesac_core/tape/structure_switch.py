"""A steady-state call that leaves its template's op structure for another template's.

Why. A MoE block's ops follow its routing: its loop over the experts hit runs once per expert
hit, so a batch that leaves an expert idle runs fewer iterations than one that hits them all.
Each op structure gets its own template (``data_sizes.DataFamily``), but a call starts from one
of them, the family's active template, before its routing is known. Without a switch, a call of
another structure diverges (its backward runs the forward again) and the calls after it record.

Contract. Two templates A and B of one family agree on a prefix of their calls (``Agreement``):
their first ``checks`` op checks are the same but for size arguments (same op, same tape node
but for its size integers, same sources, same other arguments), their first ``packs`` packs are
the same values with the same dtypes and views but for sizes, on the same parameters, holding
the same values, and their first ``exits`` submodule exits hold the same values. Values are
named by how they were made, not by id (``_value_keys``), and an op that returns a list may
return lists of other lengths: the ``unbind`` of the experts hit has an output per expert. A call checked
against A that departs from it at op ``c``, having made ``p`` packs and seen ``e`` exits, goes
on against a trusted template B of its family if A and B agree that far, if the call's packs so
far fit B's sizes (``DataBinding.rebound``), and if what B holds from those packs and exits is
what A held, at the call's sizes. Everything B's check would have compared before op ``c``, A's
compared the same way, but the size arguments, which are gathered as they come and compared
with B's at the end of forward (``DataBinding.finish``): the call is then checked as if it had
started from B, its held values renamed to B's ids. A template the call departed from is not
tried again in that call, so a call switches at most once per template of its family; a call
that finds no template diverges, and its backward's recomputation, recorded, teaches the family
its structure (``running._learned_again``, if it ran as the forward did: ``ran_alike``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._compat import OpOverload, op_schema
from .data_sizes import DataBinding, DataFamily, DataTemplate
from .op_checks import Check
from .size_templates import zeroed_sizes
from .steady import Holds, SteadyTape
from .tape import EXTERNAL, Node, Tape, comparable


class Agreement(NamedTuple):
    """How far two templates' calls are the same but for sizes and value ids: op checks, packs,
    exits; and the second's id of each value of the first that both made alike (``vids``)."""

    checks: int
    packs: int
    exits: int
    vids: Mapping[int, int]


def agreement(a: DataTemplate, b: DataTemplate) -> Agreement:
    """How far calls of ``a`` and of ``b`` are the same (see the module)."""
    found = a.agreements.get(b)
    if found is None:
        found = a.agreements[b] = _agreement(a.base, _zeroed(a), b.base, _zeroed(b))
    return found


def _value_keys(tape: Tape) -> list[tuple]:
    """Per value id, a name two tapes give a value they made alike: its producer node and
    output position, or its leaf's kind and name (an external tensor's, its order). Ids are
    not such names: an op whose outputs follow the data (``unbind`` of the experts hit) makes
    as many values as it has outputs, and every id after it moves."""
    externals = 0
    keys: list[tuple] = []
    for v in tape.values:
        if v.node >= 0:
            keys.append((v.node, v.j))
        elif v.kind == EXTERNAL:
            keys.append((EXTERNAL, externals))
            externals += 1
        else:
            keys.append((v.kind, v.name))
    return keys


def ran_alike(template: DataTemplate, entry: SteadyTape, checks: int) -> bool:
    """Whether recorded call ``entry`` ran ``template``'s first ``checks`` op checks but for
    sizes and value ids: a diverged call's recomputation, recorded (``running._learned_again``),
    that ran as its forward did up to where the forward departed. A forward that reads state
    its own call changed (a key-value cache it appended to) runs other ops when run again."""
    found = _agreement(template.base, _zeroed(template), entry, zeroed_sizes(entry))
    return found.checks >= checks


def _agreement(ea: SteadyTape, za: SteadyTape, eb: SteadyTape, zb: SteadyTape) -> Agreement:
    """How far calls of tapes ``ea`` and ``eb`` (``za``, ``zb``: with their sizes zeroed) are
    the same."""
    ka, kb = _value_keys(ea.tape), _value_keys(eb.tape)
    by_key = {key: vid for vid, key in enumerate(kb)}
    vids = {va: by_key[key] for va, key in enumerate(ka) if key in by_key}

    def named(keys: list[tuple], vid: int | None) -> tuple | None:
        return None if vid is None else keys[vid]

    def holds(keys: list[tuple], h: Holds | None) -> tuple | None:
        return None if h is None else (h.copy, tuple((keys[v], m) for v, m in h.values))

    # What a call sets up before its first op, and whether its submodules are hooked.
    if (
        ea.op_kinds != eb.op_kinds
        or [named(ka, v) for v in ea.inputs] != [named(kb, v) for v in eb.inputs]
        or [(ka[v], m) for v, m in za.empty] != [(kb[v], m) for v, m in zb.empty]
        or (eb.exit_hold and not ea.exit_hold)
    ):
        return Agreement(0, 0, 0, {})
    na, nb = za.tape.nodes, zb.tape.nodes

    def same_check(ca: Check, cb: Check) -> bool:
        return (
            ca.op is cb.op
            and ca.node == cb.node
            and ca.sources == cb.sources
            and comparable(ca.args) == comparable(cb.args)
            and comparable(ca.kwargs) == comparable(cb.kwargs)
            and (ca.node < 0 or _same_node(na[ca.node], nb[cb.node], ka, kb))
        )

    def same_pack(k: int) -> bool:
        return (
            ka[ea.handles[k]] == kb[eb.handles[k]]
            and za.packs[k] == zb.packs[k]
            and za.views[k] == zb.views[k]
            and named(ka, ea.leaf_packs.get(k)) == named(kb, eb.leaf_packs.get(k))
            and holds(ka, za.hold.get(k)) == holds(kb, zb.hold.get(k))
        )

    def exit_holds(keys: list[tuple], held: tuple | None) -> tuple | None:
        return None if held is None else tuple((i, lay, holds(keys, h)) for i, lay, h in held)

    def same_exit(j: int) -> bool:
        return ea.exit_packs[j] == eb.exit_packs[j] and exit_holds(
            ka, za.exit_hold.get(j)
        ) == exit_holds(kb, zb.exit_hold.get(j))

    return Agreement(
        _leading(same_check(x, y) for x, y in zip(ea.checks, eb.checks)),
        _leading(map(same_pack, range(min(len(ea.packs), len(eb.packs))))),
        _leading(map(same_exit, range(min(len(ea.exit_packs), len(eb.exit_packs))))),
        vids,
    )


def _same_node(x: Node, y: Node, kx: list[tuple], ky: list[tuple]) -> bool:
    """Whether two nodes of tapes with their sizes zeroed are the same op on the same values
    (by ``_value_keys``); an op that returns a list may return lists of other lengths (its
    length is a size: ``unbind`` of the experts hit), the other outputs being the same."""

    def ids(keys: list[tuple], vids: Sequence[int]) -> tuple:
        return tuple(keys[v] for v in vids)

    if len(x.outs) != len(y.outs) and not _returns_list(x.op):
        return False
    return (
        (x.op, x.k, x.writes, x.extra, x.rng is not None, x.rebuild, x.module)
        == (y.op, y.k, y.writes, y.extra, y.rng is not None, y.rebuild, y.module)
        and ids(kx, x.inputs) == ids(ky, y.inputs)
        and ids(kx, x.deps) == ids(ky, y.deps)
        and comparable(x.args) == comparable(y.args)
        and comparable(x.kwargs) == comparable(y.kwargs)
    )


def _returns_list(op: Any) -> bool:
    """Whether ``op`` returns one list of tensors, whose length may follow the data."""
    if not isinstance(op, OpOverload):
        return False
    returns = op_schema(op).returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def _zeroed(template: DataTemplate) -> SteadyTape:
    if template.zeroed is None:
        template.zeroed = zeroed_sizes(template.base)
    return template.zeroed


def _leading(same: Iterable[bool]) -> int:
    """How many of ``same`` are True before the first False."""
    n = 0
    for s in same:
        if not s:
            break
        n += 1
    return n


class Switch:
    """One steady-state call's way from the template it runs against to another of its
    family's, at an op where it departs (see the module)."""

    def __init__(self, family: DataFamily) -> None:
        self.family = family
        self.tried: set[int] = set()  # ids of templates the call departed from

    def target(
        self, binding: DataBinding, c: int, exits: int, pack: Tensor | None = None
    ) -> tuple[DataBinding, Mapping[int, int]] | None:
        """The binding of a template the call, bound so far by ``binding``, goes on against
        from op ``c``, having seen ``exits`` exits, and ``pack`` if it departed at a pack (its
        sizes not the template's), with that template's id of each value of the call's so far;
        None: none fits."""
        current = binding.template
        self.tried.add(id(current))
        packs = len(binding.packed)
        for other in self.family.others(current):
            if id(other) in self.tried:
                continue
            agreed = agreement(current, other)
            # The op or pack the call departed at is the other template's own: checked next.
            if agreed.checks < c or agreed.packs < packs or agreed.exits < exits:
                continue
            rebound = binding.rebound(other)
            if rebound is None or not _holds_alike(binding, rebound, packs, exits, agreed.vids):
                continue
            if pack is None or rebound.check(packs, pack) is None:
                return rebound, agreed.vids
        return None


def _holds_alike(
    a: DataBinding, b: DataBinding, packs: int, exits: int, vids: Mapping[int, int]
) -> bool:
    """Whether what the call held from its first ``packs`` packs and ``exits`` exits under
    ``a``'s template is what ``b``'s holds from them, at the call's sizes (the agreement made
    both hold from the same packs and exits; ``vids``, its ids of ``a``'s values in ``b``)."""
    ea, eb = a.template.base, b.template.base

    def renamed(h: Holds) -> Holds:
        return h._replace(values=tuple((vids.get(v, -1), m) for v, m in h.values))

    return all(
        renamed(a.holds(k, held)) == b.holds(k, eb.hold[k])
        for k, held in ea.hold.items()
        if k < packs
    ) and all(
        tuple((i, lay, renamed(h)) for i, lay, h in a.exit_held(j, held))
        == b.exit_held(j, eb.exit_hold[j])
        for j, held in ea.exit_hold.items()
        if j < exits
    )
