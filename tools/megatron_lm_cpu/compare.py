"""Megatron-LM's own pretrain_gpt.py on CPU: megatron-core's optimizer vs megatron_opt, per iteration.

    python tools/megatron_lm_cpu/compare.py [--v0161 DIR PYTHON] [--main DIR PYTHON] [--versions v0161 main]
        [--layouts DP2 TP2 PP2] [--fp32] [--no-resume] [--logs DIR]
        [--gpu] [--nproc N] [--iters N] [--model ARGS] [--launch-timeout S] [--summary PATH]

DP2-muon and TP2-muon (Megatron-LM main only; TP2-muon adds ``--tensor-model-parallel-size 2 --muon-tp-mode
duplicated``; --extra comes after a layout's flags, so it overrides them) train ``--optimizer muon
--muon-fp32-matmul-prec high`` with the same flags: megatron-core's LayerWiseDistributedOptimizer (in fp32 its
non-distributed Muon: main d98e8a64's LayerWise fails at start-up in fp32) against megatron_opt's sharded
Muon.

For each Megatron-LM version (a source tree with megatron/, pretrain_gpt.py, gpt_builders.py and
model_provider.py, and an interpreter with
torch and megatron_opt installed) and each 2-rank layout, it launches run.py under torchrun twice with
the same arguments (megatron-core's DistributedOptimizer, then megatron_opt through install()) and
compares the iterations: max |Δ lm loss|, max |Δ grad norm| (full precision, from run.py's
--precise-log line; the log line's rounded values are parsed as well and must agree), the zero count
(--log-num-zeros-in-grad) and the loss scale. The resume check trains DP2 (``--resume-layout``: DP2-soap,
DP2-adaptive_muon, DP2-muon for that optimizer) to iteration 3 with --save (torch_dist), resumes with --load to
the end, and compares the resumed iterations with an uninterrupted run that saves at the same iteration; it also
loads megatron-core's checkpoint with megatron_opt (cross; for the matrix optimizers megatron-core's
LayerWise checkpoint may be refused by name, reported as REFUSED). Needs nothing from this repository at run
time but run.py and cpu_shim.py.
Logs go to --logs (a temporary folder by default); the exit status is 1 if a run failed.

--gpu runs the same pairs on real GPUs (run.py --gpu: no CPU shim, NCCL, the flags without gloo;
--nproc ranks, one per GPU). --summary writes, per version and layout, both runs'
per-iteration loss and grad norm, their differences, and the speed Megatron-LM logs (median over the
iterations after the first quarter: iteration ms, TFLOP/s/GPU, tokens/s from the global batch and
sequence length, the ``optimizer`` timer's max across ranks; with --gpu the peak allocated memory), as
JSON at PATH and a markdown table beside it (PATH with .md). scripts/gpu_session.sh uses both.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ITERS = 6
NPROC = 2
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 128").split()
# No Transformer Engine, apex or Megatron-LM's fused CUDA kernels (none on the CPU; none installed on the
# GPU machine either: masked-softmax and gradient-accumulation fusion would import them); CPU: gloo.
NO_FUSED_KERNELS = ("--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
                    "--no-masked-softmax-fusion").split()
CPU_ONLY = ["--distributed-backend", "gloo"] + NO_FUSED_KERNELS
UNDER_TEST = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --log-num-zeros-in-grad".split()
LAYOUTS = {"DP2": [], "TP2": ["--tensor-model-parallel-size", "2"], "PP2": ["--pipeline-model-parallel-size", "2"]}
# Muon (Megatron-LM main only: core_v0.16.1's validate_args refuses Muon with UNDER_TEST's flags). fp32 matmuls
# in Newton-Schulz ('high' is fp32 on the CPU) so that the two runs differ by rounding order only.
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]
MUON_LAYOUTS = {"DP2-muon": MUON,
               "TP2-muon": MUON + ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"],
               # the rest of the whole-tensor family (issue 39): megatron-core's as Muon's (LayerWise / in fp32 its
               # non-distributed optimizer) against megatron_opt's sharded rule
               "DP2-adaptive_muon": ["--optimizer", "adaptive_muon", "--muon-fp32-matmul-prec", "high"],
               "TP2-adaptive_muon": ["--optimizer", "adaptive_muon", "--muon-fp32-matmul-prec", "high",
                                     "--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"],
               "PP2-adaptive_muon": ["--optimizer", "adaptive_muon", "--muon-fp32-matmul-prec", "high",
                                     "--pipeline-model-parallel-size", "2"],
               "DP2-soap": ["--optimizer", "soap"],
               "TP2-soap": ["--optimizer", "soap", "--tensor-model-parallel-size", "2"],
               "PP2-soap": ["--optimizer", "soap", "--pipeline-model-parallel-size", "2"]}
# megatron-core's reference for a Muon run: its LayerWiseDistributedOptimizer with UNDER_TEST's flags, except in
# fp32, where Megatron-LM main d98e8a64's LayerWise chain fails at start-up (ChainedOptimizer asserts one config for
# LayerWise and its fp32 DistributedOptimizer child): there the reference is its non-distributed Muon.
NOT_IN_FP32_MUON_REFERENCE = ("--use-distributed-optimizer", "--overlap-param-gather")
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+.\dEe]+) \| loss scale: ([-+.\dEe]+) \| "
                      r"grad norm: ([-+.\dEe]+) \|(?: num zeros: ([-+.\dEe]+) \|)?")
ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                     r"(?: throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|)?")
OPTIMIZER_TIMER = re.compile(r"^\s+optimizer \.+: (?:\(([\d.]+), )?([\d.]+)\)?\s*$")


def command(python: str, mlm_dir: str, megatron_opt: bool, args: list[str], nproc: int = NPROC,
            gpu: bool = False) -> list[str]:
    """The torchrun command line of one run.py launch."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "run.py"), mlm_dir, "--precise-log"] + (["--megatron-opt"] if megatron_opt else [])
    return cmd + (["--gpu"] if gpu else []) + ["--"] + args


def launch(python: str, mlm_dir: str, megatron_opt: bool, args: list[str], log: str, timeout: int = 240,
           nproc: int = NPROC, gpu: bool = False):
    """One torchrun launch of run.py; returns (rc, seconds, {iteration: record})."""
    cmd = command(python, mlm_dir, megatron_opt, args, nproc, gpu)
    rc, seconds = run_logged(cmd, log, timeout)
    return rc, seconds, parse(log)


def run_logged(cmd: list[str], log: str, timeout: int, **env: str) -> tuple[object, float]:
    """Run a torchrun command line with its output in ``log`` (the command on the first line), one intra-op
    thread per rank and ``env`` added to the environment; returns (rc or "timeout", seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1", **env)
    start = time.time()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        # its own process group: a timeout ends torchrun's workers too (on a GPU they would keep its memory)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return rc, time.time() - start


def parse(log: str) -> dict[int, dict]:
    """Per iteration: the precise record, the log line's (rounded) values and the speed it logs (iteration
    ms, TFLOP/s/GPU; the ``optimizer`` timer printed after it, its max across ranks)."""
    records: dict[int, dict] = {}
    last = None
    with open(log, errors="replace") as f:
        for line in f:
            line = re.sub(r"^\[rank\d+\]:", "", line)
            if line.startswith("PRECISE "):
                rec = json.loads(line[len("PRECISE "):])
                records.setdefault(rec["iteration"], {}).update(
                    loss=rec["losses"].get("lm loss"), grad_norm=rec["grad_norm"], num_zeros=rec["num_zeros"],
                    loss_scale=rec["loss_scale"], skipped=rec["skipped"])
                if "max_allocated_mib" in rec:
                    records[rec["iteration"]]["max_allocated_mib"] = rec["max_allocated_mib"]
                continue
            if (m := LOG_LINE.search(line)):
                last = int(m.group(1))
                records.setdefault(last, {})["line"] = tuple(
                    None if g is None else float(g) for g in m.groups()[1:])
            if (m := ITER_MS.search(line)):
                last = int(m.group(1))
                records.setdefault(last, {})["iter_ms"] = float(m.group(2))
                if m.group(3) is not None:
                    records[last]["tflops"] = float(m.group(3))
            elif last is not None and (m := OPTIMIZER_TIMER.match(line)):
                records[last]["optimizer_ms"] = float(m.group(2))
    return records


def speed(recs: dict[int, dict], tokens_per_iter: int) -> dict:
    """Medians over the iterations after the first quarter (start-up, allocator and NCCL warm-up)."""
    import statistics
    its = sorted(recs)[len(recs) // 4:]

    def median(key):
        values = [recs[i][key] for i in its if recs[i].get(key) is not None]
        return statistics.median(values) if values else None
    out = {"iterations": len(recs), "median_over": len(its), "iter_ms": median("iter_ms"),
           "tflops_per_gpu": median("tflops"), "optimizer_ms": median("optimizer_ms"),
           "max_allocated_mib": max((r["max_allocated_mib"] for r in recs.values() if "max_allocated_mib" in r),
                                    default=None)}
    out["tokens_per_s"] = None if not out["iter_ms"] else tokens_per_iter / (out["iter_ms"] / 1e3)
    return out


def write_summary(path: str, pairs: list[dict]) -> None:
    """--summary: JSON at path, a markdown table at path's stem + .md."""
    with open(path, "w") as f:
        json.dump(pairs, f, indent=1)
    head = ("| run | optimizer | its | iter ms | tokens/s | TFLOP/s/GPU | optimizer ms | peak MiB | "
            "max abs d loss | max abs d grad norm |\n|" + "---|" * 10)
    rows = [head]
    for pair in pairs:
        d = pair["diff"]
        for name in ("megatron-core", "megatron_opt"):
            s = pair[name]["speed"]
            cell = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
            rows.append(f"| {pair['run']} | {name} | {s['iterations']} | {cell(s['iter_ms'], '.1f')} | "
                        f"{cell(s['tokens_per_s'], '.0f')} | {cell(s['tflops_per_gpu'], '.1f')} | "
                        f"{cell(s['optimizer_ms'], '.2f')} | {cell(s['max_allocated_mib'], '.0f')} | "
                        f"{cell(d.get('dloss'), '.2e')} | {cell(d.get('dnorm'), '.2e')} |")
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write("\n".join(rows) + "\n")


def failure(log: str) -> str:
    """The first exception line of a failed run's log, for the table."""
    with open(log, errors="replace") as f:
        lines = [re.sub(r"^\[rank\d+\]: ", "", line.rstrip()) for line in f]
    for line in lines:
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line) and "ChildFailedError" not in line:
            return line[:300]
    return "no exception line found"


def diff(a: dict[int, dict], b: dict[int, dict], iterations) -> dict:
    """max |Δ| of loss and grad norm over iterations, zero-count / loss-scale / log-line agreement."""
    iterations = [i for i in iterations if i in a and i in b and "loss" in a[i] and "loss" in b[i]]
    if not iterations:
        return {"n": 0}
    out = {"n": len(iterations),
           "dloss": max(abs(a[i]["loss"] - b[i]["loss"]) for i in iterations),
           "dnorm": max(abs(a[i]["grad_norm"] - b[i]["grad_norm"]) for i in iterations),
           "zeros_differ": [(i, a[i]["num_zeros"], b[i]["num_zeros"]) for i in iterations
                            if a[i]["num_zeros"] != b[i]["num_zeros"]],
           "scale_same": all(a[i]["loss_scale"] == b[i]["loss_scale"] for i in iterations),
           "skipped": sum(a[i]["skipped"] + b[i]["skipped"] for i in iterations),
           "lines_same": all(a[i].get("line", (0,))[:3] == b[i].get("line", (1,))[:3] for i in iterations)
           if 1 in iterations else None}
    return out


def row(label: str, d: dict, iterations) -> str:
    if not d.get("n"):
        return f"{label:<34} no common iterations"
    zeros = "all equal" if not d["zeros_differ"] else "differ at " + ", ".join(
        f"it{i}: {x:g} vs {y:g}" for i, x, y in d["zeros_differ"])
    return (f"{label:<34} {d['n']}/{len(iterations)} its  max|Δloss| {d['dloss']:.2e}  max|Δgnorm| {d['dnorm']:.2e}  "
            f"log lines {({True: 'equal', False: 'DIFFER', None: 'n/a'})[d['lines_same']]}  "
            f"loss scale {'equal' if d['scale_same'] else 'DIFFER'}"
            f"  skipped {d['skipped']}  zeros: {zeros}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--v0161", nargs=2, metavar=("DIR", "PYTHON"),
                   default=["/work/mlm/v0161", "/work/main/.venv/bin/python"])
    p.add_argument("--main", nargs=2, metavar=("DIR", "PYTHON"),
                   default=["/work/mlm/main", "/work/main/.venv312/bin/python"])
    p.add_argument("--versions", nargs="+", default=["v0161", "main"], choices=["v0161", "main"])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS) + list(MUON_LAYOUTS),
                   choices=list(LAYOUTS) + list(MUON_LAYOUTS),
                   help="DP2-muon: --optimizer muon (Megatron-LM main only; skipped for v0161)")
    p.add_argument("--fp32", action="store_true", help="train in fp32 (default: --bf16)")
    p.add_argument("--no-resume", action="store_true", help="skip the checkpoint resume check")
    p.add_argument("--no-matrix", action="store_true", help="only the resume check")
    p.add_argument("--resume-layout", default="DP2", choices=["DP2", "DP2-muon", "DP2-adaptive_muon", "DP2-soap"],
                   help="the layout (and optimizer) of the resume check (default DP2: Adam)")
    p.add_argument("--extra", default="", help="more pretrain_gpt.py arguments for every run (one string)")
    p.add_argument("--logs", help="folder for the run logs and checkpoints (default: a temporary folder)")
    p.add_argument("--gpu", action="store_true", help="real GPUs: run.py --gpu, NCCL (no --distributed-backend gloo)")
    p.add_argument("--nproc", type=int, default=NPROC, help=f"ranks (default {NPROC}; one GPU each with --gpu)")
    p.add_argument("--iters", type=int, default=ITERS, help=f"training iterations (default {ITERS}; the resume "
                   "check saves at 3)")
    p.add_argument("--model", default=" ".join(MODEL), help="the model and batch arguments (one string; default: "
                   "the small CPU model)")
    p.add_argument("--launch-timeout", type=int, default=240, help="seconds per torchrun launch")
    p.add_argument("--summary", metavar="PATH", help="JSON (and PATH.md) of each pair's curves and speed")
    p.add_argument("--print-only", action="store_true", help="print each launch's command line, run nothing")
    opts = p.parse_args()
    logs = opts.logs or tempfile.mkdtemp(prefix="megatron_lm_cpu.")
    os.makedirs(logs, exist_ok=True)
    iters = opts.iters
    model = opts.model.split()
    device_args = NO_FUSED_KERNELS if opts.gpu else CPU_ONLY
    common = model + ["--train-iters", str(iters)] + device_args + UNDER_TEST + ([] if opts.fp32 else ["--bf16"])
    tokens_per_iter = int(model[model.index("--global-batch-size") + 1]) * int(model[model.index("--seq-length") + 1])
    all_its = range(1, iters + 1)
    pairs = []
    report, failed = [], False

    def run(version, name, megatron_opt, args, refusal_ok=False):
        """``refusal_ok``: a CheckpointError (a load refused by name) is reported, not counted as a failure."""
        nonlocal failed
        mlm_dir, python = getattr(opts, version)
        log = os.path.join(logs, f"{version}.{name.replace(' ', '.')}.{'mo' if megatron_opt else 'mcore'}.log")
        if opts.print_only:
            print(" ".join(command(python, mlm_dir, megatron_opt, args, opts.nproc, opts.gpu)))
            return {}
        rc, secs, recs = launch(python, mlm_dir, megatron_opt, args, log, opts.launch_timeout, opts.nproc, opts.gpu)
        refused = rc != 0 and refusal_ok and "CheckpointError" in failure(log)
        status = "ok" if rc == 0 else (f"REFUSED: {failure(log)}" if refused else f"FAILED rc={rc}: {failure(log)}")
        print(f"  {version:<6} {name:<18} {'megatron_opt' if megatron_opt else 'megatron-core':<13} {secs:5.1f}s  "
              f"{len(recs)} its  {status}  ({log})", flush=True)
        failed |= rc != 0 and not refused
        return recs

    save = ["--ckpt-format", "torch_dist", "--save-interval", "3"]
    for version in opts.versions:
        refs = {}
        for layout in [] if opts.no_matrix else opts.layouts:
            muon = layout in MUON_LAYOUTS
            if muon and version != "main":
                report.append(f"{version} {layout:<29} skipped: Megatron-LM core_v0.16.1 refuses Muon with "
                              f"{' '.join(UNDER_TEST[:3])} (Muon through install() needs Megatron-LM main)")
                continue
            # the layout's flags, then --extra's (last, so that --extra "--muon-tp-mode blockwise" overrides)
            args = common + (MUON_LAYOUTS[layout] if muon else LAYOUTS[layout]) + opts.extra.split()
            recs = {}
            for megatron_opt in (False, True):
                extra = []
                if layout == opts.resume_layout and not opts.no_resume:  # doubles as the resume check's reference
                    ref_ckpt = os.path.join(logs, f"{version}.ckpt_ref.{'mo' if megatron_opt else 'mcore'}")
                    shutil.rmtree(ref_ckpt, ignore_errors=True)
                    extra = save + ["--save", ref_ckpt]
                run_args = args
                if muon and opts.fp32 and not megatron_opt:
                    run_args = [a for a in args if a not in NOT_IN_FP32_MUON_REFERENCE]
                recs[megatron_opt] = run(version, layout, megatron_opt, run_args + extra)
            if layout == opts.resume_layout:
                refs = recs
            d = diff(recs[False], recs[True], all_its)
            report.append(row(f"{version} {layout} mcore vs megatron_opt", d, all_its))
            pairs.append({"run": f"{version} {layout}", "nproc": opts.nproc, "gpu": opts.gpu, "args": args,
                          "diff": {k: v for k, v in d.items() if k != "zeros_differ"} | {
                              "zeros_differ": len(d.get("zeros_differ", []))},
                          **{name: {"speed": speed(recs[mo], tokens_per_iter),
                                    "curve": {i: {"loss": r.get("loss"), "grad_norm": r.get("grad_norm")}
                                              for i, r in sorted(recs[mo].items())}}
                             for name, mo in (("megatron-core", False), ("megatron_opt", True))}})
        if opts.no_resume:
            continue
        resumed_its = range(4, iters + 1)
        rl = opts.resume_layout
        if rl in MUON_LAYOUTS and version != "main":
            report.append(f"{version} resume check with {rl} skipped: Muon and its family need Megatron-LM main")
            continue
        rargs = common + (MUON_LAYOUTS.get(rl) or LAYOUTS[rl]) + opts.extra.split()
        for megatron_opt in (False, True):
            tag = "mo" if megatron_opt else "mcore"
            if megatron_opt not in refs:
                ref_ckpt = os.path.join(logs, f"{version}.ckpt_ref.{tag}")
                shutil.rmtree(ref_ckpt, ignore_errors=True)
                refs[megatron_opt] = run(version, rl, megatron_opt, rargs + save + ["--save", ref_ckpt])
            ckpt = os.path.join(logs, f"{version}.ckpt.{tag}")
            shutil.rmtree(ckpt, ignore_errors=True)
            run(version, f"{rl} to-3", megatron_opt, rargs + save + ["--save", ckpt, "--exit-interval", "3"])
            res = run(version, f"{rl} resumed", megatron_opt, rargs + save + ["--save", ckpt, "--load", ckpt])
            report.append(row(f"{version} {rl} resume {tag} vs uninterr.", diff(refs[megatron_opt], res, resumed_its),
                              resumed_its))
            if megatron_opt:
                continue
            # megatron-core's checkpoint of iteration 3, loaded by megatron_opt; against megatron-core's run (a
            # checkpoint of another optimizer's format may be refused by name instead: reported, not a failure)
            saved = os.path.join(ckpt, "iter_0000003")
            if not os.path.isdir(saved) and not opts.print_only:
                report.append(f"{version} {rl} mcore ckpt -> megatron_opt: megatron-core saved no checkpoint "
                              f"({failure(os.path.join(logs, f'{version}.{rl}.to-3.mcore.log'))})")
                continue
            cross_ckpt = os.path.join(logs, f"{version}.ckpt_cross")
            shutil.rmtree(cross_ckpt, ignore_errors=True)
            os.makedirs(cross_ckpt)
            shutil.copytree(saved, os.path.join(cross_ckpt, "iter_0000003"))
            with open(os.path.join(cross_ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("3")
            cross = run(version, f"{rl} cross-resumed", True,
                        rargs + save + ["--save", cross_ckpt, "--load", cross_ckpt], refusal_ok=rl != "DP2")
            report.append(row(f"{version} {rl} mcore ckpt -> megatron_opt", diff(refs[False], cross, resumed_its),
                              resumed_its))

    if opts.summary:
        write_summary(opts.summary, pairs)
    print(f"\n{'bf16' if not opts.fp32 else 'fp32'}, {iters} iterations, extra {opts.extra.split()}, logs in {logs}")
    print("\n".join(report))
    print("log lines: the log line's rounded lm loss / loss scale / grad norm; n/a after a resume (the first "
          "logged iteration's loss is averaged into the next line)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
