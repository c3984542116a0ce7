"""The link between an accelerator's memory and pinned host memory, measured each way.

Why measured. Offload plans price each copy by what the compute around it cannot hide
(``plan/offload_choice.py``), and bandwidths differ by machine and by direction (a GH200 copies
to the device more than twice as fast as back). A copy of ``nbytes`` each way, timed by events on
a side stream as the offload mechanism copies (``tape/offload.py``), repeated, the median of each.
On CPU there is no separate host memory: no link, and plans never offload.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..plan.offload_choice import Link

LINK_PROBE_BYTES = 32 * 2**20  # large enough that a copy's launch is noise, small enough to fit
LINK_PROBE_REPEATS = 5


def measure_link(
    device: torch.device, nbytes: int = LINK_PROBE_BYTES, repeats: int = LINK_PROBE_REPEATS
) -> Link | None:
    """``device``'s bandwidths to and from pinned host memory; None on CPU."""
    if device.type == "cpu":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.Stream(device=device)
    to_host, to_device = [], []
    for _ in range(repeats):
        to_host.append(_timed(stream, lambda: host.copy_(on_device, non_blocking=True)))
        to_device.append(_timed(stream, lambda: on_device.copy_(host, non_blocking=True)))
    return Link(
        to_host=nbytes / statistics.median(to_host),
        to_device=nbytes / statistics.median(to_device),
    )


def _timed(stream: torch.Stream, copy: Callable[[], object]) -> float:
    """Seconds ``copy`` takes on ``stream``, by events around it."""
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    with stream:
        start.record(stream)
        copy()
        end.record(stream)
    end.synchronize()
    return max(start.elapsed_time(end) / 1e3, 1e-9)
