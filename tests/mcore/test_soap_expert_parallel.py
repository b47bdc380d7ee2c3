"""megatron_opt's sharded SOAP under expert parallelism on megatron-core's MoE GPTModel (its token dispatcher,
schedule and finalize_model_grads; megatron_opt switched in by install()), with overlap_grad_reduce and
overlap_param_gather, against the float64 reference of the whole model (tests/support/reference_soap.py) on the
same global batches. The harness and why SOAP's eps is large here: tests/mcore/cases_soap_expert_parallel.py.

Checked every step: params (dense and expert apart), the grad norm, and the per-matrix state independent of the
eigenbases (L, R, exp_avg in the parameter basis) of every matrix (every TP block of one) as its home keeps it: each
homed exactly once per (expert) data-parallel group; after the last step DP and expert-DP replicas bitwise equal.
"""
from __future__ import annotations

from tests.mcore import cases_muon_expert_parallel as cme
from tests.mcore import cases_soap_expert_parallel as cse

TIMEOUT = 300
STEPS = 3
# Measured (torch 2.14 CPU, fp32 against float64, 3 steps; printed with -s): EP2: params 1.9e-5 dense (AdamW's
# embedding included) / 4.3e-6 expert of their change; ETP2: 9e-6 / 4.4e-4 (the expert blocks' change is mostly
# weight decay, ~3e-5 in norm, and fp32's rounding of W is ~2e-8 of it); per-matrix state 1.1e-6 (EP2) / 1.2e-6
# (ETP2) of its norm; grad norm 3.9e-8 (relative). The bounds leave about 2-5x; the grad norm's is
# test_muon_model_parallel.py's.
PARAM, STATE, NORM = 1e-3, 5e-6, 1e-6


def check(results: list, chain: list) -> dict:
    figs = {key: max(max(r[key]) for r in results) for key in ("param", "expert_param", "factors", "norm")}
    cme.assert_every_rank_ran(results, STEPS, chain)
    assert figs["param"] <= PARAM and figs["expert_param"] <= PARAM, figs
    assert figs["factors"] <= STATE, figs
    assert figs["norm"] <= NORM, figs
    experts = {ref for ref, _ in results[0]["homed_matrices"] if ".experts." in ref}
    assert len(experts) >= 16, experts  # 2 layers x 4 experts x (fc1, fc2)
    return figs


def test_soap_expert_parallel_ep2_under_dp4(pools):
    """EP 2 under DP 4 (expert DP 2), megatron-core's all-to-all dispatcher: [dense SOAP, dense AdamW, expert SOAP,
    expert AdamW]."""
    results = pools(4).run(cse.run_soap_ep, "ep2", STEPS, timeout=TIMEOUT)
    print(check(results, [("soap", False), ("adam", False), ("soap", True), ("adam", True)]))


def test_soap_expert_tensor_parallel_etp2(pools):
    """EP 2 with expert TP 2 (expert DP 1): each expert matrix's TP block is its own SOAP matrix (megatron-core's
    SOAP under TP), homed with its block's state; no expert AdamW child (expert biases need expert TP 1)."""
    results = pools(4).run(cse.run_soap_ep, "ep2_etp2", STEPS, timeout=TIMEOUT)
    print(check(results, [("soap", False), ("adam", False), ("soap", True)]))
