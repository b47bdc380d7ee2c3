"""SOAP's per-matrix state (Kronecker factors, eigenbases, rotated Adam moments; each held whole by its matrix's
home) through Megatron-LM's torch_dist ('fully_reshardable' and 'dp_reshardable') and megatron_opt.checkpoint, on
megatron-core's GPTModel through install() (tests/mcore/cases_checkpoint_soap.py):

* saved at DP2, loaded at DP2: the per-matrix state bitwise, and the continuation bit-exact (losses, params);
* loaded at DP3 (other homes): every per-matrix state tensor bitwise the saved one, each homed once;
* at TP2 x DP2 (each TP block's own state, placed at its block's coordinates): a resume bit-exact.
"""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_soap as ccs

BEFORE, AFTER = 2, 2
TIMEOUT = 300


@pytest.fixture(scope="module")
def saved_at_dp2(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("soap_dp2"))
    return path, pools(2).run(ccs.run_save, path, BEFORE, AFTER, timeout=TIMEOUT)[0]


def _same(expected: dict, actual: dict, what: str) -> None:
    assert expected.keys() == actual.keys(), what
    for key, tensor in expected.items():
        assert torch.equal(tensor, actual[key]), f"{what}: {key} differs"


def test_the_saved_state_is_soaps(saved_at_dp2):
    saved = saved_at_dp2[1]["saved"]
    states = {state for state, _, _ in saved}
    assert states == {"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"}
    assert any("linear_qkv.weight" in key for _, key, _ in saved)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for (s, _, _), t in saved.items() if s in ("L", "R"))


def test_resume_at_dp2_is_bit_exact_in_every_format(pools, saved_at_dp2):
    path, straight = saved_at_dp2
    loaded = pools(2).run(ccs.run_load, path, BEFORE, AFTER, timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
        _same(straight["params"], res["params"], f"{fmt}: params after the continuation")


def test_loaded_at_dp3_the_new_homes_hold_the_saved_state(pools, saved_at_dp2):
    path, straight = saved_at_dp2
    loaded = pools(3).run(ccs.run_load, path, BEFORE, 0, ("fully_reshardable", "megatron_opt"), timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{fmt} at DP3: the loaded per-matrix state")


def test_tp2_resume_is_bit_exact(pools, tmp_path):
    path = str(tmp_path / "tp2")
    straight = pools(4).run(ccs.run_save, path, BEFORE, AFTER, "tp2", timeout=TIMEOUT)[0]
    assert {tp for _, _, tp in straight["saved"]} == {0, 1}
    loaded = pools(4).run(ccs.run_load, path, BEFORE, AFTER, ("fully_reshardable", "megatron_opt"), "tp2",
                          timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"TP2 {fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
    # at TP1 the blocks are other matrices: megatron_opt.checkpoint refuses on every rank, naming the state and the
    # way on (the model alone); torch_dist too
    for message in pools(4).run(ccs.load_refused, path, "megatron_opt", "dp", timeout=TIMEOUT):
        assert "CheckpointError" in message and "per-matrix state" in message and "tensor-parallel" in message, message
        assert "--no-load-optim" in message, message
    messages = set(pools(4).run(ccs.load_refused, path, "fully_reshardable", "dp", timeout=TIMEOUT))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "CheckpointError" in message and "per-matrix state" in message and "--no-load-optim" in message, message
