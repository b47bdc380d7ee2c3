"""The main job's logging, as Megatron-LM's training_log: one line per --log-interval in Megatron-LM's
format (so its log parsers read ours), its TensorBoard scalars, per-phase timers (--timing-log-level),
throughput with MFU (--log-throughput), memory, parameter norm (--log-params-norm).

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
import contextlib
import datetime
import logging
import math
import os
import resource
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_opt.optimizer import phase_timers

MB = 1024.0 * 1024.0
# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by device name, most specific first: the denominator of MFU.
PEAK_TFLOPS_16BIT = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("B200", 2250.0))
# Level 1 ends with the optimizer's own phases (timed by the optimizer through OptimizerConfig.timers).
TIMERS_BY_LEVEL = {1: ("forward-backward", "all-grads-sync", "optimizer", phase_timers.PASS1, phase_timers.PASS2,
                       phase_timers.PARAM_SYNC),
                   2: ("batch-generator", "forward-compute", "backward-compute")}
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


# ----------------------------------------------------------------------------- timers
class PhaseTimers:
    """Megatron-LM's level-1/2 timers around train_step's phases. The optimizer's step and the DDP's
    gradient sync are timed by wrapping those two bound methods of the instances; the optimizer's
    passes by the optimizer itself, which is given this object as its ``config.timers`` (Megatron-LM's
    Timers interface: ``timers(name, log_level)`` -> a clock with start/stop). Level 0 wraps nothing
    and adds no synchronisation."""

    def __init__(self, level: int, cuda: bool) -> None:
        self.level, self.cuda = level, cuda
        self.device = torch.device("cuda") if cuda else torch.device("cpu")  # NCCL reduces device tensors
        self.totals: dict[str, float] = defaultdict(float)

    def names(self) -> tuple[str, ...]:
        return tuple(name for lvl in (1, 2) if lvl <= self.level for name in TIMERS_BY_LEVEL[lvl])

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return datetime.datetime.now().timestamp()

    @contextlib.contextmanager
    def time(self, name: str, level: int = 1) -> Iterator[None]:
        if self.level < level:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            self.totals[name] += self._now() - start

    def __call__(self, name: str, log_level: Optional[int] = None) -> "_Clock":
        """Megatron-LM's Timers interface, for the optimizer's phases."""
        return _Clock(self, name, 2 if log_level is None else log_level)

    def wrap(self, fn: Callable[..., Any], name: str, level: int = 1) -> Callable[..., Any]:
        if self.level < level:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(name, level):
                return fn(*args, **kwargs)
        return timed

    def instrument(self, ddp: Any, optimizer: Any) -> None:
        if self.level >= 1:
            ddp.finish_grad_sync = self.wrap(ddp.finish_grad_sync, "all-grads-sync")
            optimizer.step = self.wrap(optimizer.step, "_optimizer-step")
            optimizer.config.timers = self  # (a ChainedOptimizer's config is its first child's)

    def close_step(self, step_seconds: float, sync_before: float) -> None:
        """Split one train_step's time: its optimizer.step less the gradient sync inside it is the
        optimizer; what the step did not spend in optimizer.step is forward-backward."""
        if self.level < 1:
            return
        step = self.totals.pop("_optimizer-step", 0.0)
        self.totals["forward-backward"] += step_seconds - step
        self.totals["optimizer"] += step - (self.totals["all-grads-sync"] - sync_before)

    def report(self, normalizer: int, option: str) -> tuple[Optional[str], dict[str, float]]:
        """Megatron-LM's timers.log text over the ranks (ms per iteration) and {name: max ms}; resets."""
        names = self.names()
        if not names:
            return None, {}
        if "forward-compute" in self.totals:
            self.totals["backward-compute"] = self.totals["forward-backward"] - self.totals["forward-compute"]
        local = torch.tensor([self.totals.get(n, 0.0) * 1000.0 / normalizer for n in names], dtype=torch.float64,
                             device=self.device)
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        self.totals.clear()
        title = "max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"
        lines = [title]
        for name, lo, hi in zip(names, low.tolist(), high.tolist()):
            value = f"{hi:.2f}" if option == "max" else f"({lo:.2f}, {hi:.2f})"
            lines.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
        return "\n".join(lines), dict(zip(names, high.tolist()))


class _Clock:
    """One named timer of PhaseTimers, started and stopped by the optimizer (no-ops above the level)."""

    def __init__(self, timers: PhaseTimers, name: str, level: int) -> None:
        self.timers, self.name, self.on = timers, name, level <= timers.level
        self.started: Optional[float] = None

    def start(self, barrier: bool = False) -> None:
        if self.on:
            self.started = self.timers._now()

    def stop(self, barrier: bool = False) -> None:
        if self.on and self.started is not None:
            self.timers.totals[self.name] += self.timers._now() - self.started
            self.started = None


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


# ----------------------------------------------------------------------------- tensorboard
def drop_events_after(log_dir: str, iteration: int, consumed_samples: int) -> int:
    """Rewrite the event files of ``log_dir`` without the scalars a killed run wrote past the checkpoint
    it is resumed from (steps > ``iteration``; "... vs samples" tags: > ``consumed_samples``), so a
    resumed run's points are never there twice. TensorBoard's purge_step cannot do this: it purges
    every tag at one step value, and the "vs samples" tags count samples. Returns the points dropped."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        kept, changed = [], False
        for raw in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(raw)
            if event.HasField("summary") and event.summary.value:
                values = [v for v in event.summary.value
                          if event.step <= (consumed_samples if v.tag.endswith(" vs samples") else iteration)]
                if len(values) != len(event.summary.value):
                    dropped += len(event.summary.value) - len(values)
                    changed = True
                    if not values:
                        continue
                    del event.summary.value[:]
                    event.summary.value.extend(values)
                    raw = event.SerializeToString()
            kept.append(raw)
        if changed:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                writer = RecordWriter(f)
                for raw in kept:
                    writer.write(raw)
                writer.flush()
            os.replace(tmp, path)
    return dropped


class TensorboardLog:
    """Megatron-LM's training_log and evaluation scalars, written by the last rank (as Megatron-LM)."""

    def __init__(self, args: argparse.Namespace, start_iteration: int, consumed_samples: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # checked by parse_args

        self.args = args
        resumed = start_iteration > 0 and os.path.isdir(args.tensorboard_dir)  # a fresh run deletes nothing
        self.dropped = drop_events_after(args.tensorboard_dir, start_iteration, consumed_samples) if resumed else 0
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
        if start_iteration == 0:
            for key, value in sorted(vars(args).items()):
                self.writer.add_text(key, str(value), global_step=0)

    def _both(self, tag: str, value: float, iteration: int, consumed: int) -> None:
        self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar(f"{tag} vs samples", value, consumed)

    def log(self, iteration: int, consumed: int, result: Any, skipped_samples: int, norm: Optional[float],
            memory: tuple[float, float, float, float], world: int) -> None:
        if iteration % self.args.tensorboard_log_interval:
            return
        self._both("learning-rate", result.lr, iteration, consumed)
        if skipped_samples > 0:
            self.writer.add_scalar("skipped-train-samples", skipped_samples, iteration)
        self._both("batch-size", self.args.global_batch_size, iteration, consumed)
        self._both("lm loss", result.loss, iteration, consumed)
        if self.args.log_loss_scale_to_tensorboard:
            self._both("loss-scale", result.loss_scale, iteration, consumed)
        if self.args.log_world_size_to_tensorboard:
            self._both("world-size", world, iteration, consumed)
        if result.grad_norm is not None:
            self._both("grad-norm", result.grad_norm, iteration, consumed)
        if result.num_zeros is not None:
            self._both("num-zeros", result.num_zeros, iteration, consumed)
        if norm is not None:
            self._both("params-norm", norm, iteration, consumed)
        if self.args.log_memory_to_tensorboard:
            for tag, value in zip(("mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes",
                                   "mem-allocated-count"), memory):
                self.writer.add_scalar(tag, value, iteration)

    def log_interval(self, iteration: int, per_iteration_s: float, tflops: Optional[float],
                     timers_ms: dict[str, float]) -> None:
        """At --log-interval, with --log-timers-to-tensorboard: iteration time, throughput, timers."""
        if not self.args.log_timers_to_tensorboard:
            return
        self.writer.add_scalar("iteration-time", per_iteration_s, iteration)
        if tflops is not None:
            self.writer.add_scalar("throughput", tflops, iteration)
        for name, ms in timers_ms.items():
            self.writer.add_scalar(f"{name}-time", ms, iteration)

    def log_validation(self, loss: float, iteration: int, consumed: int) -> None:
        self._both("lm loss validation", loss, iteration, consumed)
        if self.args.log_validation_ppl_to_tensorboard:
            self._both("lm loss validation ppl", math.exp(min(20.0, loss)), iteration, consumed)

    def close(self) -> None:
        self.writer.close()


def print_rank0(rank: int, *lines: str, err: bool = False) -> None:
    if rank == 0:
        for line in lines:
            print(line, file=sys.stderr if err else sys.stdout, flush=True)
