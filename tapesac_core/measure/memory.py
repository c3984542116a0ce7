"""Memory meter: peak and current bytes in use, measured, behind one interface for every device.

On an accelerator the meter reads the caching allocator's statistics (``torch.accelerator``).
PyTorch keeps no allocator statistics on CPU, so there the meter tracks storages: a dispatch mode
sees every op output, and a weak reference on each storage reports the moment it is freed. A CPU
window starts from the live tensors the garbage collector can reach, so readings are absolute.

``profile_memory`` measures the same quantity independently, from the allocation events of torch's
profiler (``profile_memory=True``); tests use it as the reference for the meter and for the tape.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._compat import TorchDispatchMode
from ..tensors import flat_tensors, is_subclass_with_dispatch


@dataclass(frozen=True, kw_only=True)
class MemoryReading:
    """One reading of a device's memory, in bytes."""

    peak: (
        int  # peak in use since the window started (allocated on accelerators; live tensors on CPU)
    )
    current: int  # in use now
    reserved: int  # peak held by the caching allocator in the window (``current`` on CPU)
    total: int  # device memory (physical memory on CPU)
    free: int  # free device memory as the driver/OS reports it
    outside: int = 0  # device memory in use outside PyTorch's caching allocator (Eq. 9's non_torch)
    # The caching allocator never gives reserved memory back by itself, so ``reserved`` stays at
    # the high-water mark of any earlier step: only what the window itself added tells pressure.
    reserved_growth: int = 0  # bytes reserved beyond what the allocator held when the window began
    alloc_retries: int = (
        0  # allocations that failed, freed cached blocks and retried, in the window
    )
    # A caching allocator's statistics; False: live tensor bytes (CPU), where nothing fragments.
    allocator: bool = True


class MemoryMeter(Protocol):
    """Measures memory over a window: ``with meter: ...`` then ``meter.reading()``."""

    def __enter__(self) -> MemoryMeter: ...

    def __exit__(self, *exc: Any) -> None: ...

    def reading(self) -> MemoryReading: ...


def physical_memory() -> tuple[int, int]:
    """Total and available physical memory of this host, in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")


def device_memory(device: torch.device) -> int:
    """Total memory of ``device`` in bytes: the host's physical memory for the CPU."""
    if device.type == "cpu":
        return physical_memory()[0]
    return torch.accelerator.get_memory_info(device)[1]


def alloc_retries(device: torch.device) -> int:
    """Allocations the caching allocator had to retry after freeing its cache, since the start.

    Read through ``torch.accelerator.memory_stats`` where this torch has it, else through
    ``torch.cuda.memory_stats`` (older torch); 0 where neither applies.
    """
    stats = getattr(torch.accelerator, "memory_stats", None)
    if stats is None and device.type == "cuda":
        stats = torch.cuda.memory_stats
    return int(stats(device).get("num_alloc_retries", 0)) if stats is not None else 0


class AcceleratorMeter:
    """Allocator statistics of an accelerator (CUDA and any ``torch.accelerator`` device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reserved_start = 0
        self._retries_start = 0

    def __enter__(self) -> AcceleratorMeter:
        torch.accelerator.synchronize(self.device)
        torch.accelerator.reset_peak_memory_stats(self.device)
        self._reserved_start = torch.accelerator.memory_reserved(self.device)
        self._retries_start = alloc_retries(self.device)
        self._peak = self._reserved = 0  # over the marks so far (each mark resets the statistics)
        return self

    def mark(self) -> tuple[int, int]:
        """Peak allocated since the previous mark (or the window's start) and allocated now.

        The caching allocator counts on the host as it serves blocks, in stream order, so no
        synchronisation is needed; its peak is reset for the next segment.
        """
        peak = torch.accelerator.max_memory_allocated(self.device)
        self._peak = max(self._peak, peak)
        self._reserved = max(self._reserved, torch.accelerator.max_memory_reserved(self.device))
        torch.accelerator.reset_peak_memory_stats(self.device)
        return peak, torch.accelerator.memory_allocated(self.device)

    def __exit__(self, *exc: Any) -> None:
        torch.accelerator.synchronize(self.device)

    def reading(self) -> MemoryReading:
        free, total = torch.accelerator.get_memory_info(self.device)
        reserved_now = torch.accelerator.memory_reserved(self.device)
        reserved = max(self._reserved, torch.accelerator.max_memory_reserved(self.device))
        return MemoryReading(
            peak=max(self._peak, torch.accelerator.max_memory_allocated(self.device)),
            current=torch.accelerator.memory_allocated(self.device),
            reserved=reserved,
            total=total,
            free=free,
            outside=max(0, total - free - reserved_now),
            reserved_growth=max(0, reserved - self._reserved_start),
            alloc_retries=alloc_retries(self.device) - self._retries_start,
        )


class _StorageTracker(TorchDispatchMode):
    def __init__(self, meter: LiveTensorMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in flat_tensors(out):
            self.meter.track(t)
        return out


class LiveTensorMeter:
    """Live CPU tensor bytes, storages counted once: allocations seen at the dispatcher, frees by weakref."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.segment_peak = 0  # peak since the last mark
        self._refs: dict[int, weakref.ref] = {}
        self._mode: _StorageTracker | None = None
        self._on_free: dict[int, list[Callable[[], Any]]] = {}  # see ``when_freed``

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until it is freed (once per storage)."""
        if t.device.type != "cpu" or is_subclass_with_dispatch(t):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if _NOT_COUNTED.get(key) is storage:
            return
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return
        size = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _: self._freed(key, size))
        self.current += size
        self.peak = max(self.peak, self.current)
        self.segment_peak = max(self.segment_peak, self.current)

    def _freed(self, key: int, size: int) -> None:
        self.current -= size
        ref = self._refs.get(key)
        if ref is not None and ref() is None:
            del self._refs[key]
            for callback in self._on_free.pop(key, ()):
                callback()

    def when_freed(self, storage: Any, callback: Callable[[], Any]) -> bool:
        """Call ``callback`` once ``storage`` is freed and the free is counted: a mark it takes
        reads the bytes in use without the storage. (A weak reference of the caller's own would
        run before this meter's, which was made earlier.) False, and no call, for a storage the
        meter does not count."""
        ref = self._refs.get(id(storage))
        if ref is None or ref() is not storage:
            return False
        self._on_free.setdefault(id(storage), []).append(callback)
        return True

    def __enter__(self) -> LiveTensorMeter:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for t in tensors:
            self.track(t)
            # A gradient has no Python object until it is read; its storage is live anyway.
            if t.is_leaf and t.grad is not None:
                self.track(t.grad)
        self.peak = self.segment_peak = self.current
        self._mode = _StorageTracker(self)
        self._mode.__enter__()
        return self

    def mark(self) -> tuple[int, int]:
        """Peak live bytes since the previous mark (or the window's start), and live bytes now."""
        peak, self.segment_peak = self.segment_peak, self.current
        return peak, self.current

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def reading(self) -> MemoryReading:
        total, free = physical_memory()
        return MemoryReading(
            peak=self.peak,
            current=self.current,
            reserved=self.current,
            total=total,
            free=free,
            allocator=False,
        )


# Storages of tensors that are bookkeeping, not memory a step uses (``not_counted``).
_NOT_COUNTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def not_counted(t: torch.Tensor) -> None:
    """Leave ``t``'s storage out of every CPU meter: a random generator's state that recording
    keeps per random op (``generator.get_state()``, made without passing the dispatcher). On an
    accelerator it is host memory, which the allocator's statistics never see; on CPU a meter
    would miss it in the step that makes it (no op to see) but count it in any later step that
    still holds it (a cached tape keeps it), and so read a must-only sample step low against
    the steps planned from it."""
    storage = t.untyped_storage()
    _NOT_COUNTED[id(storage)] = storage


def memory_meter(device: torch.device | str) -> MemoryMeter:
    """The meter for ``device``: allocator statistics on accelerators, live tensor bytes on CPU."""
    device = torch.device(device)
    return LiveTensorMeter() if device.type == "cpu" else AcceleratorMeter(device)


def marker(meter: MemoryMeter | None) -> Callable[[], tuple[int, int]] | None:
    """The ``mark`` of ``meter`` (peak bytes since the previous mark, and bytes now), which the
    memory timeline needs: TapeSAC's own meters have one, a meter given to the controller (one
    that only reads a window) need not, and its steps record no timeline."""
    return meter.mark if isinstance(meter, (AcceleratorMeter, LiveTensorMeter)) else None


@dataclass(frozen=True, kw_only=True)
class ProfiledMemory:
    """Allocation events of one call, relative to the bytes live before it."""

    peak: int  # highest net bytes allocated at any moment during the call
    end: int  # net bytes still allocated when it returned


def profile_memory(fn: Callable[[], Any]) -> tuple[Any, ProfiledMemory]:
    """Run ``fn`` under torch's profiler with ``profile_memory=True``: its result and memory deltas."""
    from torch.profiler import ProfilerActivity, profile

    # Garbage from earlier code must not be collected, and counted as freed, inside the window.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    finally:
        gc.enable()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.name == "[memory]":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    net = peak = 0
    for _, size in sorted(sizes):
        net += size
        peak = max(peak, net)
    return result, ProfiledMemory(peak=peak, end=net)
