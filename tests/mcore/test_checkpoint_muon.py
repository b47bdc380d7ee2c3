"""Checkpoints of megatron_opt's Muon on megatron-core's GPTModel through install()
(tests/mcore/cases_checkpoint_muon.py): Megatron-LM's torch_dist in megatron-core's 'fully_reshardable'
and 'dp_reshardable' optimizer formats, and megatron_opt.checkpoint.

One run at DP2 trains 2 steps, saves in the three formats and trains 2 more (the uninterrupted run).
Every check compares, bitwise and in model space, every param's fp32 master, Muon's momentum_buffer,
the AdamW child's exp_avg and exp_avg_sq, the params and both children's update counts:

* DP2 -> DP3 -> DP1: loaded at DP3 (other ranges per rank: 3 catches uneven ownership), saved there
  again, loaded at DP1;
* a resume at DP2 continues bit-exactly as the uninterrupted run (losses, params, state);
* an optimizer-only load into a model with other weights (Megatron-LM #6920: its layer-wise Muon skipped
  the post-load param all-gather and silently continued from another model): every DP rank then holds
  the loaded params, and the continuation is again bit-exact.
"""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_muon as ccm
from tests.support.common import the_same_on_every_rank

BEFORE, AFTER = 2, 2
CHECKED = (*ccm.STATES, "param")


@pytest.fixture(scope="module")
def saved_at_dp2(pools, tmp_path_factory):
    """The DP2 run: its checkpoints (``path``/<format>), its state as saved, its continuation."""
    path = str(tmp_path_factory.mktemp("muon_dp2"))
    result = pools(2).run(ccm.run_save, path, "dp", BEFORE, AFTER)[0]
    return path, result


def assert_same_state(expected: dict, actual: dict, what: str, checked: tuple = CHECKED) -> None:
    for state in checked:
        assert expected[state].keys() == actual[state].keys(), (what, state)
        for name, tensor in expected[state].items():
            assert not tensor.isnan().any(), f"{what}: {state} of {name} was held by no rank"
            assert torch.equal(tensor, actual[state][name]), f"{what}: {state} of {name} differs"
    assert expected["steps"] == actual["steps"], what
    assert all(actual["replicas"].values()), (what, actual["replicas"])


def test_saved_state_covers_both_children(saved_at_dp2):
    """The checks below can fail: the Muon params (2-D, not embedding/output: the position embedding
    included, as megatron-core splits them) have a moved momentum, the others Adam moments."""
    saved = saved_at_dp2[1]["saved"]
    muon = set(saved["momentum_buffer"])
    assert {"decoder.layers.0.self_attention.linear_qkv.weight", "embedding.position_embeddings.weight"} <= muon
    assert not muon & set(saved["exp_avg"]) and muon | set(saved["exp_avg"]) == set(saved["master"])
    assert all(t.abs().sum() > 0 for t in saved["momentum_buffer"].values())
    assert saved["steps"] == [(BEFORE, BEFORE)]


def test_dp_reshard_2_to_3_to_1_is_bitwise(pools, saved_at_dp2, tmp_path):
    path, saved = saved_at_dp2
    at_dp3 = str(tmp_path / "dp3")
    loaded3 = pools(3).run(ccm.run_load, path, "dp", ccm.FORMATS, BEFORE, 0, resave=at_dp3)[0]
    loaded1 = pools(1).run(ccm.run_load, at_dp3, "dp", ccm.FORMATS, BEFORE, 0)[0]
    for fmt in ccm.FORMATS:
        assert_same_state(saved["saved"], loaded3[fmt]["loaded"], f"{fmt} DP2 -> DP3")
        assert_same_state(saved["saved"], loaded1[fmt]["loaded"], f"{fmt} DP2 -> DP3 -> DP1")


def test_resume_is_bit_exact(pools, saved_at_dp2):
    path, saved = saved_at_dp2
    resumed = pools(2).run(ccm.run_load, path, "dp", ccm.FORMATS, BEFORE, AFTER)[0]
    for fmt in ccm.FORMATS:
        assert_same_state(saved["saved"], resumed[fmt]["loaded"], f"{fmt} at load")
        assert resumed[fmt]["losses"] == saved["losses"], fmt
        assert_same_state(saved["final"], resumed[fmt]["final"], f"{fmt} resumed")


def test_optimizer_only_load_all_gathers_the_loaded_params(pools, saved_at_dp2):
    """Megatron-LM #6920: the model keeps other weights, only the optimizer is loaded (torch_dist); the
    load's all-gather alone must give every DP rank the loaded params, and the run must continue as the
    uninterrupted one."""
    path, saved = saved_at_dp2
    kinds = tuple(ccm.TORCH_DIST)
    resumed = pools(2).run(ccm.run_load, path, "dp", kinds, BEFORE, AFTER, model=False)[0]
    for fmt in kinds:
        assert_same_state(saved["saved"], resumed[fmt]["loaded"], f"{fmt} optimizer only, at load")
        assert resumed[fmt]["losses"] == saved["losses"], fmt
        assert_same_state(saved["final"], resumed[fmt]["final"], f"{fmt} optimizer only, resumed")


@pytest.mark.parametrize("tp_mode", ["blockwise", pytest.param("duplicated", marks=pytest.mark.slow)])
def test_tp2_to_tp1_is_bitwise_and_a_tp2_resume_is_bit_exact(pools, tmp_path, tp_mode):
    """TP2xDP2 -> TP1xDP2 (torch_dist fully_reshardable and megatron_opt.checkpoint; dp_reshardable stores
    buckets, which another TP size lays out otherwise, and is refused: test_checkpoint_model_parallel). The
    momentum is per element of the model's tensors whatever muon_tp_mode orthogonalises (each TP rank's
    block, or the whole matrix), so the TP1 run holds the TP2 run's state bitwise; a resume at TP2
    continues bit-exactly."""
    path = str(tmp_path)
    formats = ("fully_reshardable", "megatron_opt")
    saved = pools(4).run(ccm.run_save, path, "tp2", BEFORE, AFTER, tp_mode, formats)[0]
    assert saved["saved"]["steps"] == [(BEFORE, BEFORE)]
    loaded = pools(2).run(ccm.run_load, path, "dp", formats, BEFORE, 0, tp_mode)[0]
    for fmt in formats:
        assert_same_state(saved["saved"], loaded[fmt]["loaded"], f"{fmt} TP2xDP2 -> TP1xDP2 ({tp_mode})")
    resumed = pools(4).run(ccm.run_load, path, "tp2", formats[:1], BEFORE, AFTER, tp_mode)[0]
    assert resumed[formats[0]]["losses"] == saved["losses"]
    assert_same_state(saved["final"], resumed[formats[0]]["final"], f"TP2 resumed ({tp_mode})")


def test_adaptive_muon_tp2_to_tp1_is_bitwise_and_a_tp2_resume_is_bit_exact(pools, tmp_path):
    """AdaptiveMuon (issue 39): its state is elementwise (momentum_buffer and the second moment moment2_buffer, per
    element of the model's tensors), so TP2xDP2 -> TP1xDP2 holds the TP2 run's state bitwise, second moment
    included, and a TP2 resume continues bit-exactly (duplicated: megatron-core's --muon-tp-mode default)."""
    path = str(tmp_path)
    formats = ("fully_reshardable", "megatron_opt")
    checked = (*CHECKED, "moment2_buffer")
    saved = pools(4).run(ccm.run_save, path, "tp2", BEFORE, AFTER, "duplicated", formats, "adaptive_muon")[0]
    assert saved["saved"]["moment2_buffer"], "no moment2_buffer saved"
    loaded = pools(2).run(ccm.run_load, path, "dp", formats, BEFORE, 0, "duplicated", optimizer="adaptive_muon")[0]
    for fmt in formats:
        assert_same_state(saved["saved"], loaded[fmt]["loaded"], f"{fmt} TP2xDP2 -> TP1xDP2", checked)
    resumed = pools(4).run(ccm.run_load, path, "tp2", formats[:1], BEFORE, AFTER, "duplicated",
                           optimizer="adaptive_muon")[0]
    assert resumed[formats[0]]["losses"] == saved["losses"]
    assert_same_state(saved["final"], resumed[formats[0]]["final"], "TP2 resumed", checked)


def test_megatron_cores_layer_wise_checkpoint_is_refused_by_name_on_every_rank(pools, tmp_path):
    """A checkpoint of megatron-core's own LayerWiseDistributedOptimizer (its Muon / AdaptiveMuon / SOAP child's
    state per param: chained_0.optimizer.state.fp32_param.*) is not a format megatron_opt reads: the load is
    refused before anything is read, on every rank with the same message naming the format and the way on
    (--no-load-optim), and the optimizer state is as it was."""
    results = pools(2).run(ccm.load_refused_layer_wise, str(tmp_path), timeout=240)
    message = the_same_on_every_rank(r["message"] for r in results)
    assert message.startswith("CheckpointError") and "LayerWiseDistributedOptimizer" in message, message
    assert "fp32_param" in message and "--no-load-optim" in message, message
    assert results[0]["unchanged"] is True
