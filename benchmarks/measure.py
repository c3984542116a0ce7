"""What is measured of each method: its exact step peak (torch profiler on CPU, allocator on
accelerators), its FLOPs (FlopCounterMode, attention from shapes where it has no formula) and
its step times in interleaved rounds."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from benchmarks.common import rotated
from benchmarks.method import Method
from tapesac_core.measure.memory import LiveTensorMeter, profile_memory


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def run_safely(method: Method, what: str, fn: Callable[[], Any]) -> Any:
    """A failure of torch.compile is a result row; of anything else, a crash."""
    if method.error is not None:
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        if method.family != "compile":
            raise
        method.error = f"{what}: {type(e).__name__}: {e}".strip()[:2000]
        print(f"[{method.name}] failed at {what}: {type(e).__name__}", file=sys.stderr, flush=True)
        return None


def warm_up(methods: list[Method], ids: torch.Tensor) -> None:
    """Two steps of each method (compiles here, under each budget's config patch)."""
    for m in methods:
        print(f"[frontier] warm-up {m.name}", file=sys.stderr, flush=True)
        run_safely(m, "compile/warm-up", lambda: m.warm(ids))


# ---------------------------------------------------------------------- memory


def measure_peak(method: Method, ids: torch.Tensor, device: torch.device) -> int:
    """Bytes above those live at the step's start, at the step's peak (exact)."""
    method.model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cpu":
        _, mem = profile_memory(lambda: method.step(ids))
        return mem.peak
    synchronize(device)
    start = torch.accelerator.memory_allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    method.step(ids)
    synchronize(device)
    return torch.accelerator.max_memory_allocated(device) - start


def measure_peaks(methods: list[Method], ids: torch.Tensor, device: torch.device) -> None:
    for m in methods:
        m.peak = run_safely(m, "peak", lambda: measure_peak(m, ids, device))


def live_bytes(device: torch.device) -> int:
    """Bytes live now: what a Controller's absolute limit counts besides the step's own."""
    if device.type != "cpu":
        synchronize(device)
        return torch.accelerator.memory_allocated(device)
    with LiveTensorMeter() as meter:
        pass
    return meter.reading().current


# ---------------------------------------------------------------------- FLOPs


class AttentionFlops(TorchDispatchMode):
    """FLOPs of SDPA kernels FlopCounterMode has no formula for (on CPU), from shapes:
    forward 4·B·H·Sq·Sk·D (two matmuls), backward 2.5 times that (as FlopCounterMode's)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        name = func.__name__
        if "scaled_dot_product" in name and func.overloadpacket not in flop_registry:
            q, k = args[0], args[1]
            if "backward" in name:
                q, k = args[1], args[2]
            b, h, sq, d = q.shape
            forward = 4 * b * h * sq * k.shape[-2] * d
            self.flops += int(2.5 * forward) if "backward" in name else forward
        return func(*args, **(kwargs or {}))


def measure_flops(method: Method, ids: torch.Tensor) -> tuple[int, int]:
    """Forward and backward FLOPs of one step (attention added from shapes where uncounted);
    forward FLOPs are not counted for compiled models."""
    model = method.model
    model.zero_grad(set_to_none=True)
    with method.context():
        if method.family == "compile":
            # A dispatch mode around a compiled forward would make dynamo compile it again.
            loss, forward = model.loss(ids), None
        else:
            with FlopCounterMode(display=False) as fwd, AttentionFlops() as fwd_attn:
                loss = model.loss(ids)
            forward = fwd.get_total_flops() + fwd_attn.flops
        with FlopCounterMode(display=False) as bwd, AttentionFlops() as bwd_attn:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, bwd.get_total_flops() + bwd_attn.flops


def count_flops(methods: list[Method], ids: torch.Tensor) -> None:
    for m in methods:
        flops = run_safely(m, "flops", lambda: measure_flops(m, ids))
        if flops is not None:
            m.forward_flops, m.backward_flops = flops


# ---------------------------------------------------------------------- time


def timed(method: Method, ids: torch.Tensor, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    method.step(ids)
    synchronize(device)
    return time.perf_counter() - start


def interleaved_rounds(
    methods: list[Method], ids: torch.Tensor, device: torch.device, warmup: int, steps: int
) -> list[dict[str, float]]:
    """One step of every working method per round, the order rotated per round, so drift on a
    shared machine hits every method alike; each measured round's seconds by method name (also
    appended to each method's ``times``). The first ``warmup`` rounds are not measured."""
    live = [m for m in methods if m.error is None]
    rounds = []
    for r in range(warmup + steps):
        times = {}
        for m in rotated(live, r):
            t = run_safely(m, "timing", lambda: timed(m, ids, device))
            if t is not None:
                times[m.name] = t
        if r >= warmup:
            rounds.append(times)
            for m in live:
                if m.name in times:
                    m.times.append(times[m.name])
    return rounds
