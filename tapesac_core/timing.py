"""Timing ops on the training step: events on accelerators, a monotonic clock on CPU."""

from __future__ import annotations

import time
from typing import Any

import torch


class NodeTimer:
    """Times one op at a time. On accelerators ``stop`` returns events, resolved later without a sync per op."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type != "cpu"

    def start(self) -> Any:
        if self.events:
            event = torch.Event(device=self.device, enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start: Any) -> Any:
        if self.events:
            end = torch.Event(device=self.device, enable_timing=True)
            end.record()
            return (start, end)
        return time.perf_counter() - start


def seconds(sample: Any) -> float:
    """Seconds of a sample from ``NodeTimer.stop`` (waits for the end event on accelerators)."""
    if isinstance(sample, tuple):
        start, end = sample
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return float(sample)
