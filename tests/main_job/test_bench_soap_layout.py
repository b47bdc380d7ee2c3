"""scripts/bench_soap_layout.py (megatron_opt_bench.matrix_state_layout): SOAP's per-matrix state bytes against a
hand count, LayerWise's rule, the homes' freedom to leave the owners, and issue 39's bounds (item 3) on the
24-layer, hidden-2048 GPT at DP 8 (docs/benchmarks.md, "SOAP's per-matrix state on the element-range layout")."""
import json
import os
import subprocess
import sys

from megatron_opt.optimizer.whole_tensor.homes import MatrixPlacement, assign_homes
from megatron_opt_bench.gpt_params import GptParam
from megatron_opt_bench.matrix_state_layout import layer_wise_ranks, matrix_state_bytes, soap_layout_row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_soap_layout.py")


def test_per_matrix_state_bytes_by_hand():
    # L, Q_L: 6144^2 each; R, Q_R: 2048^2 each; exp_avg, exp_avg_sq: 6144 x 2048 each; fp32
    assert matrix_state_bytes((6144, 2048)) == 4 * (2 * 6144 ** 2 + 2 * 2048 ** 2 + 2 * 6144 * 2048)


def test_layer_wise_is_greedy_lpt_on_numel():
    params = [GptParam("a", (10, 10)), GptParam("b", (30,)), GptParam("c", (7, 10)), GptParam("d", (40,))]
    # largest first, to the least loaded: a (100) -> 0, c (70) -> 1, d (40) -> 1 (110), b (30) -> 0 (130)
    assert layer_wise_ranks(params, 2) == [0, 0, 1, 1]


def test_homes_anywhere_may_leave_the_owners():
    # two matrices wholly on rank 0: owners only, both homed there; anywhere, the second goes to rank 1
    placements = [MatrixPlacement((4, 4), (16, 0)), MatrixPlacement((4, 4), (16, 0))]
    assert assign_homes(placements, 2) == [0, 0]
    assert sorted(assign_homes(placements, 2, anywhere=True)) == [0, 1]


def test_issue_39_bounds_at_dp8_and_the_script_runs(tmp_path):
    for model in ("gpt", "swiglu"):
        row = soap_layout_row(model, "bf16", 8)
        assert row.mo_state_max_over_mean <= 1.25 and row.mo_total_max_over_mean <= 1.25, row
        assert row.refresh_max_over_mean <= 1.25, row
        assert row.mo_total_max_gb < row.replicated_gb / 4  # once per data-parallel group, not per rank
        assert 1.0 < row.ratio <= 1.25, row  # the exchange on top of AdamW's ZeRO-1 bytes
    out = tmp_path / "soap.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--models", "gpt", "--dp", "8", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("| model | dtype | DP |") and proc.stdout.count("\n| gpt | bf16 | 8 |") == 1
    report = json.loads(out.read_text())
    assert report["command"].startswith("scripts/bench_soap_layout.py") and len(report["rows"]) == 1
