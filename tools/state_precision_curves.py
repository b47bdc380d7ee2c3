"""Loss curves of scripts/pretrain_gpt.py with fp32 optimizer state and with precision-aware state.

    python tools/state_precision_curves.py --steps 300 --nproc 2 \
        --json docs/state_precision_curves.json --plot docs/state_precision_curves.png

Runs the main job once per state option, same seed, same data, same bf16 model, under torchrun
(CPU/gloo without a GPU), each writing pretrain_gpt.py's --log-json; then prints the final losses
(mean over the last ``--tail`` iterations) and their relative difference as markdown, and writes
both curves to ``--json`` and, with matplotlib installed, a plot to ``--plot``. Arguments after
``--`` go to pretrain_gpt.py.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from megatron_opt_bench.machine import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = {
    "fp32 state": [],
    "bf16 moments + remainders": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                                  "--exp-avg-sq-dtype", "bf16"],
}


def run(option: str, steps: int, nproc: int, extra: list[str], log: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "scripts", "pretrain_gpt.py"), "--train-iters", str(steps), "--bf16",
           "--use-distributed-optimizer", "--log-interval", str(max(1, steps // 10)), "--log-json", log,
           *OPTIONS[option], *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, env=env)
    with open(log) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tail", type=int, default=20, help="final loss = mean over this many last iterations")
    p.add_argument("--json", default=None, help="write both curves here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib); leave out --plot to get the numbers only")
    curves = {}
    optimizer = extra[extra.index("--optimizer") + 1] if "--optimizer" in extra[:-1] else "adam"
    with tempfile.TemporaryDirectory() as tmp:
        for i, option in enumerate(OPTIONS):
            # param remainders are AdamW's only (Muon and SOAP keep fp32 masters): say so in the label
            label = option if optimizer == "adam" or "remainders" not in option else "bf16 moments"
            curves[label] = run(option, args.steps, args.nproc, extra, os.path.join(tmp, f"{i}.jsonl"))
    final = {o: sum(r["lm loss"] for r in c[-args.tail:]) / len(c[-args.tail:]) for o, c in curves.items()}
    (base_label, base), (other_label, other) = final.items()
    rel = abs(other - base) / base
    cmd = " ".join([os.path.basename(sys.executable), *sys.argv])
    print(f"\n### state_precision_curves.py: {optimizer}, {args.steps} iterations, DP={args.nproc}, bf16 model\n")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    print(f"- device: {cpu_model()}, {os.cpu_count()} cores, gloo")
    print(f"- command: `{cmd}`\n")
    print("| optimizer state | first loss | final loss (mean of last %d) | skipped |" % args.tail)
    print("|---|---:|---:|---:|")
    for option, c in curves.items():
        print(f"| {option} | {c[0]['lm loss']:.4f} | {final[option]:.4f} | {c[-1]['skipped_iterations']} |")
    print(f"\nfinal loss, {other_label} vs {base_label}: {rel * 100:.3f}% apart (target: within 1%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"optimizer": optimizer, "steps": args.steps, "nproc": args.nproc, "final": final,
                       "relative_difference": rel,
                       "curves": {o: [r["lm loss"] for r in c] for o, c in curves.items()}}, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for option, c in curves.items():
            ax.plot([r["iteration"] for r in c], [r["lm loss"] for r in c], label=option, linewidth=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.set_title(f"pretrain_gpt.py --optimizer {optimizer}, bf16 model, DP={args.nproc}: final losses "
                     f"{rel * 100:.2f}% apart")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
