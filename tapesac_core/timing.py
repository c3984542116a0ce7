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
            return self._recorded_event()
        return time.perf_counter()

    def stop(self, start: Any) -> Any:
        if self.events:
            return (start, self._recorded_event())
        return time.perf_counter() - start

    def _recorded_event(self) -> Any:
        """A timing event recorded on the current stream of the timed device: ``record()``
        without a stream records on the current device's stream, another device's when a
        process drives several."""
        event = torch.Event(device=self.device, enable_timing=True)
        event.record(torch.accelerator.current_stream(self.device))
        return event


def seconds(sample: Any) -> float:
    """Seconds of a sample from ``NodeTimer.stop`` (waits for the end event on accelerators)."""
    if isinstance(sample, tuple):
        start, end = sample
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return float(sample)
