"""A steady-state call that leaves its template's op structure for another template's.

Why. A MoE block's ops follow its routing: its loop over the experts hit runs once per expert
hit, so a batch that leaves an expert idle runs fewer iterations than one that hits them all.
Each op structure gets its own template (``data_sizes.DataFamily``), but a call starts from one
of them, the family's active template, before its routing is known. Without a switch, a call of
another structure diverges (its backward runs the forward again) and the calls after it record:
a quarter of an HF Qwen3-MoE layer's calls under a plan, where routing leaves an expert idle
now and then.

Contract. Two templates A and B of one family agree on a prefix of their calls (``Agreement``):
their first ``checks`` op checks are the same but for size arguments (same op, same tape node
but for its size integers, same sources, same other arguments), their first ``packs`` packs are
the same values with the same dtypes and views but for sizes, on the same parameters, holding
the same values, and their first ``exits`` submodule exits hold the same values. A call checked
against A that departs from it at op ``c``, having made ``p`` packs and seen ``e`` exits, goes
on against a trusted template B of its family if A and B agree that far, if the call's packs so
far fit B's sizes (``DataBinding.rebound``), and if what B holds from those packs and exits is
what A held, at the call's sizes. Everything B's check would have compared before op ``c``, A's
compared the same way, but the size arguments, which are gathered as they come and compared
with B's at the end of forward (``DataBinding.finish``): the call is then checked as if it had
started from B. A template the call departed from is not tried again in that call, so a call
switches at most once per template of its family; a call that finds no template diverges.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import Tensor

from .data_sizes import DataBinding, DataFamily, DataTemplate
from .op_checks import Check
from .size_templates import node_skeleton, zeroed_sizes
from .steady import SteadyTape
from .tape import comparable


class Agreement(NamedTuple):
    """How far two templates' calls are the same but for sizes: op checks, packs, exits."""

    checks: int
    packs: int
    exits: int


def agreement(a: DataTemplate, b: DataTemplate) -> Agreement:
    """How far calls of ``a`` and of ``b`` are the same but for sizes (see the module)."""
    found = a.agreements.get(b)
    if found is None:
        found = a.agreements[b] = _agreement(a, b)
    return found


def _agreement(a: DataTemplate, b: DataTemplate) -> Agreement:
    ea, eb = a.base, b.base
    za, zb = _zeroed(a), _zeroed(b)
    # What a call sets up before its first op, and whether its submodules are hooked.
    if (
        ea.op_kinds != eb.op_kinds
        or ea.inputs != eb.inputs
        or za.empty != zb.empty
        or (eb.exit_hold and not ea.exit_hold)
    ):
        return Agreement(0, 0, 0)
    na, nb = za.tape.nodes, zb.tape.nodes

    def same_check(ca: Check, cb: Check) -> bool:
        return (
            ca.op is cb.op
            and ca.node == cb.node
            and ca.sources == cb.sources
            and comparable(ca.args) == comparable(cb.args)
            and comparable(ca.kwargs) == comparable(cb.kwargs)
            and (ca.node < 0 or node_skeleton(na[ca.node]) == node_skeleton(nb[cb.node]))
        )

    def same_pack(k: int) -> bool:
        return (
            ea.handles[k] == eb.handles[k]
            and za.packs[k] == zb.packs[k]
            and za.views[k] == zb.views[k]
            and ea.leaf_packs.get(k) == eb.leaf_packs.get(k)
            and za.hold.get(k) == zb.hold.get(k)
        )

    def same_exit(j: int) -> bool:
        return ea.exit_packs[j] == eb.exit_packs[j] and za.exit_hold.get(j) == zb.exit_hold.get(j)

    return Agreement(
        _leading(same_check(x, y) for x, y in zip(ea.checks, eb.checks)),
        _leading(map(same_pack, range(min(len(ea.packs), len(eb.packs))))),
        _leading(map(same_exit, range(min(len(ea.exit_packs), len(eb.exit_packs))))),
    )


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
    ) -> DataBinding | None:
        """The binding of a template the call, bound so far by ``binding``, goes on against
        from op ``c``, having seen ``exits`` exits, and ``pack`` if it departed at a pack (its
        sizes not the template's); None: none fits."""
        current = binding.template
        self.tried.add(id(current))
        packs = len(binding.packed)
        for other in self.family.others(current):
            if id(other) in self.tried:
                continue
            agreed = agreement(current, other)
            if (
                agreed.checks < c
                or agreed.packs < packs + (pack is not None)
                or agreed.exits < exits
            ):
                continue
            rebound = binding.rebound(other)
            if rebound is None or not _holds_alike(binding, rebound, packs, exits):
                continue
            if pack is None or rebound.check(packs, pack) is None:
                return rebound
        return None


def _holds_alike(a: DataBinding, b: DataBinding, packs: int, exits: int) -> bool:
    """Whether what the call held from its first ``packs`` packs and ``exits`` exits under
    ``a``'s template is what ``b``'s holds from them, at the call's sizes (the agreement made
    both hold from the same packs and exits)."""
    ea, eb = a.template.base, b.template.base
    return all(
        a.holds(k, held) == b.holds(k, eb.hold[k]) for k, held in ea.hold.items() if k < packs
    ) and all(
        a.exit_held(j, held) == b.exit_held(j, eb.exit_hold[j])
        for j, held in ea.exit_hold.items()
        if j < exits
    )
