"""scripts/bench_muon_layout.py (megatron_opt_bench.muon_layout): its arithmetic against a hand count on a tiny GPT
with one straddling matrix, and issue #30's bounds on the real model's layout (docs/benchmarks.md, "Muon on the
element-range layout")."""
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_opt_bench.muon_layout import PRESETS, layout_row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_muon_layout.py")
TINY = ["--models", "custom", "--layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "128", "--no-bias",
        "--rope", "--rmsnorm", "--dp", "2", "--dtypes", "bf16", "--homes", "balanced"]


def ns(rows: int, cols: int) -> int:
    s, l = min(rows, cols), max(rows, cols)
    return 5 * s * s * (2 * l + s)


def test_tiny_gpt_against_a_hand_count(tmp_path):
    out = tmp_path / "layout.json"
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--split-qkv", "no,yes", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # two rows of bytes per step, then one of memory (the QKV split changes no memory)
    assert proc.stdout.startswith("| model | params |") and proc.stdout.count("\n| custom |") == 3
    assert "| model | dtype | DP | AdamW ZeRO-1 MB/rank |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["date"] and report["command"].startswith("scripts/bench_muon_layout.py")
    unsplit, split = report["rows"]

    # Params in order: word embedding 128x64, input norm 64, linear_proj 64x64, linear_qkv 192x64, pre-MLP norm 64,
    # fc1 256x64, fc2 64x256, final norm 64: 57536 elements. Laid out in reverse, 64-aligned: final norm [0, 64),
    # fc2 [64, 16448), fc1 [16448, 32832), pre-MLP norm, qkv [32896, 45184), proj [45184, 49280), input norm,
    # embedding [49344, 57536). One bucket (40M elements), padded to a multiple of lcm(64*2, 128) = 128: 57600,
    # two shards of 28800. fc1 straddles: rank 0 owns 28800 - 16448 = 12352, rank 1 owns 32832 - 28800 = 4032.
    assert unsplit["params"] == 57536 and unsplit["buckets"] == 1 and unsplit["bucket_size"] == 40_000_000
    assert unsplit["muon_matrices"] == 4 and unsplit["straddling"] == 1
    # AdamW: each rank sends (2-1) shards of 28800 elements in the reduce-scatter (fp32 grads, 4 B) and in the
    # all-gather (bf16 params, 2 B).
    assert unsplit["adamw_bytes"] == 2 * 28800 * (4 + 2) == 345600
    # fc1's home is rank 0 (both idle when it is placed, rank 0 owns more): rank 1 sends 4032 fp32 elements
    # there and gets 4032 back.
    assert unsplit["muon_extra_bytes"] == 2 * 4032 * 4 == 32256
    assert math.isclose(unsplit["ratio"], (345600 + 32256) / 345600)
    assert math.isclose(unsplit["busiest_rank_ratio"], (172800 + 4032 * 4) / 172800)
    # Newton-Schulz: rank 0 holds fc1 and fc2 (fc2 is wholly its own), rank 1 qkv and proj (wholly its own);
    # moving fc1 to rank 1 would make rank 1 the busier.
    rank0, rank1 = 2 * ns(256, 64), ns(192, 64) + ns(64, 64)
    assert (rank0, rank1) == (23592960, 13107200)
    assert math.isclose(unsplit["ns_max_over_mean"], rank0 / ((rank0 + rank1) / 2))  # 9/7
    # Split QKV: qkv is three 64x64 problems; the homes and the bytes stay.
    assert split["split_qkv"] and split["muon_extra_bytes"] == unsplit["muon_extra_bytes"]
    rank1 = 3 * ns(64, 64) + ns(64, 64)
    assert math.isclose(split["ns_max_over_mean"], rank0 / ((rank0 + rank1) / 2))  # 1.2

    # Optimizer memory per rank, bf16 params. AdamW ZeRO-1: an fp32 master and two fp32 moments over each whole
    # 28800-element shard. Muon: a master per owned element, the momentum (fp32; bf16 precision-aware) on the
    # matrices, AdamW's moments on the rest. Rank 0 owns final norm 64, fc2 16384, fc1 12352 (no padding);
    # rank 1 owns fc1 4032, pre-MLP norm 64, qkv 12288, proj 4096, input norm 64, embedding 8192 (64 padding).
    assert unsplit["adamw_state_bytes"] == 28800 * (4 + 8) == 345600
    rank0, rank1 = 64 * 12 + (16384 + 12352) * 8, (4032 + 12288 + 4096) * 8 + (64 + 64 + 8192) * 12
    assert unsplit["muon_state_bytes"] == max(rank0, rank1) == 263168
    assert unsplit["muon_bf16_momentum_state_bytes"] == (4032 + 12288 + 4096) * 6 + (64 + 64 + 8192) * 12 == 222336


@pytest.mark.parametrize("split_qkv", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_issue_bounds_on_a_24_layer_gpt_at_dp8(dtype, split_qkv):
    # 24 layers of 50,358,272 (2 norms, proj, qkv, fc1, fc2 with biases), word and position embeddings (tied
    # output), the final norm; megatron_opt's layout.
    row = layout_row("gpt", PRESETS["gpt"], dtype, 8, split_qkv)
    assert row.params == 24 * 50_358_272 + 50304 * 2048 + 2048 * 2048 + 2 * 2048
    assert row.muon_matrices == 97 and row.straddling == 72
    assert row.ratio <= 1.25 and row.ns_max_over_mean <= 1.25, row
    # memory: one master per element and one momentum (not two moments) on the 91% that are Muon matrices
    assert row.muon_state_bytes < 0.7 * row.adamw_state_bytes, row


def test_bad_arguments_name_the_problem():
    proc = subprocess.run([sys.executable, SCRIPT, "--dp", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dp sizes must be >= 2" in proc.stderr
