"""bench_step.py's driver (docs in megatron_opt_bench.step): each implementation's warm-up, the
round-robin timed steps, the numbers taken after them, and the profiled steps that break
megatron_opt's opt.step() into its phases."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from .peak_memory import PeakMemory
from .ranks import max_min_over_ranks
from .step_variants import MegatronOpt, Net, Variant, distinct_storage_bytes
from .timing import sync

STEP_RANGE = "bench_step.opt_step"  # the whole opt.step() in the profiled steps
PHASES = (  # the record_function ranges opt.step() runs, in order, and what each covers
    ("megatron_opt.finish_grad_sync", "finish_grad_sync (grad reduce-scatter, or the wait for it)"),
    ("megatron_opt.pass1", "pass 1 (found-inf, sum of squares)"),
    ("megatron_opt.stats_allreduce", "stats all-reduce (+ host read)"),
    ("megatron_opt.pass2", "pass 2 (clip + AdamW)"),
    ("megatron_opt.param_sync", "param sync (all-gather)"),
)


def as_float(x) -> float:
    if x is None:
        return float("nan")
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


class Runner:
    """One implementation under test: its timings, losses and grad norms, step by step."""

    def __init__(self, make: Callable[[torch.nn.Module], Variant], init_state: dict, args, device) -> None:
        self.device = device
        self.fb: list[float] = []
        self.st: list[float] = []
        self.it: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.norms: list[float] = []
        self.peak = PeakMemory(device)
        self.peak.start()
        model = Net(args.hidden, args.layers).to(device)
        model.load_state_dict(init_state)
        self.v = make(model)
        self.name = self.v.name

    def iteration(self, x: torch.Tensor, y: torch.Tensor, timed: bool, profiled: bool = False) -> None:
        v, device = self.v, self.device
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        v.zero_grad()
        loss = v.forward_backward(x, y)
        sync(device)
        t1 = time.perf_counter()
        dist.barrier()
        sync(device)
        t2 = time.perf_counter()
        with record_function(STEP_RANGE) if profiled else contextlib.nullcontext():
            norm = v.step()
            sync(device)
        t3 = time.perf_counter()
        if profiled:
            return  # extra steps after the results were taken: they count in no table
        if timed:
            self.fb.append(t1 - t0)
            self.st.append(t3 - t2)
            self.it.append(t3 - t0)
        self.losses.append(loss.float())
        self.norms.append(as_float(norm))

    def finish_warmup(self) -> None:
        self.peak_delta = self.peak.peak_delta()
        self.peak_reset_ok = self.peak.cpu_peak_reset_ok or self.device.type == "cuda"

    def result(self, eval_batch) -> dict:
        v = self.v
        state_bytes = distinct_storage_bytes(v.state_tensors())
        train_losses = torch.stack(self.losses)
        dist.all_reduce(train_losses)
        train_losses /= dist.get_world_size()
        params = {n: t.cpu() for n, t in v.full_params().items()}
        ev = v.eval_loss(*eval_batch).detach().float().reshape(1)
        dist.all_reduce(ev)
        ev /= dist.get_world_size()
        return dict(
            name=self.name, fb=statistics.median(self.fb), step=statistics.median(self.st),
            iter=statistics.median(self.it), iter_mean=statistics.fmean(self.it), step_mean=statistics.fmean(self.st),
            state_bytes=state_bytes, peak_delta=self.peak_delta,
            train_losses=train_losses.cpu(), eval_loss=float(ev), grad_norm=self.norms[-1], params=params,
            peak_reset_ok=self.peak_reset_ok,
        )

    def profile_phases(self, batches) -> list[float]:
        """Run ``batches`` as extra steps under torch.profiler; per step, the mean CPU time in seconds
        of the whole opt.step() and of each of its megatron_opt.* phase ranges (key_averages():
        CPU time total / count), in PHASES order after the whole step, then the rest (the whole step
        minus the phases)."""
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for x, y in batches:
                self.iteration(x, y, timed=False, profiled=True)
        events = {e.key: e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU}
        out = []
        for key in (STEP_RANGE,) + tuple(key for key, _ in PHASES):
            e = events.get(key)
            if e is None or e.count != len(batches):
                raise RuntimeError(f"profiler range {key!r}: expected {len(batches)} occurrences, found "
                                   f"{0 if e is None else e.count}")
            out.append(e.cpu_time_total / e.count / 1e6)  # microseconds -> seconds
        return out + [out[0] - sum(out[1:])]


def run_all(makers, init_state: dict, batches, eval_batch, profile_batches, args, device) -> dict:
    """Build each implementation and run its warm-up steps in turn (its peak memory is measured over
    its construction and warm-up, while the others sit idle); then run the timed steps round-robin,
    rotating the order every step, so that machine noise falls on every implementation alike. Once
    every result is taken, each megatron_opt variant runs the profiled steps (its phase breakdown)."""
    runners = []
    for _, make in makers:
        r = Runner(make, init_state, args, device)
        for x, y in batches[: args.warmup]:
            r.iteration(x, y, timed=False)
        r.finish_warmup()
        runners.append(r)
    for i, (x, y) in enumerate(batches[args.warmup :]):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            r.iteration(x, y, timed=True)
    results = {r.name: r.result(eval_batch) for r in runners}
    for r in runners:
        results[r.name]["phases"] = (r.profile_phases(profile_batches)
                                     if profile_batches and isinstance(r.v, MegatronOpt) else None)
    return results


def verify_costs(results: dict, device: torch.device) -> list[tuple[str, float, float]]:
    """(name, mean iteration s, mean step s) of megatron_opt with verify off and of each verify variant
    (means: one step in N is verified, a median would not see it); max over ranks, a collective."""
    names = ["megatron_opt"] + [n for n in results if "[verify N=" in n]
    hi = max_min_over_ranks([v for n in names for v in (results[n]["iter_mean"], results[n]["step_mean"])], device)[0]
    return [(n, hi[2 * i], hi[2 * i + 1]) for i, n in enumerate(names)]
