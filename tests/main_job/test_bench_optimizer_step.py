"""scripts/bench_optimizer_step.py (megatron_opt_bench.optimizer_step) in its CPU smoke mode (gloo, host
timers, tiny sizes): it runs end to end, its JSON holds the three implementations per size with positive
finite times, and its --check (ours' AdamW + clipping result against the Megatron-like and torch fused
ones) passes, and fails when ours' update is wrong. With --mo-states fp32,bf16,bf16+rem the JSON holds
each optimizer-state option's eager and optimizer_cuda_graph times, byte floor and speedup vs fp32 state,
and --check compares each option's masters with the fp32-state run (and fails when a 16-bit option's
update is wrong)."""
import json
import math
import os
import subprocess
import sys

from megatron_opt_bench import optimizer_step, step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_optimizer_step.py")
IMPLS = ("ours", "ours_graph", "megatron_like", "torch_fused")
STATES = ("fp32", "bf16", "bf16+rem")
FLOOR_BYTES = {"fp32": 34, "bf16": 26, "bf16+rem": 24}


def run_smoke(tmp_path, *extra):
    out = tmp_path / "step.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_OPT_OPS", None)  # a debugging override would change what "ours" runs
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--iters", "2", "--warmup", "1", "--check",
           "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def test_cpu_smoke_json_and_check(tmp_path):
    proc, out = run_smoke(tmp_path, "--log2-sizes", "12,14", "--mo-states", ",".join(STATES))
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
        # every state option, eager and with optimizer_cuda_graph (bf16 moments have kernels: no skip)
        assert list(r["states"]) == list(STATES)
        for state in STATES:
            st = r["states"][state]
            assert st["floor_bytes"] == FLOOR_BYTES[state] and st["floor_ms"] > 0
            assert math.isclose(st["ideal_speedup_vs_fp32"], 34 / FLOOR_BYTES[state])
            for mode in ("eager", "graph"):
                m = st[mode]
                assert math.isfinite(m["ms"]) and m["ms"] > 0, (state, mode, m)
                assert all(math.isfinite(t) and t > 0 for t in m["times_ms"])
                assert math.isfinite(m["gbs"]) and m["gbs"] > 0 and m["floor_ratio"] > 0
                assert math.isfinite(m["speedup_vs_fp32"]) and m["speedup_vs_fp32"] > 0
        assert r["states"]["fp32"]["eager"]["ms"] == r["impls"]["ours"]["ms"]
        assert r["states"]["fp32"]["graph"]["ms"] == r["impls"]["ours_graph"]["ms"]
        assert r["states"]["fp32"]["eager"]["speedup_vs_fp32"] == 1.0
        # --check of each 16-bit option against the fp32-state run: it ran, and it passed
        assert set(r["check"]["states"]) == {"bf16", "bf16+rem"}
        for state, c in r["check"]["states"].items():
            assert c["ok"], (state, c)
            assert 0 < c["update_rel_diff"] <= 1e-2 and c["grad_norm_rel_diff"] <= 1e-5, (state, c)
    assert report["mo_states"] == list(STATES)
    assert {k: v["floor_bytes_per_element"] for k, v in report["state_options"].items()} == FLOOR_BYTES
    # the main table, then the state table (one row per size and option) last
    lines = proc.stdout.rstrip().splitlines()
    assert any(line.startswith("| 15,936 (2^14) | ") and "x |" in line for line in lines), proc.stdout
    assert lines[-1].startswith("| 15,936 (2^14) | bf16 m,v + remainders | 24 |"), proc.stdout
    assert lines[-1].endswith(" |") and "| ok (" in lines[-1], lines[-1]
    assert sum(line.startswith("| 4,000 (2^12) | ") for line in lines) == 1 + len(STATES)


def test_mo_states_and_floors():
    # the state options are bench_step.py's (megatron_opt_bench.adamw); each has its own byte floor
    assert optimizer_step.MO_STATES is step.MO_STATES is not None
    assert set(optimizer_step.MO_STATES) == set(optimizer_step.STATE_FLOOR_BYTES)
    assert optimizer_step.STATE_FLOOR_BYTES == FLOOR_BYTES


def test_check_catches_a_wrong_update(tmp_path):
    # ours with a 10% larger learning rate: the masters no longer match and the script exits 1
    proc, out = run_smoke(tmp_path, "--log2-sizes", "12", "--perturb-ours-lr", "1.1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--check failed" in proc.stderr
    check = json.loads(out.read_text())["results"][0]["check"]
    assert not check["ok"] and check["megatron_like"]["master_rel_diff"] > 1e-5
    # the default --mo-states fp32 prints the main table only, as before the option existed
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 4,000 (2^12) | "), proc.stdout
    assert "| state |" not in proc.stdout


def test_check_catches_a_wrong_state_update(tmp_path):
    # the bf16+rem option with a 10% larger learning rate: ours (fp32 state) still agrees with the peers,
    # the option's masters do not agree with the fp32-state run's, and the script exits 1
    proc, out = run_smoke(tmp_path, "--log2-sizes", "12", "--iters", "1", "--warmup", "0",
                          "--mo-states", "fp32,bf16+rem", "--perturb-state-lr", "1.1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--check failed" in proc.stderr
    check = json.loads(out.read_text())["results"][0]["check"]
    assert check["megatron_like"]["ok"] and check["torch_fused"]["ok"]
    assert not check["ok"] and not check["states"]["bf16+rem"]["ok"]
    assert check["states"]["bf16+rem"]["update_rel_diff"] > 1e-2
    assert "MISMATCH" in proc.stdout.rstrip().splitlines()[-1]
