"""Megatron-Bridge's own pretrain() on CPU: megatron-core's optimizer vs megatron_opt, per iteration.

    python tools/megatron_bridge_cpu/compare.py --python BRIDGE_VENV/bin/python [--cases ...] [--iters 6]
        [--logs DIR] [--summary PATH] [--launch-timeout S]

BRIDGE_VENV is made by tools/megatron_bridge_cpu/setup.sh. Each case launches run.py under torchrun with 2
ranks twice, once with megatron-core's optimizer and DDP and once with the one line (megatron_opt's), and
compares the iterations Bridge trains: max |Δ loss|, max |Δ grad norm| (absolute and relative to
megatron-core's), the zero count, the loss scale and skipped iterations, and which optimizer and DDP classes
Bridge's setup built. Cases:

  DP2, TP2, PP2     Adam, the distributed optimizer with both overlaps (TP2: tensor parallel 2; PP2: pipeline 2)
  DP2-late          megatron_opt's run with the one line after Bridge's imports (against DP2's megatron-core run)
  DP2-muon          Bridge's distributed_muon_with_cosine_annealing, fp32 Newton-Schulz: megatron_opt's sharded
                    Muon ('dist_muon') against megatron-core's non-distributed Muon ('muon'; see MATRIX)
  DP2-recipe-ddp    the DistributedDataParallelConfig of Bridge's GPT-3 175B pretrain recipe
  resume            from DP2's torch_dist checkpoint of iteration 3 (saved by both DP2 runs) to the end, loaded
                    by megatron_opt: its own (mo->mo, must be bitwise) and megatron-core's (core->mo); against
                    the uninterrupted DP2 run of the optimizer that saved it

Bounds (``ok`` per case): every run exits 0 and logs every iteration; |Δ loss| <= 1e-6 and relative |Δ grad
norm| <= 1e-6 (fp32: a few ulps of the summation order; measured about 1e-7); equal loss scale, no skipped
iteration; zero counts within 2 + 2% (the attention key bias's gradient is zero in exact arithmetic, so each
element is 0.0 or a rounding residue depending on the order of sums); mo->mo resume bitwise. The exit status
is 1 if a run failed or a case is out of bounds. --summary writes every case's numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "megatron_lm_cpu"))
import compare as megatron_lm_compare  # noqa: E402  (its launcher: one torchrun run with its log)
LOSS_TOL = 1e-6
NORM_RTOL = 1e-6
# case: (megatron-core's run, megatron_opt's run). Muon: megatron_opt shards it ('dist_muon', the distributed
# optimizer with both overlaps); megatron-core's reference is its non-distributed Muon, because its layer-wise
# 'dist_muon' fails at start-up in fp32 here (KeyError in DistributedOptimizer._build_optimizer_group_ranges
# for its fp32 child), as Megatron-LM's does (docs/megatron.md, "Muon").
MATRIX = {"DP2": ([], []), "TP2": (["--tp", "2"],) * 2, "PP2": (["--pp", "2"],) * 2,
          "DP2-muon": (["--optimizer", "muon"], ["--optimizer", "dist_muon"]),
          "DP2-recipe-ddp": (["--recipe-ddp"],) * 2}
CASES = ["DP2", "TP2", "PP2", "DP2-late", "DP2-muon", "DP2-recipe-ddp", "resume"]


def launch(python: str, args: list[str], log: str, timeout: int) -> tuple[object, float, dict[int, dict]]:
    """One torchrun launch of run.py with 2 ranks; returns (rc, seconds, {iteration: record})."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "run.py")] + args
    # megatron_opt from this checkout (the Bridge venv does not install it)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    rc, seconds = megatron_lm_compare.run_logged(cmd, log, timeout, PYTHONPATH=path)
    return rc, seconds, parse(log)


def parse(log: str) -> dict[int, dict]:
    """run.py's ``PRECISE {json}`` lines, by iteration."""
    records = {}
    with open(log, errors="replace") as f:
        for line in f:
            line = re.sub(r"^\[rank\d+\]:", "", line)
            if line.startswith("PRECISE "):
                rec = json.loads(line[len("PRECISE "):])
                records[rec["iteration"]] = rec
    return records


def failure(log: str) -> str:
    """The first exception line of a failed run's log."""
    with open(log, errors="replace") as f:
        for line in f:
            line = re.sub(r"^\[rank\d+\]: ", "", line.rstrip())
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line) and "ChildFailedError" not in line \
                    and "FP8GlobalStateManager" not in line:  # Bridge's optional TE import, logged and ignored
                return line[:300]
    return "no exception line found"


def compare(core: dict[int, dict], mo: dict[int, dict], iterations: list[int], reference: str = "megatron.core.",
            bitwise: bool = False) -> dict:
    """The differences over the iterations, and whether they are within the bounds. ``core`` is the reference
    run, built by classes of the package ``reference`` (megatron_opt's own for the mo->mo resume)."""
    missing = [i for i in iterations if i not in core or i not in mo]
    out: dict = {"iterations": iterations, "missing": missing}
    if missing:
        return out | {"ok": False}

    def loss(record: dict) -> float:
        return record["losses"]["lm loss"]

    out |= {
        "dloss": max(abs(loss(mo[i]) - loss(core[i])) for i in iterations),
        "dnorm": max(abs(mo[i]["grad_norm"] - core[i]["grad_norm"]) for i in iterations),
        "dnorm_rel": max(abs(mo[i]["grad_norm"] - core[i]["grad_norm"]) / abs(core[i]["grad_norm"])
                         for i in iterations),
        "zeros": [(i, core[i]["num_zeros"], mo[i]["num_zeros"]) for i in iterations],
        "loss_scale_same": all(mo[i]["loss_scale"] == core[i]["loss_scale"] for i in iterations),
        "skipped": sum(mo[i]["skipped"] + core[i]["skipped"] for i in iterations),
        "core_classes": sorted({(r["optimizer_module"], r["ddp_module"]) for r in core.values()}),
        "mo_classes": sorted({(r["optimizer_module"], r["ddp_module"]) for r in mo.values()}),
    }
    zeros_ok = all(abs(m - c) <= 2 + 0.02 * c for _, c, m in out["zeros"])
    def built_by(classes: list, package: str) -> bool:
        return all(o.startswith(package) and d.startswith(package) for o, d in classes)

    classes_ok = built_by(out["core_classes"], reference) and built_by(out["mo_classes"], "megatron_opt.")
    if bitwise:
        within = out["dloss"] == 0 and out["dnorm"] == 0
    else:
        within = out["dloss"] <= LOSS_TOL and out["dnorm_rel"] <= NORM_RTOL
    out["ok"] = within and out["loss_scale_same"] and not out["skipped"] and zeros_ok and classes_ok
    return out


def row(label: str, d: dict) -> str:
    if d.get("missing"):
        return f"{label:<26} OUT OF BOUNDS: iterations missing {d['missing']}"
    zeros = ", ".join(f"{c:g}/{m:g}" for _, c, m in d["zeros"])
    classes = "; ".join(f"{o.split('.')[0]} optimizer + {dd.split('.')[0]} DDP" for o, dd in d["mo_classes"])
    return (f"{label:<26} {'ok' if d['ok'] else 'OUT OF BOUNDS'}  its {d['iterations'][0]}-{d['iterations'][-1]}  "
            f"max|Δloss| {d['dloss']:.2e}  max|Δgnorm| {d['dnorm']:.2e} (rel {d['dnorm_rel']:.2e})  "
            f"loss scale {'equal' if d['loss_scale_same'] else 'DIFFER'}  skipped {d['skipped']}  "
            f"zeros core/mo {zeros}  [{classes}]")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=os.environ.get("MEGATRON_BRIDGE_PYTHON", "/work/venv-bridge/bin/python"),
                   help="the Bridge venv's interpreter (setup.sh); default $MEGATRON_BRIDGE_PYTHON")
    p.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    p.add_argument("--iters", type=int, default=6, help="training iterations (the resume case loads iteration 3)")
    p.add_argument("--logs", help="folder for the run logs and checkpoints (default: a temporary folder)")
    p.add_argument("--summary", metavar="PATH", help="JSON of every case's numbers")
    p.add_argument("--launch-timeout", type=int, default=400, help="seconds per torchrun launch")
    opts = p.parse_args()
    logs = opts.logs or tempfile.mkdtemp(prefix="megatron_bridge_cpu.")
    os.makedirs(logs, exist_ok=True)
    base = ["--iters", str(opts.iters)]
    cases, report, failed = {}, [], False

    def run(name: str, args: list[str]) -> dict[int, dict]:
        nonlocal failed
        log = os.path.join(logs, name + ".log")
        rc, secs, recs = launch(opts.python, base + args, log, opts.launch_timeout)
        status = "ok" if rc == 0 else f"FAILED rc={rc}: {failure(log)}"
        print(f"  {name:<24} {secs:5.1f}s  {len(recs)} its  {status}  ({log})", flush=True)
        failed |= rc != 0
        return recs

    def checkpoint(tag: str) -> list[str]:
        path = os.path.join(logs, f"ckpt.{tag}")
        shutil.rmtree(path, ignore_errors=True)
        return ["--save", path, "--save-interval", "3"]

    all_its = list(range(1, opts.iters + 1))
    runs: dict[str, dict] = {}
    want_dp2 = {"DP2", "DP2-late", "resume"} & set(opts.cases)
    for name, (core_args, mo_args) in MATRIX.items():
        if name not in opts.cases and not (name == "DP2" and want_dp2):
            continue
        save = name == "DP2" and "resume" in opts.cases  # DP2's runs save the resume case's checkpoints
        runs[name + ".core"] = run(name + ".core", core_args + (checkpoint("core") if save else []))
        runs[name + ".mo"] = run(name + ".mo", ["--megatron-opt"] + mo_args + (checkpoint("mo") if save else []))
        cases[name] = compare(runs[name + ".core"], runs[name + ".mo"], all_its)
    if "DP2-late" in opts.cases:
        late = run("DP2-late.mo", ["--megatron-opt", "--install-late"])
        cases["DP2-late"] = compare(runs["DP2.core"], late, all_its)
    if "resume" in opts.cases:
        resumed_its = list(range(4, opts.iters + 1))
        for tag, reference in (("mo", "DP2.mo"), ("core", "DP2.core")):
            resumed = run(f"resume.{tag}-to-mo", ["--megatron-opt", "--load", os.path.join(logs, f"ckpt.{tag}"),
                                                  "--ckpt-step", "3"])
            # megatron_opt resuming from its own checkpoint: bitwise against its uninterrupted run
            cases[f"resume {tag}->mo"] = compare(runs[reference], resumed, resumed_its, bitwise=tag == "mo",
                                                 reference="megatron_opt." if tag == "mo" else "megatron.core.")
    for name, d in cases.items():
        report.append(row(name, d))
    if opts.summary:
        with open(opts.summary, "w") as f:
            json.dump({"iters": opts.iters, "cases": cases, "failed_launch": failed}, f, indent=1)
    print(f"\nfp32, {opts.iters} iterations, 2 ranks, logs in {logs}")
    print("\n".join(report))
    out_of_bounds = [n for n, d in cases.items() if not d.get("ok")]
    if out_of_bounds:
        print("out of bounds: " + ", ".join(out_of_bounds))
    return 1 if failed or out_of_bounds else 0


if __name__ == "__main__":
    sys.exit(main())
