"""megatron_opt's sharded Muon under expert parallelism on megatron-core's MoE GPTModel (its token
dispatcher, schedule and finalize_model_grads; megatron_opt switched in by install()), with
overlap_grad_reduce and overlap_param_gather, against the float64 reference of the whole model (all
experts; tests/support/reference_muon.py) on the same global batches: params and Muon momentum, dense and
expert apart, and the grad norm every step; after the last step DP and expert-DP replicas bitwise equal.
The harness is tests/mcore/cases_muon_expert_parallel.py (``run_muon_ep``).

Bounds: test_muon_model_parallel.py's (fp32, muon_fp32_matmul_prec='highest').
"""
from __future__ import annotations

import pytest

from tests.mcore import cases_muon_expert_parallel as cme
from tests.mcore.test_muon_model_parallel import MOMENTUM, NORM, PARAM

TIMEOUT = 300
CHAIN = [("muon", False), ("adam", False), ("muon", True), ("adam", True)]


def check(results: list, steps: int, chain: list = CHAIN) -> dict:
    figs = {key: max(max(r[key]) for r in results)
            for key in ("param", "expert_param", "momentum", "expert_momentum", "norm")}
    cme.assert_every_rank_ran(results, steps, chain)
    assert figs["param"] <= PARAM and figs["expert_param"] <= PARAM, figs
    assert figs["momentum"] <= MOMENTUM and figs["expert_momentum"] <= MOMENTUM, figs
    assert figs["norm"] <= NORM, figs
    experts = set().union(*(r["expert_muon_params"] for r in results))
    assert len(experts) >= 16, experts  # 2 layers x 4 experts x (fc1, fc2)
    return figs


def test_muon_expert_parallel_ep2_under_dp4(pools):
    """EP 2 under DP 4 (expert DP 2), megatron-core's all-to-all dispatcher."""
    check(pools(4).run(cme.run_muon_ep, "ep2", 3, timeout=TIMEOUT), 3)


@pytest.mark.parametrize("tp_mode", ["duplicated"])
def test_muon_expert_tensor_parallel_etp2(pools, tp_mode):
    """EP 2 with expert TP 2 (expert DP 1): the expert matrices are orthogonalised across the expert-TP
    group (the full matrix, as the TP-1 reference). megatron-core allows expert biases only at expert TP
    1, so every expert param is a matrix: no expert AdamW child."""
    check(pools(4).run(cme.run_muon_ep, "ep2_etp2", 3, tp_mode=tp_mode, timeout=TIMEOUT), 3, chain=CHAIN[:3])
