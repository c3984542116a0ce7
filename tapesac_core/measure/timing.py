"""Timing ops on the training step: events on accelerators, a monotonic clock on CPU."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from .._compat import cuda_sleep

_LEAD = 5e-3  # seconds of device work queued ahead of the host whenever it catches up
_HEADROOM = 1e-3  # queued work left when the host starts an op: longer than launching one op


class DeviceQueue:
    """Keeps an accelerator's queue ahead of the host while ops are timed.

    An event pair around an op measures from the moment the device reaches the start event to
    the moment it finishes the op. An idle device reaches the start event at once, then waits
    for the host to launch the op: the pair measures the host's dispatch, and cheap ops look
    expensive. Queuing device work (a sleep kernel) whenever the host's estimate of the queued
    work runs short makes the device reach each start event only after the host launched the op
    behind it. The estimate counts the sleeps alone (ops take device time too), so it errs
    towards more queued work.
    """

    def __init__(
        self, delay: Callable[[float], None], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.delay, self.clock = delay, clock
        self.busy_until = float("-inf")  # host-clock time the queued sleeps end, at the earliest

    def keep_ahead(self) -> None:
        """Before timing an op: queue more device work if the device could run dry meanwhile."""
        now = self.clock()
        if self.busy_until - now < _HEADROOM:
            self.delay(_LEAD)
            self.busy_until = max(self.busy_until, now) + _LEAD


@functools.cache
def _cuda_cycles_per_second(index: int) -> float:
    """Clock rate of ``torch.cuda._sleep``'s spin loop on one GPU, measured once (one sync)."""
    with torch.cuda.device(index):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        cycles = 10_000_000
        start.record()
        cuda_sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


def _cuda_delay(device: torch.device) -> Callable[[float], None]:
    """Queue ``seconds`` of device work on ``device``'s current stream (private ``_sleep``:
    the one kernel PyTorch has that takes a duration)."""
    index = device.index if device.index is not None else torch.cuda.current_device()

    def delay(seconds: float) -> None:
        with torch.cuda.device(index):
            cuda_sleep(int(seconds * _cuda_cycles_per_second(index)))

    return delay


@functools.cache
def device_queue(device: torch.device) -> DeviceQueue | None:
    """One queue keeper per device, shared by every block's timer; None where no sleep kernel
    exists (accelerators other than CUDA: their event times include the host's gaps)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return None
    return DeviceQueue(_cuda_delay(device))


class NodeTimer:
    """Times one op at a time.

    What is measured: on CPU, host seconds from just before the op is dispatched to its return.
    On accelerators, the device's time from reaching the op's start event to finishing its
    kernels, with device work queued ahead (``DeviceQueue``) so that this is the op's own device
    time, not the host's dispatch gap. ``stop`` returns events, resolved later by ``seconds``
    without a sync per op.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        queue: DeviceQueue | None = None,
        event: Callable[..., Any] | None = None,
    ) -> None:
        self.device = device
        self.events = device.type != "cpu"
        self.queue = queue if queue is not None or not self.events else device_queue(device)
        self._event = event

    def start(self) -> Any:
        if self.events:
            if self.queue is not None:
                self.queue.keep_ahead()
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
        event = (self._event or torch.Event)(device=self.device, enable_timing=True)
        event.record(torch.accelerator.current_stream(self.device))
        return event


def seconds(sample: Any) -> float:
    """Seconds of a sample from ``NodeTimer.stop`` (waits for the end event on accelerators)."""
    if isinstance(sample, tuple):
        start, end = sample
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return float(sample)
