"""The main job's --save/--load: a run cut in two and resumed in fresh processes ends bit-exact with
the straight run, at DP 1, 2 and 3, in fp32, bf16 and fp16, with sync and async saves; a resume at
another DP size continues and says so."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

import megatron_opt.checkpoint as ckpt
from tests.main_job.main_job_script import ENV, ROOT, SCRIPT, TORCHRUN

SMALL = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--micro-batch-size", "2",
         "--warmup-steps", "2", "--use-distributed-optimizer"]


def _pretrain(world: int, *args: str) -> str:
    cmd = [*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *SMALL, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _steps(log_json) -> dict[int, dict]:
    """--log-json's records by iteration, without the run-dependent num_tokens-free fields kept: exact values."""
    return {r["iteration"]: r for r in map(json.loads, log_json.read_text().splitlines())}


@pytest.mark.parametrize("world, precision, save_mode",
                         [(2, "fp32", "sync"), (3, "bf16", "async"), (1, "fp16", "sync")])
def test_pretrain_resume_is_bit_exact(tmp_path, world, precision, save_mode):
    flags = [f"--{precision}"] if precision != "fp32" else []
    if precision == "fp16":
        flags += ["--initial-loss-scale", "4096"]
    if save_mode == "async":
        flags += ["--async-save"]
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _pretrain(world, "--steps", "6", "--save", str(tmp_path / "a"), "--log-json", str(log_a), *flags)
    first = _pretrain(world, "--steps", "6", "--save", str(tmp_path / "b"), "--exit-interval", "3", *flags)
    assert "saved iteration 3" in first and ckpt.latest_iteration(tmp_path / "b") == 3
    second = _pretrain(world, "--steps", "6", "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"),
                       "--log-json", str(log_b), *flags)
    assert f"resumed from iteration 3 (saved at DP={world}, now DP={world})" in second
    a, b = _steps(log_a), _steps(log_b)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in b), (a, b)
    for what in ("model", "master", "exp_avg", "exp_avg_sq"):
        x, y = ckpt.read_tensors(tmp_path / "a", what), ckpt.read_tensors(tmp_path / "b", what)
        for name in x:
            assert torch.equal(x[name], y[name]), f"{what} {name} differs after the resume"


def test_pretrain_resume_at_another_dp_size(tmp_path):
    _pretrain(2, "--steps", "3", "--save", str(tmp_path / "c"))
    log = _pretrain(3, "--steps", "5", "--load", str(tmp_path / "c"), "--save", str(tmp_path / "c"),
                    "--log-json", str(tmp_path / "c.jsonl"))
    assert "resumed from iteration 3 (saved at DP=2, now DP=3)" in log
    assert sorted(_steps(tmp_path / "c.jsonl")) == [4, 5]
    assert ckpt.latest_iteration(tmp_path / "c") == 5
    model_only = _pretrain(1, "--steps", "6", "--load", str(tmp_path / "c"), "--no-load-optim", "--no-load-rng")
    assert "resumed from iteration 5 (saved at DP=3, now DP=1)" in model_only
