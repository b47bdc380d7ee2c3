"""bench_optimizer_step.py's report: what is measured and its byte floor per element, the markdown
tables and the plot (docs in megatron_opt_bench.optimizer_step)."""
from __future__ import annotations

import importlib.util
import sys

FLOOR_BYTES = 34  # per element: pass 1 reads g (4); pass 2 reads g, w, m, v (16), writes w, m, v (12), bf16 p (2)
MEGATRON_BYTES = 46  # norm 4 + clip 8 + AdamW 28 + fp32 -> bf16 copy 6 (+8 for the unscale pass)
TORCH_FUSED_BYTES = 40  # norm 4 + clip 8 + AdamW 28
IMPLS = ("ours", "ours_graph", "megatron_like", "torch_fused")
LABELS = {"ours": "ours (megatron_opt)", "ours_graph": "ours, optimizer_cuda_graph", "megatron_like": "megatron-like",
          "torch_fused": "torch fused"}

# --mo-states: ours' optimizer-state options, the same names and OptimizerConfig fields as
# bench_step.py's (MO_STATES, from megatron_opt_bench.adamw).
STATE_LABELS = {"fp32": "fp32 state", "bf16": "bf16 m,v", "bf16+rem": "bf16 m,v + remainders"}
# Byte floor per owned element (bf16 params, fp32 main grads): pass 1 reads g (4), then pass 2 (docstring):
STATE_FLOOR_BYTES = {
    "fp32": 4 + (4 + 4 + 4 + 4) + (4 + 4 + 4 + 2),  # 34 = FLOOR_BYTES: g | g w m v | w m v p
    "bf16": 4 + (4 + 4 + 2 + 2) + (4 + 2 + 2 + 2),  # 26: g | g w m16 v16 | w m16 v16 p
    "bf16+rem": 4 + (4 + 2 + 2 + 2 + 2) + (2 + 2 + 2 + 2),  # 24: g | g r p16 m16 v16 | r p m16 v16
}
assert STATE_FLOOR_BYTES["fp32"] == FLOOR_BYTES


def gbs(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def markdown_table(results: list[dict]) -> str:
    head = ["elements (2^k)", "copy GB/s", "floor ms (34 B/elem)"]
    for name in IMPLS:
        head += [f"{LABELS[name]} ms", f"{LABELS[name]} GB/s", f"{LABELS[name]} / floor"]
    head += ["ours vs megatron-like", "ours vs torch fused", "graph vs megatron-like"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['n']:,} (2^{r['log2_size']}) | skipped: {r['skipped']} |" + " |" * (len(head) - 2))
            continue
        cells = [f"{r['n']:,} (2^{r['log2_size']})", gbs(r["copy_gbs"]), f"{r['floor_ms']:.3g}"]
        for name in IMPLS:
            i = r["impls"][name]
            cells += [f"{i['ms']:.3f}", gbs(i["gbs"]), f"{i['floor_ratio']:.2f}"]
        cells += [f"{r['speedup_vs_megatron_like']:.2f}x", f"{r['speedup_vs_torch_fused']:.2f}x",
                  f"{r['graph_speedup_vs_megatron_like']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def has_states(results: list[dict]) -> bool:
    return any(len(r.get("states", {})) > 1 for r in results)


def states_table(results: list[dict]) -> str:
    """One row per size and state option: 16-bit state against fp32 state at a glance."""
    head = ["elements (2^k)", "state", "floor B/elem", "floor ms", "eager ms", "eager GB/s", "eager / floor",
            "eager vs fp32", "graph ms", "graph GB/s", "graph / floor", "graph vs fp32", "floor vs fp32",
            "check vs fp32 (update)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for r in results:
        if "skipped" in r:
            continue
        check = r.get("check", {}).get("states", {})
        for state, st in r["states"].items():
            cells = [f"{r['n']:,} (2^{r['log2_size']})", st["label"], str(st["floor_bytes"]), f"{st['floor_ms']:.3g}"]
            for mode in ("eager", "graph"):
                m = st[mode]
                if "ms" not in m:
                    cells += ["skipped (config refuses)", "", "", ""]
                    continue
                speedup = f"{m['speedup_vs_fp32']:.2f}"
                cells += [f"{m['ms']:.3f}", gbs(m["gbs"]), f"{m['floor_ratio']:.2f}",
                          f"{speedup}x" + (" (slower)" if float(speedup) < 1 else "")]
            cells.append(f"{st['ideal_speedup_vs_fp32']:.2f}x")
            if state == "fp32":
                cells.append("reference" if "check" in r else "")
            elif state in check:
                c = check[state]
                cells.append(f"{'ok' if c['ok'] else 'MISMATCH'} ({c['update_rel_diff']:.1e})")
            else:
                cells.append("")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if "skipped" not in r]
    states = has_states(rows)
    if states:  # a second panel: each state option's speedup against the fp32-state step
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["n"] for r in rows]
    for name, marker in zip(IMPLS, "o^sd"):
        ax.plot(xs, [r["impls"][name]["gbs"] for r in rows], marker=marker, label=LABELS[name])
    ax.plot(xs, [r["copy_gbs"] for r in rows], linestyle="--", color="gray", label="copy bandwidth (fp32 copy_)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("shard size N (elements owned by the rank)")
    ax.set_ylabel(f"effective GB/s ({FLOOR_BYTES} B/element / step time)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Optimizer step (AdamW, bf16 params, fp32 grads, clip) on {report['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if states:
        names = [k for k in rows[0]["states"] if k != "fp32"]
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, state in enumerate(names):
            color = colors[i % len(colors)]
            label = rows[0]["states"][state]["label"]
            for mode, style in (("eager", "-"), ("graph", "--")):
                pts = [(r["n"], r["states"][state][mode].get("speedup_vs_fp32")) for r in rows]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax2.plot(*zip(*pts), marker="o", linestyle=style, color=color, label=f"{label}, {mode}")
            ax2.axhline(rows[0]["states"][state]["ideal_speedup_vs_fp32"], color=color, linestyle=":",
                        label=f"{label}: byte floor {FLOOR_BYTES}/{rows[0]['states'][state]['floor_bytes']}")
        ax2.axhline(1.0, color="gray", linewidth=1)
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("shard size N (elements owned by the rank)")
        ax2.set_ylabel("speedup vs fp32-state step (fp32 ms / option ms; > 1 is faster)")
        ax2.set_ylim(bottom=0)
        ax2.set_title("16-bit optimizer state vs fp32 state (same mode)")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("bench_optimizer_step: --plot needs matplotlib, which is not installed here "
                 "(pip install matplotlib, or drop --plot and re-plot later with --from-json PATH --plot PATH).")
