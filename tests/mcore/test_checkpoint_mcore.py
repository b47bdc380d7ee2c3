"""Megatron-LM's torch_dist optimizer checkpoint through install(): ``optimizer.sharded_state_dict(...)``
in megatron-core's 'fully_reshardable' and 'dp_reshardable' formats, saved and loaded with
megatron.core.dist_checkpointing on megatron-core's GPTModel, at a changed data-parallel size, and
cross-loaded with megatron-core 0.16.1's own DistributedOptimizer both ways."""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_mcore as cc

STATES = ("master", "exp_avg", "exp_avg_sq")
BEFORE, AFTER = 2, 2
# megatron_opt's AdamW and torch's, both fp32, from the same state on the same gradients: their
# updates agree to fp32 rounding (measured ~1e-7); a lost moment or update count is O(1) off.
CONTINUATION_TOL = 1e-4


def _assert_same_state(a: dict, b: dict) -> None:
    for state in STATES:
        assert a[state].keys() == b[state].keys(), state
        for key in a[state]:
            assert torch.equal(a[state][key], b[state][key]), f"{state} of {key} differs"


def _update_error(result: dict, reference: dict) -> float:
    """How far ``result``'s continuation (params after minus at load) is from ``reference``'s final params."""
    start, end, ref = result["start"], result["params"], reference["params"]
    num = sum(float(((end[n] - start[n]) - (ref[n] - start[n])).norm() ** 2) for n in ref)
    den = sum(float((ref[n] - start[n]).norm() ** 2) for n in ref)
    return (num / den) ** 0.5


@pytest.mark.parametrize("kind, save_dp, load_dp", [("fully_reshardable", 2, 4), ("dp_reshardable", 2, 1)])
def test_megatron_opt_round_trip_at_another_dp_size_is_bitwise(pools, tmp_path, kind, save_dp, load_dp):
    path = cc.tmp_folder(str(tmp_path), kind)
    saved = pools(save_dp).run(cc.run_save, path, True, kind, 2000, BEFORE, 0)[0]
    assert saved["buckets"] > 1  # several buckets on our side
    loaded = pools(load_dp).run(cc.run_load, path, True, kind, 2000, BEFORE, 0)[0]
    _assert_same_state(saved["saved"], loaded["loaded"])
    assert saved["saved"]["steps"] == loaded["loaded"]["steps"] == [BEFORE]
    assert saved["saved"]["scheduler"] == loaded["loaded"]["scheduler"]


def test_megatron_core_fully_reshardable_loads_into_megatron_opt_at_another_dp(pools, tmp_path):
    """megatron-core's own DistributedOptimizer (one bucket: 0.16.1 saves this format wrongly with more)
    saves at DP=2; megatron_opt loads at DP=1 and continues as megatron-core's own continuation."""
    path = cc.tmp_folder(str(tmp_path), "core")
    theirs = pools(2).run(cc.run_save, path, False, "fully_reshardable", None, BEFORE, AFTER)[0]
    assert theirs["buckets"] == 1
    ours = pools(1).run(cc.run_load, path, True, "fully_reshardable", 2000, BEFORE, AFTER)[0]
    _assert_same_state(ours["on_disk"], ours["loaded"])  # every element of megatron-core's state, bitwise
    assert ours["loaded"]["steps"] == [BEFORE]
    assert _update_error(ours, theirs) < CONTINUATION_TOL
    # The same without the optimizer state (the model only) continues differently: the check can fail.
    fresh = pools(1).run(cc.run_load, path, True, "fully_reshardable", 2000, BEFORE, AFTER, False)[0]
    assert _update_error(fresh, theirs) > 100 * CONTINUATION_TOL


def test_megatron_opt_fully_reshardable_loads_into_megatron_core(pools, tmp_path):
    """megatron_opt (several buckets) saves at DP=2; megatron-core's own optimizer loads it at DP=2 and
    continues as megatron_opt's own continuation."""
    path = cc.tmp_folder(str(tmp_path), "ours")
    ours = pools(2).run(cc.run_save, path, True, "fully_reshardable", 2000, BEFORE, AFTER)[0]
    assert ours["buckets"] > 1
    theirs = pools(2).run(cc.run_load, path, False, "fully_reshardable", None, BEFORE, AFTER)[0]
    _assert_same_state(theirs["on_disk"], ours["saved"])
    assert _update_error(theirs, ours) < CONTINUATION_TOL


def test_dp_reshardable_with_another_bucket_layout_is_refused_naming_the_flag(pools, tmp_path):
    path = cc.tmp_folder(str(tmp_path), "dp")
    pools(2).run(cc.run_save, path, True, "dp_reshardable", 2000, 1, 0)
    for result in pools(2).run(cc.run_load_refused, path, "dp_reshardable", None):  # one bucket here
        assert result["error"] and "--dist-ckpt-optim-fully-reshardable" in result["error"], result
        assert result["unchanged"] is not False


@pytest.mark.parametrize("saved_by_ours", [True, False], ids=["megatron_opt_saved", "megatron_core_saved"])
def test_dp_reshardable_with_more_buckets_is_refused_naming_both_layouts(pools, tmp_path, saved_by_ours):
    """One bucket saved, several now: the keys of the extra buckets are not in the checkpoint. Without the
    check torch.distributed.checkpoint fails with a missing-key error naming neither cause nor fix."""
    path = cc.tmp_folder(str(tmp_path), "dp_more")
    pools(2).run(cc.run_save, path, saved_by_ours, "dp_reshardable", None, 1, 0)
    # timeout: every rank must come back from the refusal in time (none left waiting in the load)
    for result in pools(2).run(cc.run_load_with_other_buckets_installed, path, 2000, timeout=120):
        assert result["type"] == "CheckpointError", result
        assert "--dist-ckpt-optim-fully-reshardable" in result["error"], result
        assert "--ddp-bucket-size" in result["error"] and "1 bucket(s)" in result["error"], result
        assert result["unchanged"] is not False, result


def test_unsupported_sharding_type_names_the_formats(pools):
    for message in pools(2).run(cc.run_unsupported_type):
        assert "dp_zero_gather_scatter" in message and "--dist-ckpt-optim-fully-reshardable" in message
