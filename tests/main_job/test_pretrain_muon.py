"""scripts/pretrain_gpt.py trains with ``--optimizer muon`` and Megatron-LM main's ``--muon-*`` flags.

* Each --muon-* flag reaches its OptimizerConfig field, with Megatron-LM main's defaults (--muon-momentum 0.9
  and --muon-tp-mode duplicated, where megatron-core's config says 0.95 and blockwise); ``dist_muon`` is Muon
  with the sharded optimizer (as Megatron-LM main reads it); what megatron_opt lacks is an error naming the flag.
* Under torchrun at DP2 with the sharded optimizer and both overlaps, Muon trains (the loss drops) and logs the
  same losses and grad norms as DP2 without sharding or overlap, where every rank runs the whole Muon (fp32
  Newton-Schulz: the runs differ by the order of fp32 sums only).
  (The same path against megatron-core's own Muon, through Megatron-LM's pretrain_gpt.py:
  tests/mcore/test_stock_megatron_lm.py's compare.py DP2-muon run.)
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.main_job.main_job_script import ENV, ROOT, SCRIPT, TORCHRUN
from megatron_opt_train.flags import parse_args
from megatron_opt.megatron import arguments as megatron_args

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr-warmup-iters", "0",
        "--lr", "0.02", "--eval-iters", "0", "--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]
SHARDED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
LOSS_RTOL, NORM_RTOL = 2e-6, 2e-6  # fp32 reduction order (reduce-scatter and shard norms vs all-reduce)


def _config(*argv: str):
    return megatron_args.optimizer_config_from_args(parse_args(["--train-iters", "2", *argv]))


def test_muon_flags_take_megatron_lm_defaults_and_reach_the_config():
    default = _config("--optimizer", "muon")
    assert (default.optimizer, default.muon_momentum, default.muon_tp_mode, default.muon_split_qkv,
            default.muon_nesterov, default.muon_scale_mode, default.muon_fp32_matmul_prec, default.muon_num_ns_steps,
            default.muon_extra_scale_factor, default.muon_coefficient_type) == (
        "muon", 0.9, "duplicated", True, False, "spectral", "medium", 5, 1.0, "quintic")
    given = _config("--optimizer", "muon", "--muon-momentum", "0.7", "--muon-no-split-qkv", "--muon-nesterov",
                    "--muon-scale-mode", "unit_rms_norm", "--muon-fp32-matmul-prec", "high", "--muon-num-ns-steps", "3",
                    "--muon-tp-mode", "blockwise", "--muon-extra-scale-factor", "0.5", "--muon-use-syrk",
                    "--muon-scalar-optimizer", "adam")
    assert (given.muon_momentum, given.muon_split_qkv, given.muon_nesterov, given.muon_scale_mode,
            given.muon_fp32_matmul_prec, given.muon_num_ns_steps, given.muon_tp_mode,
            given.muon_extra_scale_factor) == (
        0.7, False, True, "unit_rms_norm", "high", 3, "blockwise", 0.5)
    dist = _config("--optimizer", "dist_muon", "--overlap-param-gather")
    assert (dist.optimizer, dist.use_distributed_optimizer, dist.overlap_param_gather) == ("muon", True, True)


@pytest.mark.parametrize("flags, message", [
    (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion"),
    (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec='low' is not one of"),  # the rule's declaration
    (["--muon-momentum", "1.5"], "--muon-momentum=1.5 is out of range"),
    (["--muon-coefficient-type", "aol"], "--muon-coefficient-type 'aol'"),
])
def test_what_megatron_opt_lacks_is_refused_by_flag(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        _config("--optimizer", "muon", *flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _pretrain(tmp_path, name: str, world: int, *flags: str) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *TINY, "--log-json", str(log), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_muon_dp2_sharded_with_overlap_trains_as_unsharded_muon(tmp_path):
    sharded = _pretrain(tmp_path, "dp2", 2, *SHARDED)
    single = _pretrain(tmp_path, "dp2_unsharded", 2)
    assert [r["iteration"] for r in sharded] == [1, 2, 3] and all(r["success"] for r in sharded)
    losses = [r["lm loss"] for r in sharded]
    assert losses[-1] < losses[0] - 0.05, losses  # it trains
    for ours, theirs in zip(sharded, single):
        assert ours["consumed_samples"] == theirs["consumed_samples"]
        # iteration 1 compares the initial weights; the later ones Muon's updates too
        assert ours["lm loss"] == pytest.approx(theirs["lm loss"], rel=LOSS_RTOL, abs=0), (ours, theirs)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL, abs=0), (ours, theirs)


@pytest.mark.parametrize("optimizer", ["adaptive_muon", "adaptive_muon --adaptive-muon-moment2-method normuon",
                                       "soap"])
def test_the_rest_of_the_family_trains_with_verify_mode_on_megatron_cores_gpt(tmp_path, optimizer):
    """--optimizer adaptive_muon / soap with Megatron-LM's defaults (bf16 Newton-Schulz: --muon-fp32-matmul-prec
    medium) on megatron-core's GPTModel, sharded with both overlaps, verify mode on every step: it trains and no
    check fails. (AdaptiveMuon's first step here found its second-moment bound missing the square of O's error;
    megatron-core's model also needs the QKV weights tagged for AdaptiveMuon, as for Muon.)"""
    pytest.importorskip("megatron.core")
    flags = [f for f in TINY if f not in ("muon", "--muon-fp32-matmul-prec", "high")]
    log = tmp_path / "log.jsonl"
    cmd = [*TORCHRUN, "--nproc_per_node=2", SCRIPT, *flags, *optimizer.split(), "--use-mcore-models",
           "--verify-interval", "1", "--log-json", str(log), *SHARDED]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3] and all(r["success"] for r in records)
