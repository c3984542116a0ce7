"""Host buffers for offloaded values, reused across steps.

A step's offloaded storages come back in its backward, and the next step offloads storages of
about the same sizes: allocating host memory for each (pinned, where an accelerator copies from
it) would cost a system call per storage per step. The pool keeps every buffer it gave out and
gives it again for a request of its size class, else of the smallest larger class it has free
(a step whose sizes follow the data, tokens routed to an expert, reuses the buffers of a step
with other sizes instead of adding its own). Sizes are rounded up to a power of two. On an accelerator a buffer given back with the event of the copy that last read or wrote
it is not handed out again before that event completes.
"""

from __future__ import annotations

import torch

from .._compat import dispatch_disabled
from ..measure.memory import not_counted

Tensor = torch.Tensor


class HostPool:
    """Reusable host byte buffers for values copied off ``device`` (pinned where ``device`` is
    an accelerator). ``allocations`` counts buffers made; ``bytes`` is what they hold."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type != "cpu"
        self.allocations = 0
        self.bytes = 0
        self._free: dict[int, list[tuple[Tensor, torch.Event | None]]] = {}

    def take(self, nbytes: int) -> Tensor:
        """A host buffer of at least ``nbytes`` bytes (uint8), free of pending copies."""
        size = _size_class(nbytes)
        fits = [c for c, free in self._free.items() if c >= size and free]
        if fits:
            buffer, event = self._free[min(fits)].pop()
            if event is not None:
                event.synchronize()
            return buffer
        self.allocations += 1
        self.bytes += size
        if self.pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        # On CPU the pool stands for host memory beside the device's (only tests offload there):
        # a step's meter counts the device's alone, as on an accelerator, so no meter may see
        # the buffer made.
        with dispatch_disabled():
            buffer = torch.empty(size, dtype=torch.uint8)
        not_counted(buffer)
        return buffer

    def give(self, buffer: Tensor, event: torch.Event | None = None) -> None:
        """Take ``buffer`` back; ``event``: the copy that last used it (None: none pending)."""
        self._free.setdefault(buffer.numel(), []).append((buffer, event))

    @property
    def outstanding(self) -> int:
        """Bytes of the pool's buffers given out and not yet given back."""
        return self.bytes - sum(b.numel() for free in self._free.values() for b, _ in free)


def _size_class(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()
