"""scripts/bench_optimizer_step.py in its CPU smoke mode (gloo, host timers, tiny sizes): it runs end to
end, its JSON holds the three implementations per size with positive finite times, and its --check
(ours' AdamW + clipping result against the Megatron-like and torch fused ones) passes, and fails when
ours' update is wrong."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_optimizer_step.py")
IMPLS = ("ours", "ours_graph", "megatron_like", "torch_fused")


def run_smoke(tmp_path, *extra):
    out = tmp_path / "step.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_OPT_OPS", None)  # a debugging override would change what "ours" runs
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--iters", "2", "--warmup", "1", "--check",
           "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def test_cpu_smoke_json_and_check(tmp_path):
    proc, out = run_smoke(tmp_path, "--log2-sizes", "12,14")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["device_type"] == "cpu" and report["torch"] and report["date"] and report["command"]
    sizes = [r["log2_size"] for r in report["results"]]
    assert sizes == [12, 14]
    for r in report["results"]:
        assert r["n"] > 0 and r["copy_gbs"] > 0 and r["floor_ms"] > 0
        assert set(r["impls"]) == set(IMPLS)
        for name in IMPLS:
            ms = r["impls"][name]["ms"]
            assert math.isfinite(ms) and ms > 0, (name, ms)
            assert all(math.isfinite(t) and t > 0 for t in r["impls"][name]["times_ms"])
        assert r["check"]["ok"], r["check"]
        for peer in ("megatron_like", "torch_fused"):
            assert r["check"][peer]["master_rel_diff"] <= 1e-5
    # the markdown table is printed last
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 15,936 (2^14) |"), proc.stdout


def test_check_catches_a_wrong_update(tmp_path):
    # ours with a 10% larger learning rate: the masters no longer match and the script exits 1
    proc, out = run_smoke(tmp_path, "--log2-sizes", "12", "--perturb-ours-lr", "1.1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--check failed" in proc.stderr
    check = json.loads(out.read_text())["results"][0]["check"]
    assert not check["ok"] and check["megatron_like"]["master_rel_diff"] > 1e-5
