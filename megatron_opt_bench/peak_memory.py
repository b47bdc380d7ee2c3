"""Peak memory over a section of a benchmark, shared by the step and checkpoint benchmarks.

CUDA: the caching allocator's peak. CPU: the peak RSS (VmHWM, reset through /proc/self/clear_refs),
above the RSS at the start of the section, after malloc_trim hands freed heap pages back.
"""
from __future__ import annotations

import ctypes
import gc
import os
import resource
from typing import Optional

import torch


def _load_libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """start() then peak_delta(): the peak above the memory at start(). ``cpu_peak_reset_ok`` says
    whether the CPU peak could be reset (else it is the process's peak so far)."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self.cpu_peak_reset_ok = False
        # CPU: malloc_trim hands freed heap pages back to the OS before each section, so that its RSS
        # baseline is the live memory. (A fixed mmap threshold would do this more reliably but makes
        # every large temporary a fresh mmap and page faults, which distorts times.)
        self.libc = _load_libc() if device.type == "cpu" else None

    def malloc_trim(self) -> None:
        if self.libc is not None:
            try:
                self.libc.malloc_trim(0)
            except AttributeError:
                pass

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            self.cpu_peak_reset_ok = True
        except OSError:
            self.cpu_peak_reset_ok = False
        self.base = rss_bytes()

    def peak_delta(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return max(0, peak - self.base)
