"""When the storages a block's forward makes are freed, as that forward runs.

Python frees an op's output when its last reference goes (a local of the forward, a tuple the
caller holds), which is often well after the last op that reads it. The peak model simulates a
block's forward to say how much of a save set exists at the forward's peak
(``plan.simulate.forward_memory``); with lifetimes cut at each value's last read it takes the
must-only forward for leaner than it is, and prices saving a value the forward holds anyway as
if it added its bytes there.
"""

from __future__ import annotations

import weakref
from typing import Any


class StorageLifetimes:
    """Per storage of a recording block (its ``sid``), how many nodes were recorded when it was
    freed: freed before node ``freed[sid]`` ran. A storage alive at the end of the forward has
    no entry (``stop`` ends the watch there)."""

    __slots__ = ("freed", "_refs", "_died")

    def __init__(self, nodes: list[Any]) -> None:
        self.freed: dict[int, int] = {}
        # Weak references only: watching never keeps a storage alive. The callbacks hold the
        # dict and the node list, not this object, so that there is no cycle through them.
        self._refs: list[weakref.ref] = []
        freed = self.freed

        def died(sid: int) -> Any:
            return lambda _: freed.setdefault(sid, len(nodes))

        self._died = died

    def watch(self, storage: Any, sid: int) -> None:
        """Note when ``storage`` (an op's new output storage, ``sid``) is freed."""
        self._refs.append(weakref.ref(storage, self._died(sid)))

    def stop(self) -> dict[int, int]:
        """The forward ended: what was freed during it; later frees are not noted."""
        self._refs.clear()
        return dict(self.freed)
