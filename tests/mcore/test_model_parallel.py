"""megatron_opt under model parallelism inside Megatron-LM's own loop: megatron-core 0.16.1's GPTModel split
by tensor (+sequence), pipeline (1F1B, interleaved) and expert parallelism, megatron-core's schedule and
finalize_model_grads, megatron_opt switched in by install(); against a float64 single-process reference of
the whole model, with megatron-core's own DDP + DistributedOptimizer on the same harness as calibration.

Each case checks per-step loss and grad norm, the update after 4 steps, DP (and expert-DP) replicas
bitwise equal, TP copies of replicated params bitwise equal and the last stage's tied output weight equal
to the first stage's embedding. The cases cover fp32/bf16, overlap on/off and per-token/mean loss over
the layouts without taking their cross product.
"""
from __future__ import annotations

import pytest

from tests.mcore import mcore_cpu  # noqa: F401  (patches megatron-core for CPU only inside its context manager)
from tests.mcore import cases_model_parallel as cmp
from tests.support.megatron_lm_configs import installed_label

OURS, CORE = "megatron_opt", "megatron_core"
# Tolerances, calibrated by megatron-core's own optimizer on this harness (which meets them: asserted below).
LOSS_ATOL = {False: 1e-6, True: 1e-3}  # keyed by bf16; megatron-core's max: fp32 3.5e-7, bf16 1.0e-4
NORM_RTOL = {False: 1e-6, True: 5e-3}  # megatron-core's max: fp32 7e-8, bf16 1.3e-3
# The zero count may differ from float64's by elements that round to (or away from) exactly zero: the
# key projection's bias has an exactly zero gradient in exact arithmetic (softmax ignores it), so in fp32
# each of its elements is 0 or ~1e-10 by chance (megatron-core's own count is off by 1-3 here). Counting a
# TP-duplicated or tied copy again instead adds whole params' zeros (32 per position-embedding row here).
def zeros_slack(reference: int) -> float:
    return 4 + 0.05 * reference


FP32_UPDATE_FACTOR = 2.0  # fp32 update error within this many times megatron-core's (or plain fp32 torch's, ~1.2e-6)
BF16_UPDATE_FACTOR = 1.5  # bf16 model params against float64: within this many times megatron-core's (~4.7e-2)
# megatron-core 0.16.1 filters replicated expert params (the experts' fc2 biases) by the *dense* TP rank
# (Megatron-LM #5916/#6470): its grad norm misses the reference here by ~3.5%; ours must not. 0.19.2 is fixed.
CORE_EXPERT_NORM_BUG = {"tp2_sp_ep2_etp1"} if installed_label() == "core_v0.16.1" else set()

# (layout, per_token, overlap, bf16, world size): a covering set, not the cross product.
CASES = [
    ("tp2", False, False, False, 4),
    ("tp2_sp", True, True, False, 4),
    ("tp2_sp", True, False, True, 4),
    ("pp2", True, True, False, 4),
    ("pp2", False, False, True, 4),
    ("pp2_vp2", True, False, False, 4),
    ("pp2_vp2", False, True, False, 4),
    ("ep2", False, True, False, 4),
    ("tp2_sp_ep2_etp1", True, False, False, 4),
    ("ep2_etp2", True, True, False, 4),
    ("tp2_sp", False, True, False, 2),
    ("pp2_vp2", True, False, False, 2),
    ("ep2_allgather", True, False, False, 2),
]


def _case_id(case) -> str:
    layout, per_token, overlap, bf16, world = case
    return "-".join([layout, "per_token" if per_token else "mean_loss", "overlap" if overlap else "sync",
                     "bf16" if bf16 else "fp32", f"world{world}"])


def figures(results: list, impl: str) -> dict:
    """The worst figures over the ranks: loss error (last stages), relative grad-norm error, update error,
    and which replica checks failed on some rank."""
    ref = results[0]["reference"]
    mine = [r[impl] for r in results]
    losses = [abs(a - b) for r in mine if r["losses"][0] is not None for a, b in zip(r["losses"], ref["losses"])]
    assert losses, "no rank reported the loss"
    checks = [k for k, v in mine[0].items() if isinstance(v, bool)]
    return {"loss": max(losses),
            "norm": max(abs(a - b) / b for r in mine for a, b in zip(r["norms"], ref["norms"])),
            "update": mine[0]["update_error"], "fp32_torch": ref["fp32_torch_error"],
            "zero_counts": [r["zeros"] for r in mine], "reference_zeros": ref["zeros"],
            "failed_checks": sorted(k for k in checks if not all(r[k] for r in mine)),
            "modules": {r["optimizer_module"].split(".")[0] + "." + r["optimizer_module"].split(".")[1] for r in mine},
            "same_update_everywhere": len({r["update_error"] for r in mine}) == 1}


def zeros_excess(ours: dict, core: dict) -> float:
    """How far the zero count (--log-num-zeros-in-grad) of any rank and step is beyond the slack from both
    the float64 count of the whole model and megatron-core's own count (the calibration; in bf16 both
    count underflowed grads the float64 model does not have)."""
    ref = ours["reference_zeros"]
    return max(min(abs(mine - r), abs(mine - theirs)) - zeros_slack(r)
               for rank_mine, rank_theirs in zip(ours["zero_counts"], core["zero_counts"])
               for mine, theirs, r in zip(rank_mine, rank_theirs, ref))


def check_parity(figs: dict, bf16: bool, update_bound: float) -> None:
    assert figs["norm"] <= NORM_RTOL[bf16], f"grad norm off the reference: {figs}"
    assert figs["loss"] <= LOSS_ATOL[bf16], f"loss off the reference: {figs}"
    assert figs["update"] <= update_bound, f"update off the reference (bound {update_bound:.3g}): {figs}"
    assert not figs["failed_checks"], f"replicas that should be bitwise equal differ: {figs}"
    assert figs["same_update_everywhere"], figs


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c), marks=[pytest.mark.slow] if c[4] == 2 else [])
                                  for c in CASES])
def test_model_parallel_gpt_matches_float64_reference(pools, case):
    layout, per_token, overlap, bf16, world = case
    results = pools(world).run(cmp.run_layout, layout, per_token, overlap, bf16, (CORE, OURS))
    ours, core = figures(results, OURS), figures(results, CORE)
    assert ours["modules"] == {"megatron_opt.optimizer"} and core["modules"] == {"megatron.core"}, (ours, core)
    if bf16:
        bound = BF16_UPDATE_FACTOR * core["update"]
    elif layout in CORE_EXPERT_NORM_BUG:
        bound = FP32_UPDATE_FACTOR * ours["fp32_torch"]
    else:
        bound = FP32_UPDATE_FACTOR * max(core["update"], core["fp32_torch"])
    check_parity(ours, bf16, bound)
    assert zeros_excess(ours, core) <= 0, f"zero count off float64's and megatron-core's: {ours} {core}"
    # The calibration: megatron-core's own optimizer meets the same tolerances on the same harness ...
    if layout in CORE_EXPERT_NORM_BUG:  # ... except for its expert-norm bug, which shows here
        assert core["norm"] > 1e-2, core
    else:
        check_parity(core, bf16, bound if bf16 else FP32_UPDATE_FACTOR * core["fp32_torch"])


@pytest.mark.slow  # 2-3 minutes: a control of the checks above, not of megatron_opt
@pytest.mark.parametrize("sabotage, layout, broken_check", [
    ("no_tp_sum", "tp2_sp", "tp_copies_equal"),
    ("no_embedding_allreduce", "pp2", "tied_embedding_equal"),
])
def test_checks_catch_a_missing_model_parallel_reduction(pools, sabotage, layout, broken_check):
    """With one of finalize_model_grads' reductions switched off (test-side), the parity checks fail."""
    results = pools(4).run(cmp.run_layout, layout, True, False, False, (OURS,), sabotage=sabotage)
    figs = figures(results, OURS)
    assert broken_check in figs["failed_checks"], figs
    assert figs["update"] > 1e3 * figs["fp32_torch"], figs
    with pytest.raises(AssertionError):
        check_parity(figs, False, FP32_UPDATE_FACTOR * figs["fp32_torch"])
