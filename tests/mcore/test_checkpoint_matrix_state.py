"""Per-matrix state (each held whole by its matrix's home) through Megatron-LM's torch_dist ('fully_reshardable' and
'dp_reshardable') and megatron_opt.checkpoint, on megatron-core's GPTModel through install()
(tests/mcore/cases_checkpoint_matrix_state.py), for each rule that keeps it: SOAP's (Kronecker factors, eigenbases,
rotated Adam moments) and AdaptiveMuon's NorMuon second moment (per row of each matrix):

* saved at DP2, loaded at DP2: the per-matrix state bitwise, and the continuation bit-exact (losses, params);
* loaded at DP3 (other homes): every per-matrix state tensor bitwise the saved one, each homed once;
* at TP2 x DP2 (each TP block's own state, placed at its block's coordinates; NorMuon with muon_tp_mode
  'duplicated': O across TP, the moment per TP-local block): a resume bit-exact; a TP1 load refused on every rank,
  naming the ways on;
* TP2 -> TP1 -> TP2: a TP1 run with matrix_state_tp_size 2 (it keeps the TP2 blocks' state, and the rule's stateful
  part runs on each) loads the TP2 checkpoint bitwise (torch_dist and megatron_opt.checkpoint), trains on, and its
  own torch_dist checkpoint loads back at TP2 bitwise.
"""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_matrix_state as ccs
from tests.support.common import the_same_on_every_rank

BEFORE, AFTER = 2, 2
TIMEOUT = 300
NORMUON = {"adaptive_muon_moment2_method": "normuon"}
# rule -> (optimizer, OptimizerConfig fields, at TP2 also, the per-matrix state's names)
RULES = {
    "soap": ("soap", {}, {}, {"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"}),
    "normuon": ("adaptive_muon", NORMUON, {"tp_mode": "duplicated"}, {"moment2_buffer"}),
}


@pytest.fixture(scope="module", params=sorted(RULES))
def saved_at_dp2(request, pools, tmp_path_factory):
    optimizer, extra, _, _ = RULES[request.param]
    path = str(tmp_path_factory.mktemp(f"{request.param}_dp2"))
    return request.param, path, pools(2).run(ccs.run_save, path, BEFORE, AFTER, "dp", optimizer, extra,
                                             timeout=TIMEOUT)[0]


def _same(expected: dict, actual: dict, what: str) -> None:
    assert expected.keys() == actual.keys(), what
    for key, tensor in expected.items():
        assert torch.equal(tensor, actual[key]), f"{what}: {key} differs"


def test_the_saved_state_is_the_rules(saved_at_dp2):
    rule, _, straight = saved_at_dp2
    saved = straight["saved"]
    assert {state for state, _, _ in saved} == RULES[rule][3]
    assert any("linear_qkv.weight" in key for _, key, _ in saved)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for (s, _, _), t in saved.items() if s in ("L", "R"))
    if rule == "normuon":  # one moment per row (or column) of each matrix
        assert all(1 in t.shape and t.abs().sum() > 0 for t in saved.values())


def test_resume_at_dp2_is_bit_exact_in_every_format(pools, saved_at_dp2):
    rule, path, straight = saved_at_dp2
    optimizer, extra, _, _ = RULES[rule]
    loaded = pools(2).run(ccs.run_load, path, BEFORE, AFTER, ccs.ccm.FORMATS, "dp", optimizer, extra,
                          timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{rule} {fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
        _same(straight["params"], res["params"], f"{rule} {fmt}: params after the continuation")


def test_loaded_at_dp3_the_new_homes_hold_the_saved_state(pools, saved_at_dp2):
    rule, path, straight = saved_at_dp2
    optimizer, extra, _, _ = RULES[rule]
    loaded = pools(3).run(ccs.run_load, path, BEFORE, 0, ("fully_reshardable", "megatron_opt"), "dp", optimizer,
                          extra, timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"{rule} {fmt} at DP3: the loaded per-matrix state")


def as_tp2_blocks(loaded_at_tp1: dict) -> dict:
    """A TP1 run's per-matrix state keyed as TP2's: a TP-split matrix's block at offset 0 is TP rank 0's, the other
    TP rank 1's; a matrix whole at TP2 (replicated) is each TP rank's."""
    out = {}
    for (state, key, _), t in loaded_at_tp1.items():
        if "@" in key:
            name, offset = key.split("@")
            out[(state, name, int(any(int(o) for o in offset.split(","))))] = t
        else:
            out[(state, key, 0)] = out[(state, key, 1)] = t
    return out


@pytest.mark.parametrize("rule", sorted(RULES))
def test_tp2_resume_is_bit_exact_and_tp1_keeps_its_blocks_or_is_refused(pools, tmp_path, rule):
    optimizer, extra, at_tp2, _ = RULES[rule]
    tp2 = {**extra, **at_tp2}
    path, resaved = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    straight = pools(4).run(ccs.run_save, path, BEFORE, AFTER, "tp2", optimizer, tp2, timeout=TIMEOUT)[0]
    assert {tp for _, _, tp in straight["saved"]} == {0, 1}
    loaded = pools(4).run(ccs.run_load, path, BEFORE, AFTER, ("fully_reshardable", "megatron_opt"), "tp2", optimizer,
                          tp2, timeout=TIMEOUT)[0]
    for fmt, res in loaded.items():
        _same(straight["saved"], res["loaded"], f"TP2 {fmt}: the loaded per-matrix state")
        assert res["losses"] == straight["losses"], fmt
    # at TP1 the blocks are other matrices: each format refuses on every rank, naming the state and the ways on
    for fmt in ("megatron_opt", "fully_reshardable"):
        message = the_same_on_every_rank(pools(4).run(ccs.load_refused, path, fmt, "dp", optimizer, extra,
                                                      timeout=TIMEOUT))
        assert "CheckpointError" in message and "per-matrix state" in message and "tensor-parallel" in message, message
        assert "--no-load-optim" in message and "matrix_state_tp_size" in message, message
    # keeping the TP2 blocks, TP1 loads it bitwise, trains on, and its own checkpoint loads back at TP2 bitwise
    keep = {**extra, "rule_constants": {"matrix_state_tp_size": 2}}
    at_tp1 = pools(4).run(ccs.run_load, path, BEFORE, 2, ("fully_reshardable", "megatron_opt"), "dp", optimizer, keep,
                          resaved, timeout=TIMEOUT)[0]
    saved_at = {k: t for k, t in straight["saved"].items()}
    for fmt, res in at_tp1.items():
        assert all("@" in key for _, key, _ in res["loaded"] if "linear_fc1" in key), sorted(res["loaded"])[:4]
        _same(saved_at, as_tp2_blocks(res["loaded"]), f"TP2 -> TP1 {fmt}: the loaded per-matrix state")
        assert all(loss is not None and torch.isfinite(torch.tensor(loss)) for loss in res["losses"]), res["losses"]
    # (megatron_opt.checkpoint names a data-parallel-only save's params locally, so only torch_dist goes TP1 -> TP2)
    back = pools(4).run(ccs.run_load, resaved, BEFORE, 0, ("fully_reshardable",), "tp2", optimizer, tp2,
                        timeout=TIMEOUT)[0]
    for fmt, res in back.items():
        _same(saved_at, res["loaded"], f"TP2 -> TP1 -> TP2 {fmt}: the loaded per-matrix state")
