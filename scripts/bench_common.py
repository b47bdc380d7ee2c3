"""What the benchmark scripts share: device synchronisation and timing, the machine's description,
per-rank reductions and ranges, Megatron's weight-decay groups and megatron_opt's optimizer-state
options. Imported by bare name (the scripts' folder is first on sys.path when a script runs)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

# --mo-states of bench_step.py and bench_optimizer_step.py: megatron_opt's optimizer-state options
# (Megatron-LM's precision-aware optimizer fields of OptimizerConfig).
MO_STATES: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "fp32": MappingProxyType({}),
    "bf16": MappingProxyType(dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=False)),
    "bf16+rem": MappingProxyType(dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                      exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)),
})


# ---------------------------------------------------------------------------------------------- timing
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


# ---------------------------------------------------------------------------------------------- machine
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


# ---------------------------------------------------------------------------------------------- ranks
def max_min_over_ranks(values: list[float], device: torch.device = torch.device("cpu")
                       ) -> tuple[list[float], list[float]]:
    """(max over ranks, min over ranks) of each value."""
    hi = torch.tensor(values, dtype=torch.float64, device=device)
    neg_lo = -hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(neg_lo, op=dist.ReduceOp.MAX)
    return hi.tolist(), (-neg_lo).tolist()


def fmt_range(hi: float, lo: float, digits: int) -> str:
    """'lo–hi' over ranks, or one number when both print alike."""
    a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return b if a == b else f"{a}–{b}"


# ---------------------------------------------------------------------------------------------- optimizer
def no_decay(name: str, shape: Iterable[int]) -> bool:
    """Megatron-LM's (and megatron_opt's) default: no weight decay on biases and 1-D params."""
    return name.endswith(".bias") or len(tuple(shape)) == 1


def weight_decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """torch.optim param groups with Megatron's weight-decay split (empty groups left out)."""
    named = list(named_params)
    decay = [p for n, p in named if not no_decay(n, p.shape)]
    nodecay = [p for n, p in named if no_decay(n, p.shape)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
