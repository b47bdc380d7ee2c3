"""Ranks that fail alone or disagree: a clear error on every rank within a bound, never a hang."""
from __future__ import annotations

import pytest

import cases_reliability as cr

BOUND_S = 20


@pytest.mark.parametrize("fault", ["raise_first", "raise_last", "empty", "aux_one_rank"])
@pytest.mark.parametrize("overlap", [False, True])
def test_train_step_failure_on_one_rank_raises_on_every_rank(pools, fault, overlap):
    results = pools(2).run(cr.train_step_fault, fault, overlap, timeout=60)
    for res in results:
        assert res["error"] is not None and res["error"].startswith("RankError"), res
        if fault == "aux_one_rank":
            assert "different aux losses" in res["error"], res
        else:
            assert "on rank 1" in res["error"] and ("KeyError" in res["error"] or "got none" in res["error"]), res
        assert res["seconds"] < BOUND_S, res
        assert res["after"], "the next step must work on every rank"


def test_scheduler_advances_by_the_global_sample_count(pools):
    results = pools(2).run(cr.scheduler_counts_global_samples)
    assert results[0]["num_steps"] == results[1]["num_steps"] == 2 * (1 + 3)
    assert results[0]["lr"] == results[1]["lr"]


@pytest.mark.parametrize("kind, expect", [("reshaped", "trainable param"), ("order", "trainable param"),
                                          ("dtype", "trainable param"), ("float64", "dtype torch.float64"),
                                          ("bucket_size", "ddp_config.bucket_size"),
                                          ("distributed_optimizer", "ddp_config.use_distributed_optimizer")])
def test_ranks_that_wrap_different_things_raise_at_construction(pools, kind, expect):
    for res in pools(2).run(cr.ddp_mismatch, kind, timeout=60):
        assert res["error"] is not None and expect in res["error"] and "rank 1" in res["error"], res
        assert res["seconds"] < BOUND_S


@pytest.mark.parametrize("kind, expect", [("to_bf16", "no longer lives in megatron_opt's buffer"),
                                          ("assign", "is not the param that was wrapped"),
                                          ("freeze", "requires_grad set to False"),
                                          ("wrap_twice", "already wrapped")])
def test_params_changed_after_wrapping_are_caught(pools, kind, expect):
    for res in pools(2).run(cr.param_changed_after_wrapping, kind, timeout=60):
        assert res["error"] is not None and expect in res["error"], res
        assert res["seconds"] < BOUND_S


@pytest.mark.parametrize("grad_fp32", [False, True])
def test_16bit_grad_buffers_are_prescaled_before_their_reduction(pools, grad_fp32):
    for res in pools(2).run(cr.fp16_buffer_reduction, grad_fp32):
        assert res["success"], "the data-parallel sum of fp16 gradients overflowed: no pre-scaling"
        assert res["norm"] == pytest.approx(40000.0 * 8, rel=1e-3)  # the average gradient, 64 elements
