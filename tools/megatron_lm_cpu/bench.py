"""Megatron-LM's own pretrain_gpt.py, megatron-core's optimizer vs megatron_opt's install(): the speed a user sees.

    python tools/megatron_lm_cpu/bench.py --main MEGATRON_LM_DIR PYTHON [--configs NAME ...] [--sizes 100M 300M]
        [--pairs 2] [--iters 8] [--gpu --nproc N] [--out PATH] [--logs DIR] [--dry-run]

For each configuration (below) and model size it launches run.py under torchrun with identical arguments,
alternating megatron-core's optimizer and megatron_opt (core, mo, core, mo, ... ``--pairs`` of each), with
Megatron-LM's timers on (``--timing-log-level 2``). From each run it reads Megatron-LM's own timers per
iteration (each timer's max across ranks, as Megatron-LM prints it), takes the median over the iterations
after the first quarter, and then the median over the runs of each side. It prints, per configuration,
the timers side by side with megatron_opt / megatron-core ratios, and writes them as JSON at ``--out`` and
a markdown table beside it (``--out`` with .md; a plot with .png when matplotlib is installed).

Configurations (all with Megatron-LM's stock arguments, ``--use-distributed-optimizer``, no fused kernels
on the CPU): DP2 fp32 / bf16, each with and without ``--overlap-grad-reduce --overlap-param-gather``;
TP2 and PP2 bf16; Muon bf16 with both overlaps (megatron-core: its LayerWiseDistributedOptimizer). Data
parallelism takes the ranks tensor and pipeline parallelism leave (DP2 with 2 ranks; DP1 on one GPU).
Sizes: 100M (8 layers, hidden 1024, ffn 4096, 16 heads) and 300M (24 layers, same widths), sequence 32,
micro-batch 1, global batch 2 on the CPU; ``gpu``: 12 layers, hidden 2048, sequence 2048 (with --gpu).
Each configuration also reports the two sides' agreement (max |Δ loss| and |Δ grad norm| over the
iterations of their first runs, as compare.py measures it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (the launcher and flag sets of the correctness comparison)

TIMERS = ("iteration", "forward-backward", "forward-compute", "backward-compute", "all-grads-sync",
          "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
          "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
          "optimizer-copy-main-to-model-params", "optimizer")
TIMER_LINE = re.compile(r"^\s+([a-z0-9-]+) \.+: \(([\d.]+), ([\d.]+)\)\s*$")
STOCK = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
# The layout is what the ranks leave for data parallelism: DP = ranks / (TP x PP).
CONFIGS = {
    "adam-fp32": STOCK,
    "adam-fp32-overlap": STOCK + OVERLAP,
    "adam-bf16": STOCK + ["--bf16"],
    "adam-bf16-overlap": STOCK + OVERLAP + ["--bf16"],
    "adam-bf16-TP2": STOCK + ["--bf16", "--tensor-model-parallel-size", "2"],
    "adam-bf16-PP2": STOCK + ["--bf16", "--pipeline-model-parallel-size", "2"],
    "muon-bf16-overlap": STOCK + OVERLAP + ["--bf16", "--optimizer", "muon"],
}
WIDTHS = "--hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16".split()
SIZES = {"100M": ["--num-layers", "8"] + WIDTHS, "300M": ["--num-layers", "24"] + WIDTHS,
         # one GPU: 12 layers, hidden 2048 (~670M parameters with the embedding), sequence 2048
         "gpu": "--num-layers 12 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16".split()}
CPU_SHAPE = ("--seq-length 32 --max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 2 "
             "--vocab-size 128").split()
GPU_SHAPE = ("--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 "
             "--vocab-size 32000").split()
COMMON = ("--lr 1e-4 --log-interval 1 --eval-iters 0 --eval-interval 100000 --mock-data --tokenizer-type "
          "NullTokenizer --timing-log-level 2 --logging-level 20").split()


def parse_timers(log: str) -> dict[int, dict[str, float]]:
    """Per iteration, the elapsed time Megatron-LM logs and each timer's max across ranks (the block of
    timers Megatron-LM prints right after an iteration's log line belongs to that iteration)."""
    out: dict[int, dict[str, float]] = {}
    last = None
    with open(log, errors="replace") as f:
        for line in f:
            line = re.sub(r"^\[rank\d+\]:", "", line)
            if (m := compare.ITER_MS.search(line)):
                last = int(m.group(1))
                out.setdefault(last, {})["iteration"] = float(m.group(2))
            elif last is not None and (m := TIMER_LINE.match(line)):
                out[last][m.group(1)] = float(m.group(3))
    return out


def run_medians(timers: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each timer's median over the iterations after the first quarter (start-up and warm-up)."""
    its = sorted(timers)[max(2, len(timers) // 4):]
    return {name: statistics.median(v) for name in TIMERS
            if (v := [timers[i][name] for i in its if name in timers[i]])}


def side_medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name in TIMERS if (v := [r[name] for r in runs if name in r])}


def table(results: list[dict]) -> str:
    """One markdown row per configuration and timer: megatron_opt, megatron-core, ratio."""
    rows = ["| config | size | timer | megatron_opt ms | megatron-core ms | ratio |", "|---|---|---|---|---|---|"]
    for r in results:
        mo, core = r["megatron_opt"], r["megatron-core"]
        for name in TIMERS:
            if name in mo or name in core:
                a, b = mo.get(name), core.get(name)
                ratio = f"{a / b:.2f}" if a is not None and b else "-"
                cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
                rows.append(f"| {r['config']} | {r['size']} | {name} | {cell(a)} | {cell(b)} | {ratio} |")
        d = r.get("agreement") or {}
        if d.get("n"):
            rows.append(f"| {r['config']} | {r['size']} | max abs d loss / d grad norm ({d['n']} its) | "
                        f"{d['dloss']:.2e} | {d['dnorm']:.2e} | - |")
    return "\n".join(rows) + "\n"


def plot(results: list[dict], path: str) -> None:
    """Bars of megatron_opt / megatron-core per configuration for the headline timers (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plot")
        return
    shown = ("iteration", "all-grads-sync", "backward-compute", "optimizer")
    labels = [f"{r['config']}\n{r['size']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results)), 4.0))
    width = 0.8 / len(shown)
    for k, name in enumerate(shown):
        ratios = [r["megatron_opt"].get(name, float("nan")) / r["megatron-core"].get(name, float("nan"))
                  if r["megatron-core"].get(name) else float("nan") for r in results]
        ax.bar([i + (k - (len(shown) - 1) / 2) * width for i in range(len(results))], ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(results)), labels, fontsize=7)
    ax.set_ylabel("megatron_opt / megatron-core (median ms)")
    ax.set_title("Megatron-LM pretrain_gpt.py, Megatron-LM's own timers (lower is faster)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", nargs=2, metavar=("DIR", "PYTHON"), help="Megatron-LM's tree and its Python (required "
                   "unless --combine)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--sizes", nargs="+", default=["100M"], choices=list(SIZES))
    p.add_argument("--pairs", type=int, default=2, help="runs of each side, alternating (default 2)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--gpu", action="store_true", help="real GPUs, NCCL, the GPU sizes")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--launch-timeout", type=int, default=900)
    p.add_argument("--out", default="megatron_lm_bench.json")
    p.add_argument("--logs", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the command lines only")
    p.add_argument("--combine", nargs="+", metavar="JSON", default=None,
                   help="run nothing: the table and plot of earlier runs' --out files together, at --out")
    opts = p.parse_args()
    if opts.combine:
        results = [r for path in opts.combine for r in json.load(open(path))]
        with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
            f.write(table(results))
        plot(results, os.path.splitext(opts.out)[0] + ".png")
        return 0
    if not opts.main:
        p.error("--main DIR PYTHON is required (Megatron-LM's tree and the Python that runs it)")
    mlm_dir, python = opts.main
    logs = opts.logs or os.path.splitext(opts.out)[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    device = compare.NO_FUSED_KERNELS if opts.gpu else compare.CPU_ONLY
    results, failed = [], 0
    for size in opts.sizes:
        shape = SIZES[size] + (GPU_SHAPE if opts.gpu else CPU_SHAPE)
        for config in opts.configs:
            args = device + shape + COMMON + ["--train-iters", str(opts.iters)] + CONFIGS[config]
            per_side: dict[str, list] = {"megatron-core": [], "megatron_opt": []}
            first: dict[str, dict] = {}  # each side's first run's per-iteration records: the agreement
            for k in range(opts.pairs):
                for side in ("megatron-core", "megatron_opt"):  # alternate, so drift hits both alike
                    mo = side == "megatron_opt"
                    if opts.dry_run:
                        print(" ".join(compare.command(python, mlm_dir, mo, args, opts.nproc, opts.gpu)))
                        continue
                    log = os.path.join(logs, f"{config}_{size}_{'mo' if mo else 'core'}_{k}.log")
                    rc, seconds, records = compare.launch(python, mlm_dir, mo, args, log,
                                                          timeout=opts.launch_timeout, nproc=opts.nproc, gpu=opts.gpu)
                    timers = parse_timers(log)
                    print(f"{config} {size} {side} run {k}: rc {rc}, {seconds:.0f} s, {len(timers)} iterations",
                          flush=True)
                    if rc != 0:
                        failed += 1
                        print("   " + compare.failure(log))
                        continue
                    per_side[side].append(run_medians(timers))
                    first.setdefault(side, records)
            if opts.dry_run:
                continue
            agreement = (compare.diff(first["megatron-core"], first["megatron_opt"], range(1, opts.iters + 1))
                         if len(first) == 2 else {})
            result = {"config": config, "size": size, "runs": per_side, "agreement": agreement,
                      **{side: side_medians(runs) for side, runs in per_side.items()}}
            results.append(result)
            print(table([result]), flush=True)
            with open(opts.out, "w") as f:
                json.dump(results, f, indent=1)
    if results:
        with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
            f.write(table(results))
        plot(results, os.path.splitext(opts.out)[0] + ".png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
