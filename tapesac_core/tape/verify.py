"""Writes the dispatcher cannot see: found by comparing replayed values with what autograd saved.

A kernel (Triton, a CUDA extension) that writes into an existing tensor out of the dispatcher's
sight leaves no trace on the tape, so replay recreates the value from before the write: silently
wrong gradients. In a verifying step (the controller's first step if it warms up, as it is
neither timed nor metered, else its first profile step; or ``trace(verify=True)``) the pack hook
takes a fingerprint of each value autograd saves and the block does not keep, and replay
compares each value it produces anyway with it. A mismatch is logged as a warning naming the op
and the submodule, and the op's output joins the mandatory set of its region type from the next
block on (the verifying step itself has already used the replayed content), in the ``HiddenWrites``
table of the block's model. Values computed from
ops that are not bitwise reproducible (atomics on CUDA without deterministic algorithms) are not
compared.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from .._compat import disable_current_modes, op_packet
from ..plan.coords import Coord
from .tape import Node

logger = logging.getLogger(__name__)

# Accumulating with atomics on CUDA: the order of additions, hence the bits, varies between runs
# unless torch.use_deterministic_algorithms(True).
_ATOMIC_ON_CUDA = frozenset(
    {
        "index_add",
        "index_add_",
        "scatter_add",
        "scatter_add_",
        "index_put",
        "index_put_",
        "_index_put_impl_",
        "scatter_reduce",
        "scatter_reduce_",
        "index_reduce",
        "index_reduce_",
    }
)

if TYPE_CHECKING:
    from .block import Block
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20  # elements fingerprinted at once: 24 MiB of int64 temporaries at most


class HiddenWrites:
    """What verifying steps found for one model: per region type, the coordinates ``(op, k, j)``
    whose outputs a hidden write changed, saved (mandatory) from then on. Kept with the model's
    blocks (one table per ``checkpoint_modules`` call), so two models in one process keep their
    own, and in the controller's state, so a resumed run saves them without verifying again."""

    def __init__(self) -> None:
        self._coords: dict[str, set[Coord]] = {}

    def of(self, region: str) -> frozenset[Coord]:
        return frozenset(self._coords.get(region, ()))

    def add(self, region: str, coord: Coord) -> None:
        self._coords.setdefault(region, set()).add(coord)

    def state_dict(self) -> dict[str, list[list[Any]]]:
        return {r: sorted(list(c) for c in coords) for r, coords in self._coords.items() if coords}

    @staticmethod
    def merged_state(tables: list[HiddenWrites]) -> dict[str, list[list[Any]]]:
        """One state of several tables (a model wrapped by several ``checkpoint_modules``)."""
        merged = HiddenWrites()
        for table in tables:
            for region, coords in table._coords.items():
                for coord in coords:
                    merged.add(region, coord)
        return merged.state_dict()

    def load_state_dict(self, state: dict[str, list[list[Any]]]) -> None:
        for region, coords in state.items():
            for op, k, j in coords:
                self.add(region, Coord(op, k, j))


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bits, plain and position-weighted: equal content, equal
    fingerprint; a changed element changes it. Runs unseen by dispatch modes (the recorder),
    in chunks, so its temporaries stay small next to the saved tensors."""
    with disable_current_modes(), torch.no_grad():
        flat = t.detach().contiguous().view(-1)
        if flat.element_size() in _INTS and flat.dtype != torch.bool:
            flat = flat.view(_INTS[flat.element_size()])
        else:
            flat = flat.view(torch.uint8)
        total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            bits = flat[start : start + _CHUNK].to(torch.int64)
            weights = torch.arange(
                start + 1, start + 1 + bits.numel(), dtype=torch.int64, device=bits.device
            )
            total += torch.stack([bits.sum(), (bits * weights).sum()])
        return total


def reproducible(node: Node, device_type: str) -> bool:
    """Whether replaying ``node`` gives the bits it gave in forward."""
    if device_type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return True
    packet = op_packet(node.op) or ""
    return packet not in _ATOMIC_ON_CUDA


def check_replayed(block: Block, node: Node, vid: int, t: torch.Tensor) -> bool:
    """Compare a replayed value with its fingerprint at pack time; on a mismatch warn and make
    the producing coordinate mandatory for the block's region. True if it matched."""
    expected = block.fingerprints.get(vid)
    if expected is None or torch.equal(fingerprint(t), expected):
        return True
    coord = block.trace.tape.coord(vid)
    assert coord is not None, "replay makes op outputs only: each has a coordinate"
    block.hidden_writes.add(block.region, coord)
    block.trace.invisible_writes.append(coord)
    logger.warning(
        "block %r (region %r): replaying %s (call %d, output %d) in module %r did not reproduce "
        "the content autograd saved: a kernel wrote into its storage out of the dispatcher's "
        "sight. Its output is saved from now on (mandatory set)",
        block.name,
        block.region,
        node.name,
        node.k,
        block.values[vid].j,
        node.module or "<block>",
    )
    return False
