"""The machine a benchmark ran on, for its report: CPU model, cores, threads, load average."""
from __future__ import annotations

import os
import platform
from typing import Optional

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS has none): a shared machine's noise, for the report."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def gloo_cpu_description(loads: str = "") -> str:
    """A CPU run's machine line: model, cores, gloo and intra-op threads per rank, then ``loads``."""
    return f"{cpu_model()}, {os.cpu_count()} cores, gloo, {torch.get_num_threads()} intra-op thread(s)/rank{loads}"
