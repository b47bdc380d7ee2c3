"""Side-by-side step benchmark: megatron_opt vs torch DDP + ZeroRedundancyOptimizer vs FSDP2.

Run (CPU/gloo, or one GPU per rank with NCCL when CUDA is available):

    torchrun --standalone --nproc_per_node=2 scripts/bench_step.py [--hidden 256 --layers 6 \
        --tokens 256 --steps 30 --warmup 5 --profile-steps 10 --dtype fp32|bf16 \
        --torch-adamw default|foreach|fused]

All implementations train the same model (a stack of pre-norm MLP blocks made of Linear layers), from
the same initial weights, on the same per-rank batches, with the same AdamW hyperparameters, the same
weight-decay groups (megatron_opt's own rule for every implementation: none on biases and 1-D params,
Megatron's default) and global-norm clipping at ``--clip-grad``:

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
import datetime
import math
import os
import platform
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .adamw import MO_STATES, add_adamw_arguments
from .machine import gloo_cpu_description, load_average
from .ranks import fmt_range, max_min_over_ranks
from .step_runner import PHASES, run_all, verify_costs
from .step_variants import MO_STATE_LABELS, DdpZero, Fsdp2, MegatronOpt, Net


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
    add_adamw_arguments(p)
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
                   help="comma-separated verify intervals N (OptimizerConfig.verify_interval): each adds a "
                        "megatron_opt variant (fp32 state, no overlap) that verifies every N-th step, e.g. 1,100")
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
                print(f"| {a_name} vs {b_name} | {loss_diff(a_r, b_r):.2e} "
                      f"| {rel_diff(a_r['params'], b_r['params']):.2e} "
                      f"| {update_rel_diff(a_r['params'], b_r['params'], init_f):.2e} |")
        print()
        print("fwd+bwd = zero_grad + forward + backward; step = megatron_opt: opt.step() (grad reduce-scatter "
              "unless overlapped, norm, clip, AdamW, param all-gather), torch: clip_grad_norm_ + optimizer.step(); "
              "iteration = wall time of zero_grad..end of step incl. the barrier before the step. "
              "Model state = distinct storages of params, grads / grad buffers and "
              "optimizer state after a step. Ranges are min–max over ranks. Param diff = max over tensors of "
              "||a-b||/||b||; update diff = ||a-b|| / ||b-init|| over all params.")
    dist.barrier()
    dist.destroy_process_group()
