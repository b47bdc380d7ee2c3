"""The main job's metrics, as Megatron-LM's training_log: one line per --log-interval in Megatron-LM's
format (so its log parsers read ours), throughput with MFU (--log-throughput), memory, parameter norm
(--log-params-norm), the --log-json record of every iteration and the run's last line. Its TensorBoard
scalars: components/tensorboard.py; its per-phase timers (--timing-log-level): components/timers.py.

    [2026-01-01 12:00:00.000000] iteration       10/      30 | consumed samples:           80 | elapsed
    time per iteration (ms): 131.2 | learning rate: 2.880000E-03 | global batch size:     8 | lm loss:
    4.321000E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan
    iterations:   0 | mem RSS (MB): 612.3 | mem max RSS (MB): 640.1 |

(one line; throughput, MFU, num zeros and params norm appear where Megatron-LM puts them when asked
for). Memory is the CUDA caching allocator's allocated and peak bytes on a GPU, the process's
resident set (current and peak) on CPU, the maximum over the ranks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import resource
import sys
from collections import Counter
from typing import Any, Optional

import torch

MB = 1024.0 * 1024.0
# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by device name, most specific first: the denominator of MFU.
PEAK_TFLOPS_16BIT = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("B200", 2250.0))
SKIP_MESSAGE = "megatron_opt: step skipped"


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's logging flags this script implements besides the library's (--log-interval, ...)."""
    g = parser.add_argument_group("logging (Megatron-LM's, this script's)")
    g.add_argument("--log-params-norm", action="store_true", help="log the parameters' L2 norm")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write memory to TensorBoard (CUDA allocator bytes; process RSS on CPU)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard", action="store_false")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="0: iteration time only; 1: forward-backward, all-grads-sync, optimizer; 2: also "
                        "batch-generator, forward-compute, backward-compute (timing synchronises the device)")
    g.add_argument("--timing-log-option", default="minmax", choices=("max", "minmax"),
                   help="report the max, or the (min, max), of each timer over the ranks")


# ----------------------------------------------------------------------------- device facts
def peak_tflops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The device's dense 16-bit tensor-core peak for bf16/fp16 runs on a known GPU, else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS_16BIT if key in name), None)


def memory_now(device: torch.device) -> tuple[float, float, float, float]:
    """(allocated, peak allocated, reserved, allocation count) bytes: CUDA's allocator, or this
    process's resident set (current, peak) on CPU."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return (float(stats.get("allocated_bytes.all.current", 0)), float(stats.get("allocated_bytes.all.peak", 0)),
                float(stats.get("reserved_bytes.all.current", 0)), float(stats.get("allocation.all.current", 0)))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # kB on Linux
    return float(rss), max(peak, float(rss)), float(rss), 0.0


def params_norm(model: torch.nn.Module) -> float:
    """The L2 norm of every parameter (replicated over data parallelism: computed locally)."""
    norms = [p.detach().float().norm() for p in model.parameters()]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


# ----------------------------------------------------------------------------- the interval's numbers
class Interval:
    """What one --log-interval accumulates: Megatron-LM's advanced/skipped/nan iteration counts, the
    loss summed over the iterations that updated, the time, and the skip reasons."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.advanced, self.skipped, self.nan, self.seconds = 0.0, 0, 0, 0, 0.0
        self.reasons: Counter[str] = Counter()

    def add(self, loss: float, success: bool, nonfinite: bool, reason: Optional[str], seconds: float) -> None:
        self.seconds += seconds
        if success:
            self.advanced += 1
            self.loss_sum += loss
        else:
            self.skipped += 1
            self.nan += int(nonfinite)
            self.reasons[reason or "skipped"] += 1

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped


def log_line(iteration: int, args: argparse.Namespace, interval: Interval, consumed: int, skipped_samples: int,
             result: Any, tflops: Optional[float], mfu: Optional[float], norm: Optional[float],
             memory: tuple[float, float], cuda: bool) -> str:
    """Megatron-LM's training_log line, with memory appended."""
    per_iteration = interval.seconds / max(interval.iterations, 1)
    s = f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    s += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    s += f" consumed samples: {consumed:12d} |"
    if skipped_samples > 0:
        s += f" skipped samples: {skipped_samples:12d} |"
    s += f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |"
    if tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |" if tflops >= 10 else \
            f" throughput per GPU (TFLOP/s/GPU): {tflops:.4f} |"
        if mfu is not None:
            s += f" MFU: {mfu * 100:.1f}% |"
    s += f" learning rate: {result.lr:.6E} |"
    s += f" global batch size: {args.global_batch_size:5d} |"
    s += f" lm loss: {interval.loss_sum / max(1, interval.advanced):.6E} |"
    s += f" loss scale: {result.loss_scale:.1f} |"
    if result.grad_norm is not None:
        s += f" grad norm: {result.grad_norm:.3f} |"
    if result.num_zeros is not None:
        s += f" num zeros: {result.num_zeros} |"
    if norm is not None:
        s += f" params norm: {norm:.3f} |"
    s += f" number of skipped iterations: {interval.skipped:3d} |"
    s += f" number of nan iterations: {interval.nan:3d} |"
    kind = ("mem allocated", "mem max allocated") if cuda else ("mem RSS", "mem max RSS")
    s += f" {kind[0]} (MB): {memory[0] / MB:.1f} | {kind[1]} (MB): {memory[1] / MB:.1f} |"
    return s


def skip_summary(iteration: int, interval: Interval, loss_scale: float) -> Optional[str]:
    """One line for the interval's skipped steps (the library's per-step warning is filtered out)."""
    if not interval.skipped:
        return None
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(interval.reasons.items()))
    return (f"pretrain_gpt.py: {interval.skipped} of the {interval.iterations} iterations up to {iteration} skipped "
            f"their update ({reasons}); loss scale now {loss_scale:g}")


class DropSkipWarnings(logging.Filter):
    """Drops megatron_opt's one-line-per-skipped-step warning: the log line counts the skips."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(SKIP_MESSAGE)


def print_rank0(rank: int, *lines: str, err: bool = False) -> None:
    if rank == 0:
        for line in lines:
            print(line, file=sys.stderr if err else sys.stdout, flush=True)


# ----------------------------------------------------------------------------- the exact values and the run's end
def json_record(step: int, consumed_samples: int, result: Any) -> str:
    """--log-json's line for one iteration: the exact values of its TrainStepResult."""
    return json.dumps({
        "iteration": step, "consumed_samples": consumed_samples, "lm loss": result.loss,
        "grad_norm": result.grad_norm, "num_zeros": result.num_zeros, "loss_scale": result.loss_scale,
        "learning_rate": result.lr, "success": result.success, "skip_reason": result.skip_reason,
        "skipped_iterations": result.skipped_steps, "num_tokens": result.num_tokens}) + "\n"


def diverged(result: Any) -> bool:
    """A non-finite loss, or non-finite gradients that no loss scaler will back off from (bf16, fp32,
    a constant fp16 scale). An fp16 step the dynamic scaler skipped ("overflow") with a finite loss
    is the scaler's normal backoff, not divergence."""
    return not math.isfinite(result.loss) or result.skip_reason == "non-finite"


class Losses:
    """For the last line: the first loss, the last one that updated, the last one, and the iterations
    whose loss or gradients were non-finite (trained on with --no-check-for-nan-in-loss-and-grad)."""

    def __init__(self) -> None:
        self.first: Optional[float] = None
        self.last_updated: Optional[float] = None
        self.last = math.nan
        self.non_finite: list[int] = []

    def add(self, step: int, result: Any) -> None:
        self.first = result.loss if self.first is None else self.first
        self.last_updated = result.loss if result.success else self.last_updated
        self.last = result.loss
        if diverged(result):
            self.non_finite.append(step)

    def done_line(self) -> str:
        """So a diverged run never ends looking fine."""
        bad = self.non_finite
        note = (f"; {len(bad)} iteration{'s' if len(bad) > 1 else ''} had a non-finite loss or gradients "
                f"(first {bad[0]}, last {bad[-1]}), the last loss {self.last:.4f}" if bad else "")
        last = f"{self.last_updated:.4f}" if self.last_updated is not None else "none"
        return f"done: loss {self.first:.4f} -> {last}{note}"
