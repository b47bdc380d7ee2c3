"""megatron_opt's AdaptiveMuon with NorMuon's per-matrix second moment (adaptive_muon_moment2_method='normuon')
under tensor (+sequence) and pipeline parallelism, on megatron-core's GPTModel inside megatron-core's schedule
(megatron_opt switched in by install()), both overlaps on, against the float64 reference of the whole model
(tests/support/reference_adaptive_muon.py: NorMuon on each TP-local block of O, as megatron-core's
TensorParallelAdaptiveMuon does at every muon_tp_mode). The harness is tests/mcore/cases_muon_model_parallel.py.

Every step: params, momentum, grad norm (Muon's bounds); after the last: the second moment at every home against
the reference's block, and every (matrix, TP block) homed exactly once per data-parallel group.
"""
from __future__ import annotations

import pytest

from tests.mcore import cases_muon_expert_parallel as cme
from tests.mcore import cases_muon_model_parallel as cmm
from tests.mcore.test_muon_expert_parallel import check as check_ep
from tests.mcore.test_muon_model_parallel import check

TIMEOUT = 300
# Measured (torch 2.14 CPU, 3 steps, fp32 Newton-Schulz 'highest'): params 3.4e-6 .. 4.6e-6, momentum 4.3e-7 ..
# 6.1e-7, grad norm <= 5.6e-8 (Muon's bounds hold); the second moment 9.8e-7 .. 2.7e-6 of its norm.
MOMENT2 = 1e-5

CASES = [("tp2", "duplicated"), ("tp2", "blockwise"), ("tp2_sp", "distributed"), ("pp2_vp2", "blockwise")]


def _check_moment2(results: list) -> None:
    assert max(r["moment2_error"] for r in results) <= MOMENT2, [r["moment2_error"] for r in results]
    homed = [tuple(h) for r in results for h in r["moment2_homed"]]
    assert len(homed) == len(set(homed)), homed  # once per data-parallel group (each TP rank's group its own)
    muon = set().union(*(r["muon_params"] for r in results))
    assert {name for name, _ in homed} == muon, (homed, muon)


@pytest.mark.parametrize("layout, tp_mode", CASES, ids=[f"{layout}-{mode}" for layout, mode in CASES])
def test_normuon_model_parallel_matches_float64_reference(pools, layout, tp_mode):
    results = pools(4).run(cmm.run_muon, layout, 3, tp_mode=tp_mode, optimizer="adaptive_muon",
                           moment2_method="normuon", timeout=TIMEOUT)
    check(results, 3)
    _check_moment2(results)


def test_normuon_tensor_parallel_verify_mode(pools):
    """Verify mode at TP2 duplicated: O recomputed in float64 across TP, then NorMuon on the TP-local block."""
    results = pools(4).run(cmm.run_muon, "tp2", 2, tp_mode="duplicated", verify=True, optimizer="adaptive_muon",
                           moment2_method="normuon", timeout=TIMEOUT)
    check(results, 2)
    assert all(r["verified"] == 2 for r in results), [r["verified"] for r in results]


def test_normuon_expert_parallel_ep2_under_dp4(pools):
    """EP 2 under DP 4 (expert DP 2): the experts' NorMuon moments at homes in the expert data-parallel group."""
    chain = [("adaptive_muon", False), ("adam", False), ("adaptive_muon", True), ("adam", True)]
    check_ep(pools(4).run(cme.run_muon_ep, "ep2", 3, optimizer="adaptive_muon", moment2_method="normuon",
                          timeout=TIMEOUT), 3, chain=chain)
