"""Timing a call on a device: synchronise, time with CUDA events (GPU) or the host clock (CPU), and
the copy bandwidth the optimizer-step benchmarks compare against."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that host timers measure it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
               prepare: Callable[[], object] = lambda: None) -> list[float]:
    """ms per timed call of ``fn`` (``iters`` of them after ``warmup`` untimed ones); ``prepare()`` runs
    before each call, untimed. CUDA events around the call on a GPU, the host's clock on CPU."""
    times = []
    for i in range(warmup + iters):
        prepare()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return times


def copy_bandwidth(numel: int, device: torch.device, warmup: int, iters: int) -> float:
    """Device-to-device (or host memory) copy bandwidth of fp32 ``dst.copy_(src)`` in GB/s, read +
    write bytes counted: the byte floor the optimizer-step benchmarks compare against."""
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = statistics.median(time_calls(lambda: dst.copy_(src), device, warmup, iters))
    return 2 * 4 * numel / (ms * 1e-3) / 1e9
