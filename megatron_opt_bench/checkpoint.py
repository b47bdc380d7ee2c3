"""Side-by-side checkpoint benchmark: megatron_opt.checkpoint vs gather-to-rank-0 + torch.save vs FSDP2 + DCP.

Run (CPU/gloo only; one process per DP rank):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py [--hidden 2048 \
        --layers 8 --repeats 3 --dtype fp32|bf16 --dir /tmp --drop-page-cache]

The model is a stack of ``--layers`` Linear(hidden, hidden) layers (ReLU between them); the defaults give
33.6M params. Every implementation takes one AdamW training step first, so that the optimizer state
exists and is not all zeros, and is then checkpointed with:

  megatron_opt    megatron_opt.DistributedDataParallel(use_distributed_optimizer=True) +
                  get_megatron_optimizer (bf16: bf16 model, fp32 masters), saved with
                  megatron_opt.checkpoint.Checkpointer.save (each rank writes the model-space boxes of the optimizer
                  elements it owns; DCP writes the replicated model once, spread over the ranks) and
                  loaded with Checkpointer.load.
  gather+torch.save  the same megatron_opt model and optimizer, checkpointed the way one would without
                  megatron_opt.checkpoint: every rank's owned optimizer elements (fp32 master, exp_avg,
                  exp_avg_sq, from opt.piece_states()) are concatenated and collected on rank 0 with one
                  torch.distributed.gather (plus a gather_object of the piece layout); rank 0 assembles
                  full per-param tensors and torch.save()s them with the model's state and
                  opt.scalar_state() to one file (then flush + fsync, as DCP's writer fsyncs too). Load:
                  every rank torch.load()s the whole file and copies in the model and the elements it
                  owns (opt.load_scalar_state, opt.sync_params_from_masters). This is the baseline with
                  the same optimizer state as megatron_opt; opt.gather_main_params() is not used because it
                  is an all-gather (every rank would receive every master), which only makes the baseline
                  slower. A torch DDP + torch.optim.AdamW replica would need no gather at all, but it keeps
                  the whole optimizer state on every rank during training, which is what a distributed
                  optimizer exists to avoid.
  fsdp2+dcp       torch fully_shard on every Linear and on the root (bf16: MixedPrecisionPolicy(param_dtype=
                  bf16, reduce_dtype=fp32); the sharded params stay fp32 and are the masters) +
                  torch.optim.AdamW, saved with torch.distributed.checkpoint.save / async_save of
                  get_state_dict(model, opt) and loaded with dcp.load + set_state_dict (the fresh optimizer's
                  state is initialised before the timed load, as megatron_opt's exists from construction).

Measured per rank, with a dist.barrier() before each timed call, median over ``--repeats`` (the
implementations take turns, the order rotated every repeat, so load from other users of a shared
machine falls on all alike), max over ranks:
  save        the synchronous save call until it returns on this rank (gather+torch.save: the gather,
              torch.save, fsync, then a barrier so that no rank returns before the file exists).
  async       megatron_opt: save(async_save=True): blocking = until save() returns (the state snapshot);
              total = until wait_for_pending_save() returns, called straight away. fsdp2+dcp: dcp.async_save:
              blocking = until it returns the future; total = until future.result() returns.
  load        into a fresh model + optimizer (built once per implementation with other weights; its state
              is zeroed before every load and compared with the saved one after it, untimed).
  GB/s/rank   the bytes a rank writes (save) or reads into (load) divided by the time, for the busiest
              rank (most bytes).
  bytes       written per rank: the size of the rank's __<rank>_*.distcp files in the checkpoint folder
              (gather+torch.save: rank 0 writes the file). Optimizer state per rank: the bytes of the
              elements the rank owns (megatron_opt: fp32 master + exp_avg + exp_avg_sq from piece_states();
              FSDP2: the local shards of exp_avg + exp_avg_sq; its fp32 param shards are the masters).
  peak mem    CPU peak RSS over the call (getrusage ru_maxrss, reset through /proc/self/clear_refs, after
              gc + malloc_trim) above the RSS before it; async total covers the background write too.
              "One shard copy" is what the rank holds of the checkpointed state (megatron_opt: the whole
              model + the rank's optimizer elements; FSDP2: its param + optimizer shards; torch.load:
              the whole file).
Loads read from the page cache (the files were just written and fsynced) unless --drop-page-cache asks
the kernel to drop the checkpoint's pages (posix_fadvise DONTNEED) before each load.
Tables are printed by rank 0. Every checkpoint is written under a fresh temporary folder inside --dir
(default: the system's temp dir), which is removed at the end.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint_impls import (Fsdp2Dcp, Fsdp2Model, GatherTorchSave, Impl, MegatronCheckpoint, MegatronModel,
                               clear_dir, drop_page_cache)
from .machine import gloo_cpu_description, load_average
from .peak_memory import PeakMemory
from .ranks import fmt_range, max_min_over_ranks


# ---------------------------------------------------------------------------------------------- driver
class Record:
    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}
        self.peak: dict[str, list[float]] = {}
        self.written: Optional[int] = None
        self.matches = True

    def add(self, key: str, seconds: float, peak: Optional[int] = None) -> None:
        self.t.setdefault(key, []).append(seconds)
        if peak is not None:
            self.peak.setdefault(key, []).append(float(peak))


def timed(fn: Callable[[], object], pm: Optional[PeakMemory] = None) -> tuple[float, Optional[int], object]:
    dist.barrier()
    if pm is not None:
        pm.start()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    return t1 - t0, (pm.peak_delta() if pm is not None else None), out


def run_one(impl: Impl, rec: Record, it: int, args) -> None:
    """Sync save, load of it, async save (fresh iteration numbers; the folder is emptied before each)."""
    pm = PeakMemory()
    clear_dir(impl.root)
    t, peak, _ = timed(lambda: impl.save(it), pm)
    rec.add("save", t, peak)
    dist.barrier()
    w = impl.written_bytes(it)
    if rec.written is None:
        rec.written = w
    if isinstance(impl, GatherTorchSave):
        n = torch.tensor([w], dtype=torch.int64)
        dist.broadcast(n, 0)
        impl.last_file_bytes = int(n)
        rec.add("gather", impl.gather_times[-1])
    impl.reset_target()
    if args.drop_page_cache:
        if dist.get_rank() == 0:
            drop_page_cache(impl.folder(it))
        dist.barrier()
    t, peak, _ = timed(lambda: impl.load(it), pm)
    rec.add("load", t, peak)
    ok = torch.tensor([1 if impl.target_matches() else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    rec.matches = rec.matches and bool(ok)
    if impl.has_async:
        clear_dir(impl.root)
        dist.barrier()
        pm.start()
        t0 = time.perf_counter()
        wait = impl.save_async(it + 1)
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        rec.add("async_block", t1 - t0)
        rec.add("async_total", t2 - t0, pm.peak_delta())
    clear_dir(impl.root)


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint.*")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="model precision (bf16: megatron_opt keeps a bf16 model and fp32 masters; FSDP2 computes "
                        "in bf16 and keeps fp32 params)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the temporary checkpoint folder goes (default: system temp)")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="drop the checkpoint files' pages from the page cache before each load (cold reads)")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of megatron_opt,gather+torch.save,fsdp2+dcp")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_at_start = load_average()

    base = [tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir) if rank == 0 else None]
    dist.broadcast_object_list(base, src=0)
    base_dir = Path(base[0])
    try:
        mo_src = MegatronModel(args, args.seed, train=True)
        mo_dst = MegatronModel(args, args.seed + 7, train=False)
        impls: list[Impl] = [
            MegatronCheckpoint(mo_src, mo_dst, base_dir / "megatron_opt"),
            GatherTorchSave(mo_src, mo_dst, base_dir / "torch_save"),
            Fsdp2Dcp(Fsdp2Model(args, args.seed, train=True), Fsdp2Model(args, args.seed + 7, train=False),
                     base_dir / "fsdp2_dcp"),
        ]
        if args.only:
            wanted = set(args.only.split(","))
            impls = [i for i in impls if i.name in wanted]
        for impl in impls:
            if rank == 0:
                impl.root.mkdir(parents=True, exist_ok=True)
        records = {impl.name: Record() for impl in impls}
        for r in range(args.repeats):
            k = r % len(impls)
            for impl in impls[k:] + impls[:k]:
                run_one(impl, records[impl.name], 10 * (r + 1), args)
        numel = sum(q.numel() for q in mo_src.model.parameters())
        report(impls, records, args, numel, load_at_start)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base_dir, ignore_errors=True)
        dist.destroy_process_group()


def report(impls: list[Impl], records: dict[str, Record], args, numel: int, load_at_start: Optional[float]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    MB, MiB = 1e6, 2**20
    rows = []
    for impl in impls:
        rec = records[impl.name]
        med = {k: statistics.median(v) for k, v in rec.t.items()}
        peak = {k: max(v) for k, v in rec.peak.items()}
        keys = ["save", "load", "async_block", "async_total", "gather"]
        vals = [med.get(k, math.nan) for k in keys]
        vals += [float(rec.written), float(impl.read_bytes()), float(impl.opt_state_bytes()), float(impl.model_bytes())]
        vals += [peak.get(k, math.nan) for k in ("save", "load", "async_total")]
        sums = torch.tensor([float(rec.written), float(impl.opt_state_bytes())], dtype=torch.float64)
        dist.all_reduce(sums)
        hi, lo = max_min_over_ranks(vals)
        rows.append((impl, rec, dict(zip(keys + ["written", "read", "opt", "model", "peak_save", "peak_load",
                                                "peak_async"], zip(hi, lo))), sums.tolist()))
    if rank != 0:
        return
    prec = {"fp32": "fp32", "bf16": "bf16 model, fp32 masters and optimizer state"}[args.dtype]
    print()
    print(f"### bench_checkpoint.py: DP={world}, {args.dtype}")
    print()
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    load_at_end = load_average()
    loads = ("" if load_at_start is None else
             f", 1-min load average {load_at_start:.1f} at start, {load_at_end:.1f} at the end")
    print(f"- device: {gloo_cpu_description(loads)}")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, backend gloo")
    print(f"- command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} torchrun --standalone "
          f"--nproc_per_node={world} {' '.join(sys.argv)}`")
    print(f"- model: {args.layers} x Linear({args.hidden}, {args.hidden}): {numel / 1e6:.2f}M params; {prec}; "
          f"{args.repeats} repeats (round-robin), medians, max over ranks; loads from "
          f"{'disk (page cache dropped)' if args.drop_page_cache else 'the page cache'}")
    print()
    print("| implementation | save s | save GB/s/rank | async blocking s | async total s | blocking / save "
          "| load s | load GB/s/rank | load verified |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for impl, rec, v, _ in rows:
        save, load = v["save"][0], v["load"][0]
        wr, rd = v["written"][0], v["read"][0]
        gather = v["gather"][0]
        save_s = f"{save:.2f}" + (f" (gather {gather:.2f})" if not math.isnan(gather) else "")
        if impl.has_async:
            blk, tot = v["async_block"][0], v["async_total"][0]
            a = f"{blk:.3f} | {tot:.2f} | {100 * blk / save:.1f}%"
        else:
            a = "n/a | n/a | n/a"
        print(f"| {impl.name} | {save_s} | {wr / save / 1e9:.3f} | {a} | {load:.2f} | {rd / load / 1e9:.3f} "
              f"| {'yes' if rec.matches else 'NO'} |")
    print()
    print("| implementation | written MB/rank | written MB, all ranks | optimizer state MB/rank | optimizer state MB, "
          "whole | model MB | (optimizer state + model) / DP MB | written per rank / that |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for impl, rec, v, sums in rows:
        whole_model = v["model"][0] * (world if impl.name == "fsdp2+dcp" else 1)
        share = (sums[1] + whole_model) / world
        print(f"| {impl.name} | {fmt_range(v['written'][0] / MB, v['written'][1] / MB, 1)} | {sums[0] / MB:.1f} "
              f"| {fmt_range(v['opt'][0] / MB, v['opt'][1] / MB, 1)} | {sums[1] / MB:.1f} | {whole_model / MB:.1f} "
              f"| {share / MB:.1f} | {fmt_range(v['written'][0] / share, v['written'][1] / share, 2)} |")
    print()
    print("| implementation | load peak mem delta MiB/rank | one shard copy MiB/rank | load peak / shard copy "
          "| save peak delta MiB/rank | async save peak delta MiB/rank |")
    print("|---|---:|---:|---:|---:|---:|")
    for impl, rec, v, _ in rows:
        pl, ps, pa, rd = v["peak_load"], v["peak_save"], v["peak_async"], v["read"]
        pa_s = fmt_range(pa[0] / MiB, pa[1] / MiB, 1) if impl.has_async else "n/a"
        print(f"| {impl.name} | {fmt_range(pl[0] / MiB, pl[1] / MiB, 1)} | {fmt_range(rd[0] / MiB, rd[1] / MiB, 1)} "
              f"| {fmt_range(pl[0] / rd[0], pl[1] / rd[1], 2)} | {fmt_range(ps[0] / MiB, ps[1] / MiB, 1)} | {pa_s} |")
    mo_row = next((r for r in rows if r[0].name == "megatron_opt"), None)
    if mo_row is not None:
        _, _, v, sums = mo_row
        blk = v["async_block"][0] / v["save"][0]
        share = (sums[1] + v["model"][0]) / world
        wr_ratio = v["written"][0] / share
        pk = v["peak_load"][0] / v["read"][0]
        print()
        print(f"megatron_opt targets: async blocking / sync save = {100 * blk:.1f}% (target < 10%: "
              f"{'met' if blk < 0.10 else 'NOT met'}); written per rank (max) / ((optimizer state + model) / DP) = "
              f"{wr_ratio:.2f} (target 1/DP of the optimizer state: {'met' if wr_ratio < 1.05 else 'NOT met'}); "
              f"load peak / one shard copy = {pk:.2f} (target <= 1: {'met' if pk <= 1.0 else 'NOT met'})")
