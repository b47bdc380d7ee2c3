"""Side-by-side step benchmark: megatron_opt vs torch DDP + ZeroRedundancyOptimizer vs FSDP2.

Run (CPU/gloo, or one GPU per rank with NCCL when CUDA is available):

    torchrun --standalone --nproc_per_node=2 scripts/bench_step.py [--hidden 256 --layers 6 \
        --tokens 256 --steps 30 --warmup 5 --profile-steps 10 --dtype fp32|bf16 \
        --torch-adamw default|foreach|fused]

All implementations train the same model (a stack of pre-norm MLP blocks made of Linear layers), from
the same initial weights, on the same per-rank batches, with the same AdamW hyperparameters, the same
weight-decay groups (none on biases and 1-D params, Megatron's default) and global-norm clipping at
``--clip-grad``:

  megatron_opt   megatron_opt.DistributedDataParallel(use_distributed_optimizer=True,
                 grad_reduce_in_fp32=True) + get_megatron_optimizer (bf16: bf16 model, fp32 masters).
  ddp+zero       torch DDP(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer(AdamW) +
                 clip_grad_norm_ (bf16: fp32 params with torch.autocast(bf16); ZeRO has no masters).
  fsdp2          fully_shard per block and on the root (bf16: MixedPrecisionPolicy(param_dtype=bf16,
                 reduce_dtype=fp32)) + torch.optim.AdamW + clip_grad_norm_.
  megatron_opt [verify N=n] (only with --mo-verify n,...): megatron_opt with OptimizerConfig(verify_interval=n):
                 every n-th step() checks replicas, the update (float64) and the param/master cast. Its cost
                 table gives the mean iteration time (a verified step is one in n, so the median hides it).
  megatron_opt+overlap (only with --mo-overlap): overlap_grad_reduce=True (bucket size
                 --mo-overlap-bucket-size, default Megatron's). overlap_param_gather stays off: its
                 all-gather would run in the background while the other implementations take their
                 round-robin turns, which would hide its cost.

Each implementation is built and warmed up in turn (``--warmup`` steps); then the ``--steps`` timed steps
run round-robin (one step of each, order rotated every step), so that noise on a shared machine falls
on all of them alike. Every implementation sees the same batches in the same order. Measured per
rank, median over the timed steps, with a dist.barrier() before each timed section:
  fwd+bwd    zero_grad + forward + loss + backward (DDP all-reduce and FSDP2 reduce-scatter/all-gather
             happen here).
  step       megatron_opt: everything inside opt.step() (the grad reduce-scatter when overlap is off,
             the norm, clipping, AdamW, the param all-gather); torch: clip_grad_norm_ + optimizer.step()
             (ZeRO: local AdamW + param broadcast).
  iteration  wall time from the synchronised start of zero_grad to the end of the step, including the
             barrier before the step (so collectives left running asynchronously by backward are
             counted here even when they finish during that barrier).
megatron_opt's step in phases: after the timed steps (and after the numerics and memory are taken, so
the extra steps change neither), each megatron_opt variant runs ``--profile-steps`` more steps under
torch.profiler (CPU activity, + CUDA on GPU). opt.step() marks its phases with record_function ranges
(megatron_opt.finish_grad_sync, .pass1, .stats_allreduce, .pass2, .param_sync); the table gives each
range's CPU time total / count from prof.key_averages(), next to the whole opt.step() under the
profiler. The timed steps are never profiled.
Memory per rank:
  model state  bytes of the distinct tensor storages each implementation holds after a step: params,
               grads / grad buffers, optimizer state (incl. fp32 masters). Divided by the global
               parameter count to give bytes/param.
  peak delta   over construction and warm-up. CUDA: torch.cuda.max_memory_allocated() above the
               allocation before building. CPU: peak RSS (getrusage ru_maxrss, with the peak reset
               through /proc/self/clear_refs) above the RSS before building, after malloc_trim; rough
               (allocator caching, Python objects, gloo buffers all count).
Tables are printed by rank 0; times and memory are the maximum over ranks.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import megatron_opt as mo
from bench_common import (MO_STATES, fmt_range, gloo_cpu_description, load_average, max_min_over_ranks, sync,
                          weight_decay_groups)  # scripts/bench_common.py
from peak_memory import PeakMemory  # scripts/peak_memory.py


# ---------------------------------------------------------------------------------------------- model
class Block(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, hidden: int, layers: int, ffn_mult: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, ffn_mult * hidden) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over features, mean over rows: the grad norm is well above 1, so the
    clipping at 1.0 is active in every step."""
    return (out.float() - target).square().sum(-1).mean()


# ---------------------------------------------------------------------------------------------- memory
def distinct_storage_bytes(tensors) -> int:
    """Sum of the sizes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        seen[(t.device.type, t.device.index, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------- variants
class Variant:
    name: str
    model: torch.nn.Module

    def zero_grad(self) -> None: ...
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def step(self) -> Optional[float]: ...
    def state_tensors(self) -> list[torch.Tensor]: ...
    def full_params(self) -> dict[str, torch.Tensor]: ...  # collective: fp32 masters, full size
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


MO_STATE_LABELS = {"fp32": "", "bf16": " [bf16 m,v]", "bf16+rem": " [bf16 m,v + remainders]"}


class MegatronOpt(Variant):
    def __init__(self, model, args, device, overlap: bool, state: str = "fp32", verify: int = 0) -> None:
        self.name = (("megatron_opt+overlap" if overlap else "megatron_opt") + MO_STATE_LABELS[state]
                     + (f" [verify N={verify}]" if verify else ""))
        self.bf16 = args.dtype == "bf16"
        if self.bf16:
            model.to(torch.bfloat16)
        ddp_cfg = mo.DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap, bucket_size=args.mo_overlap_bucket_size if overlap else None,
        )
        self.ddp = mo.DistributedDataParallel(model, ddp_cfg)
        opt_cfg = mo.OptimizerConfig(
            optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.beta1,
            adam_beta2=args.beta2, adam_eps=args.eps, clip_grad=args.clip_grad, bf16=self.bf16,
            use_distributed_optimizer=True, verify_interval=verify, **MO_STATES[state],
        )
        self.opt = mo.get_megatron_optimizer(opt_cfg, self.ddp)
        self.model = model
        self.in_dtype = torch.bfloat16 if self.bf16 else torch.float32

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def forward_backward(self, x, y):
        loss = loss_fn(self.ddp(x.to(self.in_dtype)), y)
        loss.backward()
        return loss.detach()

    def step(self):
        success, grad_norm, _ = self.opt.step()
        if not success:
            raise RuntimeError(f"megatron_opt skipped a step ({self.opt.last_skip_reason})")
        return grad_norm

    def state_tensors(self):
        ts = [b.param_data for b in self.ddp.buffers] + [b.grad_data for b in self.ddp.buffers]
        ts += list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        ts += list(self.opt.local_state_tensors().values())  # masters, moments, step counter
        return ts

    def full_params(self):
        """fp32 masters assembled from every rank's shards (a collective; for fp32 they alias the params)."""
        self.ddp.finish_param_sync()
        return self.opt.gather_main_params()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.ddp.finish_param_sync()
        return loss_fn(self.ddp(x.to(self.in_dtype)), y)


class DdpZero(Variant):
    name = "ddp+zero"

    def __init__(self, model, args, device) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        self.model = model
        self.ddp = TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            gradient_as_bucket_view=True)
        self.opt = ZeroRedundancyOptimizer(
            weight_decay_groups(model.named_parameters(), args.weight_decay), optimizer_class=torch.optim.AdamW,
            lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, weight_decay=args.weight_decay,
            **adamw_impl_kwargs(args),
        )
        self.clip = args.clip_grad
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                         else contextlib.nullcontext())

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, x, y):
        with self.autocast:
            out = self.ddp(x)
        loss = loss_fn(out, y)
        loss.backward()
        return loss.detach()

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return norm

    def state_tensors(self):
        ts = list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        for st in self.opt.optim.state.values():  # the local (owned-shard) AdamW
            ts += [v for v in st.values() if torch.is_tensor(v)]
        return ts

    def full_params(self):
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def eval_loss(self, x, y):
        with self.autocast:
            out = self.model(x)
        return loss_fn(out, y)


class Fsdp2(Variant):
    name = "fsdp2"

    def __init__(self, model, args, device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kw = {"mesh": mesh}
        if args.dtype == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        self.model = model
        self.opt = torch.optim.AdamW(weight_decay_groups(model.named_parameters(), args.weight_decay), lr=args.lr,
                                     betas=(args.beta1, args.beta2), eps=args.eps,
                                     weight_decay=args.weight_decay, **adamw_impl_kwargs(args))
        self.clip = args.clip_grad

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, x, y):
        loss = loss_fn(self.model(x), y)
        loss.backward()
        return loss.detach()

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return norm

    def state_tensors(self):
        ts = list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        for st in self.opt.state.values():
            ts += [v for v in st.values() if torch.is_tensor(v)]
        return ts

    def full_params(self):
        return {n: p.full_tensor().detach().float().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def eval_loss(self, x, y):
        loss = loss_fn(self.model(x), y)
        self.model.reshard()  # the root stays unsharded after a forward with no backward
        return loss


def adamw_impl_kwargs(args) -> dict:
    if args.torch_adamw == "foreach":
        return {"foreach": True}
    if args.torch_adamw == "fused":
        return {"fused": True}
    return {}


# ---------------------------------------------------------------------------------------------- driver
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
            iter=statistics.median(self.it), iter_mean=statistics.fmean(self.it), step_mean=statistics.fmean(self.st), state_bytes=state_bytes, peak_delta=self.peak_delta,
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


def print_verify_costs(rows: list[tuple[str, float, float]]) -> None:
    base_it = rows[0][1]
    print()
    print("Verify mode (OptimizerConfig.verify_interval=N) against off: mean over the timed steps, max over ranks:")
    print()
    print("| implementation | mean iteration ms | mean step ms | iteration overhead vs off |")
    print("|---|---:|---:|---:|")
    for i, (name, it, st) in enumerate(rows):
        overhead = "" if i == 0 else f"{100 * (it / base_it - 1):+.1f}%"
        print(f"| {name}{' (verify off)' if i == 0 else ''} | {it * 1e3:.1f} | {st * 1e3:.2f} | {overhead} |")


def rel_diff(a: dict, b: dict) -> float:
    """max over parameter tensors of ||a - b|| / ||b||."""
    return max(float((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(1e-30)) for n in b)


def update_rel_diff(a: dict, b: dict, init: dict) -> float:
    """||(a - init) - (b - init)|| / ||b - init|| over all params: compares the training updates."""
    num = sum(float((a[n].double() - b[n].double()).square().sum()) for n in b)
    den = sum(float((b[n].double() - init[n].double()).square().sum()) for n in b)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def device_description(device: torch.device, load_at_start: Optional[float]) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{dist.get_world_size()} (NCCL)"
    return gloo_cpu_description("" if load_at_start is None else f", 1-min load average {load_at_start:.1f} at start")


def expected_bytes_per_param(name: str, dtype: str, d: int) -> str:
    if name.startswith("megatron_opt"):
        # param + fp32 grad, then per owned element: master (none for fp32 params: it aliases the
        # param; 2 for a remainder; 4 for an fp32 copy) + the two moments (4 or 2 bytes each)
        moments = 4 if "bf16 m,v" in name else 8
        if dtype == "fp32":
            return f"8+{moments}/d = {8 + moments / d:.2f}"
        master = 2 if "remainders" in name else 4
        return f"6+{master + moments}/d = {6 + (master + moments) / d:.2f}"
    if name == "ddp+zero":  # fp32 params (autocast under bf16), grads as DDP bucket views, m+v sharded
        return f"8+8/d = {8 + 8 / d:.2f}"
    return f"16/d = {16 / d:.2f}"  # FSDP2: fp32 sharded params, grads and m+v (bf16 copies are transient)


def main() -> None:
    # megatron_opt calls reduce_scatter_tensor / all_gather_into_tensor, deprecated in torch 2.13+.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*is deprecated. Please use")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, default=None,
                   help="rows per rank per step (default 256; 16 for bf16 on CPU, where bf16 GEMMs without "
                        "AVX512-BF16/AMX are several times slower than fp32)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--torch-adamw", choices=("default", "foreach", "fused"), default="default",
                   help="implementation of torch AdamW for ZeRO and FSDP2 (default: torch's own choice)")
    p.add_argument("--mo-overlap", action="store_true",
                   help="also run megatron_opt with overlap_grad_reduce=True")
    p.add_argument("--profile-steps", type=int, default=10,
                   help="extra steps per megatron_opt variant, run under torch.profiler after the timed steps "
                        "and the numerics, for the per-phase breakdown of opt.step() (0: no breakdown)")
    p.add_argument("--mo-overlap-bucket-size", type=int, default=None,
                   help="bucket size in elements for megatron_opt+overlap (default: Megatron's, "
                        "max(40M, 1M*DP), i.e. one bucket for the default model)")
    p.add_argument("--mo-states", default="fp32",
                   help="comma-separated megatron_opt optimizer-state options to run side by side: fp32 (default), "
                        "bf16 (bf16 moments, fp32 masters), bf16+rem (bf16 moments, bf16 params + 16-bit remainders; "
                        "Megatron-LM's precision-aware optimizer)")
    p.add_argument("--mo-verify", default="",
                   help="comma-separated verify intervals N (OptimizerConfig.verify_interval): each adds a megatron_opt "
                        "variant (fp32 state, no overlap) that verifies every N-th step, e.g. 1,100")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    try:
        args.mo_verify = [int(n) for n in args.mo_verify.split(",") if n.strip()]
    except ValueError:
        p.error(f"--mo-verify: comma-separated integers, got {args.mo_verify!r}")
    if any(n < 1 for n in args.mo_verify):
        p.error("--mo-verify: every interval must be at least 1")
    args.mo_states = [s.strip() for s in args.mo_states.split(",") if s.strip()]
    unknown = [s for s in args.mo_states if s not in MO_STATES]
    if unknown or not args.mo_states:
        p.error(f"--mo-states: unknown option(s) {unknown}; choose from {', '.join(MO_STATES)}")
    if args.warmup < 1 or args.steps < 1 or args.profile_steps < 0:
        p.error("--warmup and --steps must be at least 1, --profile-steps at least 0")

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if args.tokens is None:
        args.tokens = 16 if (args.dtype == "bf16" and device.type == "cpu") else 256
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    load_at_start = load_average()

    torch.manual_seed(args.seed)
    init_model = Net(args.hidden, args.layers)
    if args.dtype == "bf16":  # every implementation starts from the same bf16-representable weights
        with torch.no_grad():
            for prm in init_model.parameters():
                prm.copy_(prm.to(torch.bfloat16).float())
    init_state = {k: v.clone() for k, v in init_model.state_dict().items()}
    numel = sum(prm.numel() for prm in init_model.parameters())
    del init_model

    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    w_teacher = torch.randn(args.hidden, args.hidden, generator=torch.Generator().manual_seed(args.seed + 99))
    w_teacher /= math.sqrt(args.hidden)

    def make_batch():
        x = torch.randn(args.tokens, args.hidden, generator=g)
        y = torch.tanh(x @ w_teacher) + 0.1 * torch.randn(args.tokens, args.hidden, generator=g)
        return x.to(device), y.to(device)

    batches = [make_batch() for _ in range(args.warmup + args.steps)]
    eval_batch = make_batch()
    profile_batches = [make_batch() for _ in range(args.profile_steps)]

    makers: list[tuple[str, Callable]] = [
        ("megatron_opt" + MO_STATE_LABELS[state], lambda m, state=state: MegatronOpt(m, args, device, overlap=False,
                                                                                   state=state))
        for state in args.mo_states]
    if args.mo_overlap:
        makers.append(("megatron_opt+overlap", lambda m: MegatronOpt(m, args, device, overlap=True)))
    makers += [(f"megatron_opt [verify N={n}]", lambda m, n=n: MegatronOpt(m, args, device, overlap=False, verify=n))
               for n in args.mo_verify]
    makers += [("ddp+zero", lambda m: DdpZero(m, args, device)), ("fsdp2", lambda m: Fsdp2(m, args, device))]

    results = run_all(makers, init_state, batches, eval_batch, profile_batches, args, device)

    init_f = {k: v.float() for k, v in init_state.items()}
    ref = results["ddp+zero"]
    rows = []
    for name, r in results.items():
        hi, lo = max_min_over_ranks([r["fb"], r["step"], r["iter"], r["state_bytes"], r["peak_delta"]], device)
        phases = max_min_over_ranks(r["phases"], device)[0] if r["phases"] else None
        rows.append((name, r, hi, lo, phases))

    verify_rows = verify_costs(results, device) if args.mo_verify else None

    def loss_diff(a: dict, b: dict) -> float:
        return float(((a["train_losses"] - b["train_losses"]).abs() / b["train_losses"].abs()).max())

    if rank == 0:
        amp = {"fp32": "fp32", "bf16": "bf16 compute, fp32 grad reduction and fp32 master weights"}[args.dtype]
        cmd = f"torchrun --standalone --nproc_per_node={world} {' '.join(sys.argv)}"
        print()
        print(f"### bench_step.py: DP={world}, {args.dtype}")
        print()
        print(f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
        print(f"- device: {device_description(device, load_at_start)}")
        print(f"- torch {torch.__version__}, Python {platform.python_version()}, backend {backend}")
        print(f"- command: `{cmd}`")
        print(f"- model: {args.layers} MLP blocks, hidden {args.hidden}, ffn {4 * args.hidden}: {numel / 1e6:.2f}M "
              f"params; {args.tokens} rows/rank/step; precision: {amp}")
        print(f"- AdamW lr {args.lr}, betas ({args.beta1}, {args.beta2}), eps {args.eps}, weight decay "
              f"{args.weight_decay} (not on biases / 1-D), clip {args.clip_grad}; torch AdamW impl: "
              f"{args.torch_adamw}; {args.warmup} warm-up + {args.steps} timed steps (round-robin), medians, "
              f"max over ranks")
        print()
        print("| implementation | fwd+bwd ms | step ms | iteration ms | model state MiB/rank | bytes/param/rank "
              "| expected bytes/param (d=DP) | peak mem delta MiB/rank | max rel param diff vs ZeRO |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r, hi, lo, _ in rows:
            peak_note = "" if r["peak_reset_ok"] else " (peak not reset)"
            print(f"| {name} | {hi[0] * 1e3:.1f} | {hi[1] * 1e3:.2f} | {hi[2] * 1e3:.1f} "
                  f"| {fmt_range(hi[3] / 2**20, lo[3] / 2**20, 2)} | {fmt_range(hi[3] / numel, lo[3] / numel, 2)} "
                  f"| {expected_bytes_per_param(name, args.dtype, world)} "
                  f"| {fmt_range(hi[4] / 2**20, lo[4] / 2**20, 1)}{peak_note} "
                  f"| {rel_diff(r['params'], ref['params']):.2e} |")
        if any(phases for *_, phases in rows):
            print()
            print(f"megatron_opt's opt.step() by phase, from torch.profiler over {args.profile_steps} extra steps "
                  f"after the timed ones (record_function ranges, CPU time total / count, ms per step, max over "
                  f"ranks; the phases run in this order; 'rest' = whole step minus the phases):")
            print()
            print("| implementation | opt.step() under profiler ms | "
                  + " | ".join(f"{label} ms" for _, label in PHASES) + " | rest ms |")
            print("|---|" + "---:|" * (len(PHASES) + 2))
            for name, _, _, _, phases in rows:
                if phases:
                    print(f"| {name} | " + " | ".join(f"{t * 1e3:.2f}" for t in phases) + " |")
        if verify_rows:
            print_verify_costs(verify_rows)
        print()
        print("Numerics after all steps (params: fp32 masters, or the fp32 params where there is no master):")
        print()
        print("| implementation | last train loss | eval loss | grad norm, last step |")
        print("|---|---:|---:|---:|")
        for name, r, _, _, _ in rows:
            print(f"| {name} | {float(r['train_losses'][-1]):.6f} | {r['eval_loss']:.6f} | {r['grad_norm']:.6f} |")
        print()
        print("| pair | max rel train-loss diff over steps | max rel param diff (per tensor) | rel update diff |")
        print("|---|---:|---:|---:|")
        names = list(results)
        for i, a_name in enumerate(names):
            for b_name in names[i + 1 :]:
                a_r, b_r = results[a_name], results[b_name]
                print(f"| {a_name} vs {b_name} | {loss_diff(a_r, b_r):.2e} | {rel_diff(a_r['params'], b_r['params']):.2e} "
                      f"| {update_rel_diff(a_r['params'], b_r['params'], init_f):.2e} |")
        print()
        print("fwd+bwd = zero_grad + forward + backward; step = megatron_opt: opt.step() (grad reduce-scatter "
              "unless overlapped, norm, clip, AdamW, param all-gather), torch: clip_grad_norm_ + optimizer.step(); "
              "iteration = wall time of zero_grad..end of step incl. the barrier before the step. Model state = distinct storages of params, grads / grad buffers and "
              "optimizer state after a step. Ranges are min–max over ranks. Param diff = max over tensors of "
              "||a-b||/||b||; update diff = ||a-b|| / ||b-init|| over all params.")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
