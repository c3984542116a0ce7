"""The plan blocks run under: ``use_plan`` opens it, and each block recorded inside takes its
entry (the coordinates it saves, or how it runs unrecorded) by region and forward order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..errors import TapeSACError
from ..plan.coords import Anchor, Coord
from ..plan.plan import BlockKind, Plan
from ..tape.block import BlockPlan

PlanSpec = Mapping[str, Any]

PLAN: ContextVar[PlanScope | None] = ContextVar("tapesac_plan", default=None)


def _is_coord(c: Any) -> bool:
    return (
        isinstance(c, (tuple, list))
        and len(c) == 3
        and isinstance(c[0], str)
        and isinstance(c[1], int)
        and isinstance(c[2], int)
    )


def _coords(collection: Any, region: str) -> frozenset[Coord]:
    coords = list(collection)
    bad = [c for c in coords if not _is_coord(c)]
    if bad:
        raise TapeSACError(
            f"plan for region {region!r}: {bad[0]!r} is not a coordinate "
            "(op_name, k, j), e.g. ('aten.mm.default', 0, 0)"
        )
    return frozenset(Coord(c[0], c[1], c[2]) for c in coords)


def normalize_plan(
    plan: PlanSpec,
) -> dict[str, frozenset[Coord] | list[frozenset[Coord] | BlockKind]]:
    """Coordinates per region, or one entry per block of the region in forward order: its
    coordinate set, ``PLAIN`` or ``TORCH_CHECKPOINT``."""
    if not isinstance(plan, Mapping):
        raise TapeSACError(f"a plan maps region names to coordinates, got {type(plan).__name__}")
    out: dict[str, Any] = {}
    for region, entry in plan.items():
        items = list(entry)
        if items and all(
            isinstance(i, BlockKind)
            or (not _is_coord(i) and isinstance(i, (set, frozenset, list, tuple)))
            for i in items
        ):
            out[region] = [_entry(i, region) for i in items]
        else:
            out[region] = _coords(items, region)
    return out


def _entry(item: Any, region: str) -> frozenset[Coord] | BlockKind:
    """One block's entry of a per-block plan list."""
    if item is BlockKind.TAPE:
        raise TapeSACError(
            f"plan for region {region!r}: a recorded block's entry is its coordinate set "
            "(an empty set for must-only), not BlockKind.TAPE"
        )
    return item if isinstance(item, BlockKind) else _coords(item, region)


class PlanScope:
    def __init__(self, plan: Plan | PlanSpec) -> None:
        # A solved Plan also names the op sequence its coordinates are valid for, the bytes
        # each block's set may keep and the sets anchored on submodules; coordinates alone
        # are valid for any op sequence, with no bound.
        self.sequences: dict[str, str] = {}
        self.budgets: dict[str, list[int]] = {}
        self.anchors: dict[str, tuple[list[frozenset[Anchor]], Mapping[str, str]]] = {}
        self.offloading: dict[str, list[bool]] = {}
        if isinstance(plan, Plan):
            self.sequences = plan.sequences()
            self.budgets = plan.budgets()
            self.anchors = plan.anchors()
            self.offloading = plan.offloading()
            kinds = plan.block_kinds()
            plan = {
                r: [
                    k if k is not BlockKind.TAPE else s
                    for s, k in zip(sets, kinds.get(r, [BlockKind.TAPE] * len(sets)))
                ]
                for r, sets in plan.coordinates().items()
            }
        self.plan = normalize_plan(plan)
        self.blocks: Counter[str] = Counter()

    def block_plan(self, region: str) -> BlockPlan:
        entry = self.plan.get(region, frozenset())
        if not isinstance(entry, list):
            return BlockPlan(entry, self.sequences.get(region))
        i = self.blocks[region]
        self.blocks[region] += 1  # an unrecorded block counts too: later ones keep their entries
        if not entry:
            return BlockPlan()
        item = entry[i % len(entry)]
        if isinstance(item, BlockKind):
            return BlockPlan(kind=item)
        budgets = self.budgets.get(region)
        anchors, modules = self.anchors.get(region, ([], {}))
        offloading = self.offloading.get(region)
        return BlockPlan(
            item,
            self.sequences.get(region),
            budgets[i % len(budgets)] if budgets else None,
            anchors[i % len(anchors)] if anchors else frozenset(),
            modules,
            offload=offloading[i % len(offloading)] if offloading else False,
        )


@contextmanager
def use_plan(plan: Plan | PlanSpec) -> Iterator[None]:
    """Blocks recorded inside save the plan's coordinates (plus S0); outside, blocks are must-only.

    ``plan`` maps a region name to coordinates ``(op_name, k, j)``, or to a list with one
    coordinate collection per block of that region in forward order (block ``i`` uses entry
    ``i mod len(list)``, so one plan serves every micro-batch inside the context), ``PLAIN``
    for a block that runs as without checkpointing (not recorded: autograd keeps everything it
    saves, and nothing is replayed), or ``TORCH_CHECKPOINT`` for one that runs under
    ``torch.utils.checkpoint(use_reentrant=False)`` (not recorded either). It may also
    be a solved ``Plan``: then a block whose op sequence differs from the one the plan was
    solved on (its coordinates would name other tensors) saves the planned values of submodules
    whose own ops match the reference block's (anchored coordinates), and a block whose planned
    values take more bytes than the plan gave it (sizes that depend on data) keeps, in forward
    order, only those that fit; a solved plan's offloading blocks copy what they hold to host
    memory where the step's trace has an ``Offload`` (a controller's steps do).
    """
    token = PLAN.set(PlanScope(plan))
    try:
        yield
    finally:
        PLAN.reset(token)
