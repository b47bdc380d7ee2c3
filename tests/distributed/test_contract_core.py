"""CONTRACT rules 1-9: each test names the bug it would catch."""

import pytest
import torch

from tests.distributed import cases_contract as cc
from tests.support.common import cosine_diff, rel_l2


def test_contract_01_prepare_once(pools):
    """Seed 000: prepare_grads twice (double unscale with an aliased fp32 grad buffer, double scaler
    update). Pass 1 runs once per shard, the scaler updates once, the grad buffer is never written,
    the grad norm is the unscaled one (the bug gives 1/1024 of it), prepare_grads() followed by
    step() raises, and the split API gives bitwise the same params as step()."""
    for rank, res in enumerate(pools(2).run(cc.rule01_prepare_once)):
        for path in ("plain", "split"):
            r = res[path]
            assert r["calls"] == {"stats": r["shards"], "update": 1}, (rank, path, r["calls"])
            assert r["grads_unchanged"], "a pass wrote into the persistent grad buffer"
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (rank, path)
        assert res["split"]["raised"] is not None and "rule 1 of docs/contract.md" in res["split"]["raised"]
        assert torch.equal(res["plain"]["params"], res["split"]["params"])


def test_contract_02_scaler_updates_once_per_step(pools):
    """Seed 000: with two updates per step the scale reaches 2^20 instead of 2^18 after 8 clean steps."""
    for res in pools(2).run(cc.rule02_scaler_cadence):
        assert res["updates"] == [False] * 8
        assert res["scale"] == 2.0**18
        assert res["growth_tracker"] == 0


def test_contract_03_global_overflow_decision(pools):
    """R10: an inf seen by one rank's shard only must make every rank skip, and the decision is one
    packed all-reduce per stats group (of [found_inf, sumsq, zeros, missing-backward], whatever its
    length): a second all-reduce, or the statistics sent unpacked, fail it."""
    results = pools(2).run(cc.rule03_global_overflow_decision)
    one_per_stats_group = {(0, 1): 1}  # one stats group here: the data-parallel group, both ranks
    for res in results:
        clean, bad = res["steps"]
        # An applied step adds one agreement before the param all-gather (did the update fail on
        # any rank); the decision itself is the one packed all-reduce per stats group.
        assert clean["out"][0] is True
        assert clean["stats_all_reduces"] == one_per_stats_group and clean["agreement_all_reduces"] == 1, clean
        assert bad["out"] == (False, None, None)
        assert bad["stats_all_reduces"] == one_per_stats_group, "the skip decision must be one all-reduce"
        assert bad["agreement_all_reduces"] == 0, bad
        assert bad["params_unchanged"] and bad["state_unchanged"]
        assert bad["scale"] == clean["scale"] / 2, "the dynamic scale must halve exactly once"
        assert bad["reason"] == "overflow"
    assert len({r["steps"][1]["scale"] for r in results}) == 1


def test_contract_03_clip_uses_global_norm(pools):
    """T0.6: at W=3 with a gradient norm ~10x the clip threshold, the clip coefficient comes from the
    global norm of all shards: params match the clipped single-process reference."""
    from tests.distributed import cases_parity

    for res in pools(3).run(cases_parity.run_parity, "fp32", 1, False, loss_mult=10.0):
        assert all(ours > 2.0 for ours, _ in res["norms"]), "the test needs clipping to be active"
        for name, (rl2, _, _) in res["errors"].items():
            assert rl2 <= 1e-4, f"{name}: {rl2}"
        for ours, ref in res["norms"]:
            assert ours == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_contract_04_skip_is_a_normal_result(pools, precision):
    """R8/R9/T0.3/T0.4: a skipped step must not raise, must not touch params, masters, moments, the
    step counter or the LR schedule, must be logged (bf16 too), and the next step must work."""
    for res in pools(2).run(cc.rule04_skip_is_normal, precision):
        first, skipped, after = res["steps"]
        assert first["success"] and after["success"]
        assert (skipped["success"], skipped["grad_norm"], skipped["num_zeros"]) == (False, None, None)
        assert skipped["params_unchanged"] and skipped["state_unchanged"] and skipped["lr_unchanged"]
        assert skipped["sched_after"] == skipped["sched_before"]
        assert after["sched_after"] == after["sched_before"] + 4  # DP 2 x one micro-batch of 2 sequences
        assert skipped["reason"] == "non-finite" and skipped["skipped"] == 1 and after["skipped"] == 1
        assert any("step skipped" in m and "non-finite" in m for m in res["log"]), res["log"]
        assert not after["params_unchanged"]


@pytest.mark.parametrize("log_zeros", [False, True])
def test_contract_05_step_returns_success_norm_zeros(pools, log_zeros):
    """grad_norm must be the unscaled global norm before clipping (not the clipped one, not scaled by
    the loss scale), and num_zeros None unless asked."""
    for res in pools(2).run(cc.rule05_step_returns, log_zeros):
        success, norm, zeros = res["out"]
        assert success is True
        assert res["ref_norm"] > 0.5 * 4, "clipping must be active for this test"
        assert norm == pytest.approx(res["ref_norm"], rel=1e-5)
        assert zeros == (res["ref_zeros"] if log_zeros else None)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_contract_06_optimizer_params_are_leaves(pools, world, precision):
    """Seed 002: a non-leaf fp32 shard breaks torch optimizers ('can't optimize a non-leaf Tensor')."""
    results = pools(world).run(cc.rule06_leaf_and_aliasing, precision)
    for res in results:
        assert res["leaf"] and res["n_params"] > 0
        assert res["rebuilt_groups"] >= 2
        assert res["success"] and res["keep_moved"]
        assert res["model_matches_master"], "after the step the model param must equal its rounded master"
    # A rank may own only padding of the small fp32 buffer, so check aliasing over all ranks.
    aliases = [a for res in results for a in res["aliases"]]
    assert aliases and all(aliases), "fp32 shards must alias the model param storage"
    if precision == "bf16":
        separate = [s for res in results for s in res["separate"]]
        assert separate and not any(separate), "bf16 masters must be separate fp32 tensors"


def test_contract_06_state_dict_round_trip(pools):
    """T2.3: a reloaded optimizer continues bitwise identically and keeps leaf params; another model's
    state_dict is refused with a clear error."""
    for res in pools(2).run(cc.rule06_state_dict_round_trip):
        assert res["equal"] and res["leaf"]
        assert res["step_a"] == res["step_b"] == 3
        assert res["error"] is not None and ("does not match" in res["error"] or "shards" in res["error"])


@pytest.mark.parametrize("overlap", [False, True])
def test_contract_07_one_dtype_per_collective(pools, overlap):
    """Seed 004 / R15: deferred weight grads, a param first used in the last micro-batch and an unused
    param must all be accumulated into the fp32 buffer before the bucket is sent (one dtype per
    collective, nothing lost), and a gradient after the launch must raise."""
    for res in pools(2).run(cc.rule07_one_dtype_and_complete_accumulation, overlap):
        assert res["dtypes"], "no reduce-scatter observed"
        assert set(res["dtypes"]) == {("torch.float32", "torch.float32")}
        assert res["buffer_dtypes"] == ["torch.float32"]
        for name, ref in res["refs"].items():
            ours = res["ours"][name]
            if name == "unused":
                assert torch.equal(ours, torch.zeros_like(ours))
                continue
            assert rel_l2(ours, ref) <= 2e-2 and cosine_diff(ours, ref) <= 1e-3, name
        assert res["late_error"] is not None and "after its bucket" in res["late_error"]


def test_contract_08_accumulation_in_fp32(pools):
    """R13/R14: bf16 accumulation is ~1e-2 off; clearing at a micro-batch boundary keeps only the last."""
    for res in pools(2).run(cc.rule08_fp32_accumulation):
        assert res["dtype"] == "torch.float32"
        tol = 1e-6 * res["abs_sum"]
        assert (res["local"] - res["expected"]).abs().max() <= tol
        assert (res["halfway"] - res["expected_half"]).abs().max() <= tol
        assert res["cleared"]


@pytest.mark.parametrize("world", [2, 3])
def test_contract_09_every_microbatch_reduced(pools, world):
    """R12 (DeepSpeed #7985): the last micro-batch left out of the reduction biases the gradient and
    makes ranks diverge."""
    for res in pools(world).run(cc.rule09_every_microbatch):
        assert res["success"]
        assert torch.allclose(res["update"], torch.full_like(res["update"], res["expected"]), rtol=1e-6, atol=0)


def test_contract_02_fp16_trajectory_then_one_rank_overflow(pools):
    """Issue 3's fp16 trajectory: exact growth cadence, then a one-rank overflow is a global skip with
    exactly one backoff, and neither Adam state nor the LR schedule moves."""
    results = pools(2).run(cc.fp16_trajectory_then_one_rank_overflow)
    assert any(r["owns"] for r in results)
    for res in results:
        assert res["after_clean"] == 2.0**18
        assert res["success"] is False and res["reason"] == "overflow"
        assert res["scale"] == 2.0**17
        assert res["params_unchanged"] and res["state_unchanged"] and res["sched_unchanged"]


def test_contract_04_norm_over_threshold_is_a_skip(pools):
    for res in pools(2).run(cc.norm_threshold_skip):
        assert (res["success"], res["norm"], res["reason"]) == (False, None, "norm over threshold")
        assert res["unchanged"]
        assert res["tracker"] == 0 and res["scale"] == 256.0, \
            "a norm-threshold skip must leave the loss scaler unchanged"
        assert any("norm over threshold" in m for m in res["log"])
