"""AdaptiveMuon's NorMuon second moment (per-matrix state, held by each matrix's home) through Megatron-LM's
torch_dist ('fully_reshardable', 'dp_reshardable') and megatron_opt.checkpoint, on megatron-core's GPTModel through
install() (SOAP's harness: tests/mcore/cases_checkpoint_soap.py, with optimizer='adaptive_muon'):

* saved at DP2, loaded at DP2: the per-matrix state bitwise, and the continuation bit-exact (losses, params);
* loaded at DP3 (other homes): every per-matrix state tensor bitwise the saved one, each homed once;
* at TP2 x DP2 with muon_tp_mode 'duplicated' (O computed across TP, the moment per TP-local block): a resume
  bit-exact; at TP1 the load is refused on every rank naming the ways on, and with matrix_state_tp_size 2 (the TP1
  run keeps the TP2 blocks' moments) it loads bitwise and trains on.
"""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_soap as ccs
from tests.mcore.test_checkpoint_soap import _same, as_tp2_blocks

BEFORE, AFTER = 2, 2
TIMEOUT = 300
NORMUON = dict(adaptive_muon_moment2_method="normuon")
DUPLICATED = dict(NORMUON, tp_mode="duplicated")


@pytest.fixture(scope="module")
def saved_at_dp2(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("normuon_dp2"))
    return path, pools(2).run(ccs.run_save, path, BEFORE, AFTER, "dp", "adaptive_muon", NORMUON,
                              timeout=TIMEOUT)[0]


def test_the_saved_state_is_normuons(saved_at_dp2):
    saved = saved_at_dp2[1]["saved"]
    assert {state for state, _, _ in saved} == {"moment2_buffer"}
    assert any("linear_qkv.weight" in key for _, key, _ in saved)
    assert all(1 in t.shape and torch.isfinite(t).all() and t.abs().sum() > 0 for t in saved.values())


def test_resume_at_dp2_is_bit_exact_in_every_format(pools, saved_at_dp2):
    path, straight = saved_at_dp2
    loaded = pools(2).run(ccs.run_load, path, BEFORE, AFTER, ccs.ccm.FORMATS, "dp", "adaptive_muon", NORMUON,
                          timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
        _same(straight["params"], res["params"], f"{fmt}: params after the continuation")


def test_loaded_at_dp3_the_new_homes_hold_the_saved_state(pools, saved_at_dp2):
    path, straight = saved_at_dp2
    loaded = pools(3).run(ccs.run_load, path, BEFORE, 0, ("fully_reshardable", "megatron_opt"), "dp",
                          "adaptive_muon", NORMUON, timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{fmt} at DP3: the loaded per-matrix state")


def test_tp2_duplicated_resume_is_bit_exact_and_tp1_keeps_its_blocks_or_is_refused(pools, tmp_path):
    path = str(tmp_path / "tp2")
    straight = pools(4).run(ccs.run_save, path, BEFORE, AFTER, "tp2", "adaptive_muon", DUPLICATED,
                            timeout=TIMEOUT)[0]
    assert {tp for _, _, tp in straight["saved"]} == {0, 1}
    loaded = pools(4).run(ccs.run_load, path, BEFORE, AFTER, ("fully_reshardable", "megatron_opt"), "tp2",
                          "adaptive_muon", DUPLICATED, timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"TP2 {fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
    for fmt in ("megatron_opt", "fully_reshardable"):
        messages = set(pools(4).run(ccs.load_refused, path, fmt, "dp", "adaptive_muon", DUPLICATED, timeout=TIMEOUT))
        assert len(messages) == 1, messages
        message = messages.pop()
        assert "CheckpointError" in message and "per-matrix state" in message and "--no-load-optim" in message, message
        assert "matrix_state_tp_size" in message, message
    # keeping the TP2 blocks (matrix_state_tp_size 2), TP1 loads it bitwise and trains on
    keep = dict(NORMUON, rule_constants={"matrix_state_tp_size": 2})
    at_tp1 = pools(4).run(ccs.run_load, path, BEFORE, 2, ("fully_reshardable", "megatron_opt"), "dp",
                          "adaptive_muon", keep, timeout=TIMEOUT)[0]
    for fmt, res in at_tp1.items():
        _same(straight["saved"], as_tp2_blocks(res["loaded"]), f"TP2 -> TP1 {fmt}: the loaded per-matrix state")
        assert all(loss is not None and torch.isfinite(torch.tensor(loss)) for loss in res["losses"]), res["losses"]
