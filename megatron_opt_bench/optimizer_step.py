"""Benchmark the optimizer step alone on one device: megatron_opt vs a Megatron-like sequence vs torch fused.

For each shard size N (elements owned by the rank, ``--log2-sizes``), all three implementations update
the same params (the same shapes, the same initial bf16 weights, the same fp32 gradients) with the same
AdamW hyperparameters, weight-decay groups (megatron_opt's own rule for all three: none on biases and 1-D
params) and global-norm clipping:

  ours            megatron_opt's real ``optimizer.step()``: a stack of bf16 ``Linear(cols, rows)`` layers
                  plus a few 1-D params (RMSNorm weights, biases), ``--num-tensors`` params in all,
                  wrapped in ``megatron_opt.DistributedDataParallel(use_distributed_optimizer=True,
                  grad_reduce_in_fp32=True)``, optimizer from ``get_megatron_optimizer`` (AdamW, bf16=True,
                  clip_grad), in a one-process group (NCCL on CUDA, gloo on CPU). Pass 1 (found-inf + norm),
                  one host read, pass 2 (clip + AdamW + bf16 write-back).
  megatron-like   the separate passes Megatron-LM runs for bf16 params with fp32 main grads, from PyTorch ops
                  over the same param-sized tensors: ``_amp_foreach_non_finite_check_and_unscale_`` + the
                  host read of found_inf (``--megatron-unscale``, on by default; Megatron runs it only with a
                  loss scaler, its bf16 default has none), ``_foreach_norm`` + the norm reduce, clip with
                  ``_foreach_mul_`` (always, as with TE's tensor coefficient), ``torch._fused_adamw_`` per
                  param group on separate fp32 masters with fp32 moments, then a per-tensor ``copy_`` of
                  each master into its bf16 param (a view into one flat bf16 buffer).
  torch fused     ``clip_grad_norm_(params, clip, foreach=True)`` + ``torch.optim.AdamW(fused=True).step()`` on
                  fp32 params with fp32 grads: no masters, no bf16 copy.

Timing: the gradients are refilled from the same saved fp32 tensor before every step, outside the timed
region (ours: ``zero_grad_buffer()`` + ``add_grad()`` per param, the public way to deliver gradients, which
the step contract requires once per step; the others: one copy, since their clip scales the grads in
place). Then ``torch.cuda.synchronize()``, CUDA events recorded right around the step call (host timers
on CPU); ``--warmup`` steps, then the median of ``--iters``. Host overhead inside the step counts.

Byte floor: 34 B per element (pass 1 reads the fp32 grad: 4; pass 2 reads grad, master, exp_avg,
exp_avg_sq: 16, writes master, exp_avg, exp_avg_sq: 12 and the bf16 param: 2). floor = 34 * N / copy BW,
with the copy bandwidth measured in the same run (fp32 ``dst.copy_(src)`` of max(N, ``--copy-min-mib``)
bytes, read + write counted). Every implementation's effective GB/s and step/floor ratio use the same
34 B/element, also torch fused, which moves different bytes (it writes no bf16 param but its clip
rewrites the grads); Megatron-like moves 46 B/element (+8 with the unscale pass).

``--check``: after timing each size, fresh copies of the three take two steps on the same data (the
second with a different, larger gradient, so that clipping shows in AdamW's result); ours' fp32 masters
(``gather_main_params()``), its grad norms and its bf16 params are compared with the Megatron-like and
torch fused results; a mismatch makes the script exit 1.

``--mo-states fp32,bf16,bf16+rem``: ours' optimizer-state options (Megatron-LM's precision-aware
optimizer fields; the same names and ``OptimizerConfig`` fields as ``scripts/bench_step.py --mo-states``):

  fp32       fp32 masters, fp32 exp_avg and exp_avg_sq (the default; this is "ours" above).
  bf16       use_precision_aware_optimizer, bf16 exp_avg and exp_avg_sq, fp32 masters
             (store_param_remainders=False).
  bf16+rem   use_precision_aware_optimizer, bf16 moments, store_param_remainders: a bf16 param's fp32
             master is the bf16 param plus an int16 remainder (Megatron-LM's bf16 setting).

fp32 is always run (it is the baseline; listed first whether named or not). Each option's step is timed
in the same run on the same shard and data, eagerly and with ``optimizer_cuda_graph`` (a config that
refuses the graph, a moment pair without CUDA kernels, is reported as skipped with the config's
message). Per option: ms, effective GB/s and ms / floor against the option's own byte floor, and the
speedup ``fp32-state ms / option ms`` (eager against eager, graph against graph; > 1 is faster). Byte
floor per owned element with bf16 params and fp32 main grads (docs/kernels.md section 4; "p16 in" is
the bf16 param a remainder master reads to rebuild the fp32 master):

  fp32       pass 1 g 4; pass 2 reads g 4 + w 4 + m 4 + v 4 = 16, writes w 4 + m 4 + v 4 + p 2 = 14: 34 B
  bf16       pass 1 g 4; pass 2 reads g 4 + w 4 + m 2 + v 2 = 12, writes w 4 + m 2 + v 2 + p 2 = 10: 26 B
  bf16+rem   pass 1 g 4; pass 2 reads g 4 + r 2 + p16 in 2 + m 2 + v 2 = 12,
             writes r 2 + p 2 + m 2 + v 2 = 8: 24 B

so at the floor the 16-bit options are 34/26 = 1.31x and 34/24 = 1.42x faster than fp32 state. On CPU
the precision-aware step runs torch's fused loop on widened fp32 copies (docs/usage.md), so it moves
more bytes than its floor there and may well be slower than fp32 state: the table reports what it
measures. With ``--check`` each option also takes the two check steps, and its masters
(``gather_main_params()``: exact fp32 masters, also with remainders) are compared with the fp32-state
run's: the grad norms within 1e-5 (pass 1 reads the same fp32 grads), and per tensor the two-step
update ``||(w_opt - w0) - (w_fp32 - w0)|| / ||w_fp32 - w0||`` within 1e-2 (bf16 moments keep 8
significant bits: each stored moment is off by at most 2^-9 relative, so the second step's update by
about 2^-9 + 2^-10 per element, ~1e-3 in norm; a 10% wrong learning rate gives 1e-1), and its bf16
params must be its own masters rounded to bf16 (at most 1e-3 of them differ: ties round away from zero
with remainders, to even otherwise).

Usage (GPU; build the CUDA extension first, e.g. ``pip install -e . --no-build-isolation``):
    python3 scripts/bench_optimizer_step.py --check --json step.json --plot step.png
(on an H100 the default sizes 2^22..2^28 take about 20 s with --check, after a ~1 min build; peak GPU
memory about 34 B * N, 9 GiB at 2^28; a size that does not fit in the free memory is skipped.)
16-bit state against fp32 state (GPU; one table row per size and option, the plot gains a speedup panel):
    python3 scripts/bench_optimizer_step.py --check --mo-states fp32,bf16,bf16+rem --json states.json --plot states.png
CPU smoke test (gloo, host timers, a few seconds):
    python scripts/bench_optimizer_step.py --device cpu --log2-sizes 12,14 --iters 2 --warmup 1 --check
    python scripts/bench_optimizer_step.py --device cpu --log2-sizes 12,14 --iters 3 --check \\
        --mo-states fp32,bf16,bf16+rem
Re-plot from a saved JSON (no benchmark): --from-json step.json --plot step.png
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist

import megatron_opt as mo

from .adamw import MO_STATES, add_adamw_arguments
from .optimizer_step_check import TOL_STATE_UPDATE, run_check
from .optimizer_step_impls import Data, MegatronLike, Ours, Spec, TorchFused, fits, free_memory
from .optimizer_step_report import (FLOOR_BYTES, LABELS, MEGATRON_BYTES, STATE_FLOOR_BYTES, STATE_LABELS,
                                    TORCH_FUSED_BYTES, has_states, markdown_table, plot, require_matplotlib,
                                    states_table)
from .timing import copy_bandwidth, time_calls


# ---------------------------------------------------------------------------------------------- driver
def time_peer(impl, data: Data, args, device: torch.device) -> list[float]:
    return time_calls(impl.step, device, args.warmup, args.iters, prepare=lambda: impl.set_grads(source=data))


def bench_size(log2: int, args, device: torch.device, copy_cache: dict) -> Optional[dict]:
    spec = Spec.for_size(2**log2, args.num_tensors)
    n = spec.numel
    # data (2 + 4 B) + the largest implementation (ours and megatron-like: 2 + 4 + 4 + 4 + 4 B), the copy
    # test, and for --check a second gradient and ours' kept masters and params (4 + 4 + 2 B)
    need = (6 + 18 + (10 if args.check else 0)) * n + 64 * 2**20
    ok, why = fits(need, device)
    if not ok:
        print(f"skip 2^{log2}: {why}", file=sys.stderr, flush=True)
        return {"log2_size": log2, "n": n, "skipped": why}
    copy_numel = max(n, args.copy_min_mib * 2**20 // 4)
    if copy_numel not in copy_cache:
        ok, why = fits(8 * copy_numel, device)
        if not ok:
            copy_numel = n
        copy_cache[copy_numel] = (copy_bandwidth(copy_numel, device, args.warmup, max(args.iters, 5)), copy_numel)
    copy_gbs, copy_n = copy_cache[copy_numel]
    data = Data(spec, device, args.seed + log2)
    row = {"log2_size": log2, "n": n, "num_params": len(data.shapes),
           "spec": {"rows": spec.rows, "cols": spec.cols, "linear_weights": spec.weights, "biases": spec.biases,
                    "norms": spec.norms},
           "copy_gbs": copy_gbs, "copy_elements": copy_n,
           "floor_ms": FLOOR_BYTES * n / (copy_gbs * 1e9) * 1e3, "impls": {}}

    def record(name: str, times: list[float]) -> None:
        ms = statistics.median(times)
        row["impls"][name] = {"ms": ms, "min_ms": min(times), "times_ms": times,
                              "gbs": FLOOR_BYTES * n / (ms * 1e-3) / 1e9, "floor_ratio": ms / row["floor_ms"]}
        print(f"  2^{log2} {LABELS[name]:<20} {ms:9.3f} ms", file=sys.stderr, flush=True)

    row["states"] = {}
    for state in args.mo_states:  # fp32 first: "ours" and "ours_graph"; then each 16-bit state option
        floor_b = STATE_FLOOR_BYTES[state]
        st = row["states"][state] = {"label": STATE_LABELS[state], "floor_bytes": floor_b,
                                     "floor_ms": floor_b * n / (copy_gbs * 1e9) * 1e3,
                                     "ideal_speedup_vs_fp32": FLOOR_BYTES / floor_b}
        for mode, graph in (("eager", False), ("graph", True)):
            try:
                ours = Ours(data, args, device, cuda_graph=graph, state=state)
            except mo.UnsupportedConfigError as e:  # optimizer_cuda_graph for a moment pair without kernels
                st[mode] = {"skipped": str(e)}
                print(f"  2^{log2} {STATE_LABELS[state]}, {mode}: skipped ({e})", file=sys.stderr, flush=True)
                continue
            if state == "fp32" and not graph:
                row["ours_backend"] = ours.backend()
            times = time_calls(ours.step, device, args.warmup, args.iters, prepare=ours.set_grads)
            if graph and not bool(ours.opt.skipped_steps == 0):
                raise RuntimeError(f"optimizer_cuda_graph skipped a step ({state} state)")
            del ours
            free_memory(device)
            ms = statistics.median(times)
            st[mode] = {"ms": ms, "min_ms": min(times), "times_ms": times, "gbs": floor_b * n / (ms * 1e-3) / 1e9,
                        "floor_ratio": ms / st["floor_ms"]}
            if state == "fp32":
                record("ours_graph" if graph else "ours", times)
            else:
                print(f"  2^{log2} {STATE_LABELS[state] + (', graph' if graph else ''):<20} {ms:9.3f} ms",
                      file=sys.stderr, flush=True)
    for state, st in row["states"].items():  # against the fp32-state step of the same mode
        for mode in ("eager", "graph"):
            base = row["states"]["fp32"][mode]
            if "ms" in st[mode] and "ms" in base:
                st[mode]["speedup_vs_fp32"] = base["ms"] / st[mode]["ms"]
    for cls in (MegatronLike, TorchFused):  # each allocated only for its own measurement
        record(cls.name, time_peer(cls(data, args, device), data, args, device))
        free_memory(device)
    ours_ms = row["impls"]["ours"]["ms"]
    row["speedup_vs_megatron_like"] = row["impls"]["megatron_like"]["ms"] / ours_ms
    row["speedup_vs_torch_fused"] = row["impls"]["torch_fused"]["ms"] / ours_ms
    graph_ms = row["impls"]["ours_graph"]["ms"]
    row["graph_speedup_vs_megatron_like"] = row["impls"]["megatron_like"]["ms"] / graph_ms
    if args.check:
        row["check"] = run_check(data, args, device)
        c = row["check"]
        print(f"  2^{log2} check {'ok' if c['ok'] else 'MISMATCH'}: " + "; ".join(
            f"{k}: master {c[k]['master_rel_diff']:.1e}, update {c[k]['update_rel_diff']:.1e}, "
            f"norm {c[k]['grad_norm_rel_diff']:.1e}, bf16 mismatch {c[k]['bf16_param_mismatch_fraction']:.1e}"
            for k in ("megatron_like", "torch_fused")), file=sys.stderr, flush=True)
        for state, e in c["states"].items():
            print(f"  2^{log2} check {STATE_LABELS[state]} vs fp32 state {'ok' if e['ok'] else 'MISMATCH'}: "
                  f"update {e['update_rel_diff']:.1e} (tol {TOL_STATE_UPDATE:g}), master {e['master_rel_diff']:.1e}, "
                  f"norm {e['grad_norm_rel_diff']:.1e}, bf16 vs own masters {e['bf16_param_mismatch_fraction']:.1e}",
                  file=sys.stderr, flush=True)
    del data
    free_memory(device, collect=True)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if available, else cpu (gloo, host timers: a smoke test, not a benchmark)")
    ap.add_argument("--log2-sizes", default="22,24,26,28", help="comma-separated log2 shard sizes (elements)")
    ap.add_argument("--num-tensors", type=int, default=256, help="params (tensors) per size, all implementations")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    add_adamw_arguments(ap)
    ap.add_argument("--megatron-unscale", action=argparse.BooleanOptionalAction, default=True,
                    help="megatron-like runs the unscale + found_inf pass and its host read (Megatron does so "
                         "with a loss scaler; its bf16 default has none: --no-megatron-unscale)")
    ap.add_argument("--copy-min-mib", type=int, default=None,
                    help="smallest copy for the bandwidth test (default 256 MiB on CUDA, 4 MiB on CPU)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true",
                    help="compare ours' two-step result with megatron-like and torch fused; exit 1 on mismatch")
    ap.add_argument("--allow-no-ext", action="store_true",
                    help="on CUDA, run ours even when megatron_opt's CUDA extension is not built (torch reference)")
    ap.add_argument("--json", metavar="PATH", help="write every number, the device, versions, date and command")
    ap.add_argument("--plot", metavar="PATH", help="PNG: effective GB/s against shard size (needs matplotlib)")
    ap.add_argument("--from-json", metavar="PATH", help="only re-plot (--plot) / re-print a saved --json file")
    ap.add_argument("--mo-states", default="fp32",
                    help="comma-separated optimizer-state options of ours, timed side by side (names as in "
                         "scripts/bench_step.py): fp32 (default; always run, the baseline), bf16 (bf16 moments, "
                         "fp32 masters), bf16+rem (bf16 moments, bf16 params + int16 remainders; Megatron-LM's "
                         "precision-aware optimizer). With more than fp32 a second table (and plot panel) shows "
                         "each option's ms, GB/s and ms / floor against its own byte floor and its speedup vs fp32 "
                         "state; --check also compares each option's masters with the fp32-state run")
    ap.add_argument("--perturb-ours-lr", type=float, default=1.0, help=argparse.SUPPRESS)  # tests of --check
    ap.add_argument("--perturb-state-lr", type=float, default=1.0, help=argparse.SUPPRESS)  # the 16-bit options
    args = ap.parse_args(argv)
    states = [x.strip() for x in args.mo_states.split(",") if x.strip()]
    unknown = [x for x in states if x not in MO_STATES]
    if unknown:
        ap.error(f"--mo-states: unknown option(s) {unknown}; choose from {', '.join(MO_STATES)}")
    args.mo_states = ["fp32"] + [x for x in dict.fromkeys(states) if x != "fp32"]
    if args.num_tensors < 2:
        ap.error("--num-tensors must be at least 2")
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        if args.plot:
            plot(report, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        print(markdown_table(report["results"]))
        if has_states(report["results"]):
            print()
            print(states_table(report["results"]))
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_optimizer_step: --device cuda but no CUDA device is visible")
        if not mo.ops.HAS_CUDA_EXT and not args.allow_no_ext:
            sys.exit("bench_optimizer_step: megatron_opt's CUDA extension is not built "
                     f"({mo.ops.CUDA_EXT_ERROR}); build it first (`pip install -e . --no-build-isolation`, "
                     "see docs/kernels.md) or pass --allow-no-ext to time the torch reference instead.")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        device_name = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(1)  # a smoke test: one thread is steady on a shared machine (no OpenMP spinning)
        device_name = f"CPU ({platform.processor() or platform.machine()}, 1 thread)"
    if args.copy_min_mib is None:
        args.copy_min_mib = 256 if device.type == "cuda" else 4
    sizes = [int(x) for x in args.log2_sizes.split(",") if x.strip()]

    tmpdir = tempfile.mkdtemp(prefix="bench_optimizer_step_")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmpdir, 'pg')}", rank=0, world_size=1)
    try:
        print(f"# optimizer step on {device_name}, torch {torch.__version__}"
              + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else "")
              + f"; {args.num_tensors} params per size; median of {args.iters} steps after {args.warmup} warm-up"
              + ("" if device.type == "cuda" else " (CPU smoke mode: host timers, not a benchmark)"), flush=True)
        copy_cache: dict = {}
        results = []
        for log2 in sizes:
            results.append(bench_size(log2, args, device, copy_cache))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmpdir, ignore_errors=True)

    backends = sorted({r["ours_backend"] for r in results if "ours_backend" in r})
    report = {
        "device": device_name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "ours_backend": ",".join(backends),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable] + sys.argv),
        "args": vars(args),
        "floor_bytes_per_element": FLOOR_BYTES,
        "mo_states": args.mo_states,
        "state_options": {k: {"config": {f: str(v) if isinstance(v, torch.dtype) else v
                                         for f, v in MO_STATES[k].items()},
                              "label": STATE_LABELS[k], "floor_bytes_per_element": STATE_FLOOR_BYTES[k]}
                          for k in args.mo_states},
        "bytes_per_element_moved": {"ours": FLOOR_BYTES,
                                    "megatron_like": MEGATRON_BYTES + (8 if args.megatron_unscale else 0),
                                    "torch_fused": TORCH_FUSED_BYTES},
        "timing": "CUDA events around optimizer.step() after torch.cuda.synchronize()" if device.type == "cuda"
                  else "time.perf_counter around the step",
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    failed = [r["log2_size"] for r in results if "check" in r and not r["check"]["ok"]]
    print()
    print(f"ours: megatron_opt ({report['ours_backend']}); megatron-like: unscale "
          f"{'on' if args.megatron_unscale else 'off'} ({report['bytes_per_element_moved']['megatron_like']} B/elem); "
          f"torch fused: clip_grad_norm_(foreach) + AdamW(fused) on fp32 params (40 B/elem). GB/s and '/ floor' use "
          f"{FLOOR_BYTES} B/elem for all three; floor = {FLOOR_BYTES} B * N / copy GB/s; 'ours vs X' = X ms / ours ms."
          + (f" --check: {'MISMATCH at 2^' + ', 2^'.join(map(str, failed)) if failed else 'ours agrees with both'}."
             if args.check else ""))
    print()
    print(markdown_table(results))
    if has_states(results):
        print()
        print("optimizer state (ours): " + "; ".join(
            f"{STATE_LABELS[k]} floor {STATE_FLOOR_BYTES[k]} B/elem" for k in args.mo_states)
              + ". GB/s and '/ floor' use each option's own floor; 'vs fp32' = fp32-state ms / option ms in the "
                "same mode (> 1: faster); 'floor vs fp32' = 34 B / the option's floor, the speedup if both ran "
                "at their floor."
              + (" CPU: the precision-aware step widens to fp32 copies, so bytes do not bound it here."
                 if device.type == "cpu" else "")
              + (f" --check: masters after two steps vs the fp32-state run, update within {TOL_STATE_UPDATE:g} "
                 "per tensor." if args.check else ""))
        print()
        print(states_table(results))
    if failed:
        print(f"bench_optimizer_step: --check failed at sizes 2^{failed}: ours' step does not match "
              f"the reference implementations or a state option does not match the fp32-state run "
              f"(see the check lines above and the JSON)", file=sys.stderr)
        return 1
    return 0
