"""Muon through the distributed optimizer (data parallel, overlapped reduce-scatter and all-gather)
against the float64 single-process reference (tests/support/reference_muon.py) fed the same global
batch: params, the momentum (through state_dict) and the grad norm, every step.

Bounds (measured, then ~5-10x headroom):
* fp32 params with muon_fp32_matmul_prec='highest': the error of the params relative to the
  reference's change since the start measured <= 3e-6 (fp32 forward/backward roundings ~1e-7
  relative, amplified by Newton-Schulz, whose update error against megatron-core's own Muon is
  7.8e-6..3e-5, docs/muon.md): bound 3e-5; the momentum (elementwise EMA of fp32 grads) measured
  <= 4e-7: bound 3e-6; the grad norm measured <= 7e-8: bound 1e-6.
* fp32 params with 'medium' (Newton-Schulz in bf16, as megatron-core): the update carries bf16's
  2^-8 relative error through five iterations (2.45e-2 in the calibration against megatron-core);
  measured <= 6.1e-2 of the change, and the later grads see it (momentum <= 3e-3, norm <= 1.6e-3):
  bounds 0.15, 1e-2, 1e-2.
* bf16 params: the forward and backward run in bf16 (grads ~2^-8 relative) and the params round to
  bf16 (2^-9 of |W|, more than a step's change): params measured <= 6e-2 of the change, momentum <=
  1e-2, norm <= 2.1e-3: bounds 0.2, 3e-2, 1e-2.
A wrong rule moves the params by O(1) of the change (QKV unsplit, Nesterov ignored, a straddling
matrix orthogonalised in pieces) or the momentum by 1/(1-beta) = 20x (SGD form).
"""
import pytest

from tests.distributed import cases_muon

FP32 = dict(param=3e-5, momentum=3e-6, norm=1e-6)
MEDIUM = dict(param=0.15, momentum=1e-2, norm=1e-2)  # later grads see the earlier steps' bf16 error
BF16 = dict(param=0.2, momentum=3e-2, norm=1e-2)
TIMEOUT = 240


def _check(results, bounds, steps):
    for rank, res in enumerate(results):
        assert res["success"] == [True] * steps
        assert res["muon_names"] == ["attn.linear_qkv.weight", "fc1.weight", "fc2.weight", "out.weight"]
        for step, (perr, merr, nrel) in enumerate(zip(res["param_err"], res["momentum_err"], res["norm_rel"])):
            assert nrel <= bounds["norm"], f"rank {rank} step {step}: grad norm rel {nrel}"
            for name, e in perr.items():
                assert e <= bounds["param"], f"rank {rank} step {step} {name}: param error {e} of the change"
            for name, e in merr.items():
                assert e <= bounds["momentum"], f"rank {rank} step {step} {name}: momentum_buffer rel {e}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_muon_fp32_matches_float64_reference(pools, world):
    _check(pools(world).run(cases_muon.train, "fp32", 4, timeout=TIMEOUT), FP32, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_muon_nesterov_matches_reference(pools, world):
    _check(pools(world).run(cases_muon.train, "fp32", 3, nesterov=True, timeout=TIMEOUT), FP32, 3)


def test_muon_scale_mode_extra_scale_no_clip_no_split(pools):
    res = pools(3).run(cases_muon.train, "fp32", 3, clip=0.0, split_qkv=False, scale_mode="unit_rms_norm",
                       extra_scale=2.0, timeout=TIMEOUT)
    _check(res, FP32, 3)


def test_muon_medium_precision_newton_schulz_in_bf16(pools):
    _check(pools(2).run(cases_muon.train, "fp32", 3, matmul_prec="medium", timeout=TIMEOUT), MEDIUM, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_muon_bf16_matches_reference(pools, world):
    _check(pools(world).run(cases_muon.train, "bf16", 3, timeout=TIMEOUT), BF16, 3)


def test_muon_skipped_step_changes_nothing(pools):
    """A non-finite grad on one rank skips the step everywhere: params and momentum stay bitwise."""
    for res in pools(3).run(cases_muon.train, "fp32", 3, inject_nonfinite_at=1, timeout=TIMEOUT):
        assert res["success"] == [True, False, True]
        assert res["changed"] == [False]
        assert max(max(e.values()) for e in res["param_err"]) <= FP32["param"]  # and training goes on as the reference
        assert max(max(e.values()) for e in res["momentum_err"]) <= FP32["momentum"]


@pytest.mark.parametrize("kind, tp_mode, named", [("tensor_parallel_group", "duplicated", "tensor_parallel_group"),
                                                  ("tensor_parallel_group", "blockwise", None)])
def test_muon_refuses_what_is_not_implemented_yet(pools, kind, tp_mode, named):
    """A TP group given by keyword only (the model wrapped without one) is enough for blockwise Muon (which
    talks to no TP peer), not for the modes that orthogonalise across the TP group."""
    for message in pools(2).run(cases_muon.refused, kind, tp_mode, timeout=TIMEOUT):
        if named is None:
            assert message == "not refused", message
        else:
            assert f"muon_tp_mode={tp_mode!r}" in message and named in message, message


def test_muon_update_failure_on_one_rank_raises_everywhere(pools):
    for res in pools(3).run(cases_muon.failure_on_one_rank, timeout=60):
        assert res["error"] is not None and "rank 2" in res["error"], res


def test_muon_with_scheduler_lr_and_wd_per_group(pools):
    """OptimizerParamScheduler drives both children's groups (warmup, cosine decay, wd increase)."""
    _check(pools(3).run(cases_muon.train, "fp32", 4, scheduled=True, timeout=TIMEOUT), FP32, 4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muon_state_dict_resume_is_bitwise(pools, dtype):
    for res in pools(3).run(cases_muon.resume_is_bitwise, dtype, timeout=TIMEOUT):
        assert res == dict(params=True, momentum=True, moved=True)


def test_muon_with_several_buckets(pools):
    """Small buckets: every matrix in a bucket of its own (or two), each bucket sharded over all ranks."""
    _check(pools(3).run(cases_muon.train, "fp32", 3, bucket_size=500, timeout=TIMEOUT), FP32, 3)


def test_muon_without_the_distributed_optimizer(pools):
    """use_distributed_optimizer=False: every rank holds every matrix and orthogonalises it itself."""
    _check(pools(2).run(cases_muon.train, "fp32", 3, distributed=False, timeout=TIMEOUT), FP32, 3)


def test_muon_qkv_split_missing_on_one_rank_raises_everywhere(pools):
    for res in pools(3).run(cases_muon.qkv_split_missing_on_one_rank, timeout=60):
        assert res["error"] is not None and "rank 2" in res["error"] and "qkv_split_shapes" in res["error"], res


@pytest.mark.parametrize("dtype, prec", [("fp32", "highest"), ("bf16", "medium")])
def test_muon_verify_mode_checks_every_step(pools, dtype, prec):
    """verify_interval=1: the homes recompute their matrices in float64 and every owner's slice (and
    momentum) is within the bound; a wrong update raises VerificationError (seen with the rule broken)."""
    bounds = FP32 if dtype == "fp32" else BF16
    results = pools(3).run(cases_muon.train, dtype, 3, verify=True, matmul_prec=prec, timeout=TIMEOUT)
    _check(results, bounds, 3)
    assert all(res["verified"] == 3 for res in results)
