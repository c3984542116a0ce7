"""How plans name a block's values: coordinates (Eq. 2), coordinates anchored on submodules, and
values that no recorded node produced. Plain data, no torch: the tape, the planner and the plan
file share these types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union


class Coord(NamedTuple):
    """A plan coordinate: output ``j`` of the ``k``-th call of op ``op`` in a block (Eq. 2).

    A tuple, so ``("aten.mm.default", 0, 0)`` written by hand names the same value."""

    op: str
    k: int
    j: int


class Anchor(NamedTuple):
    """A coordinate anchored on the submodule that issued the op: output ``j`` of the ``call``-th
    call of ``op`` by ``module`` (its path, "" for the block's own ops). Loops elsewhere in the
    block (experts that ran or not) leave it unchanged."""

    module: str
    op: str
    call: int
    j: int


@dataclass(frozen=True, order=True)
class Unproduced:
    """A value no recorded node produced, which no coordinate names: a block input (``name``: its
    position), a parameter or buffer (its name) or an external tensor. ``vid`` keeps two such
    values apart. Ordered, as the planner's value names are (``model.ValueNameLike``), though
    save sets never hold one."""

    kind: str
    name: str | int | None
    vid: int


# What the planner calls a value of a recorded block. Save sets hold only coordinates: values
# without a producer are always available.
ValueName = Union[Coord, Unproduced]
