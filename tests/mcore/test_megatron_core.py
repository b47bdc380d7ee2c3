"""megatron_opt inside Megatron-LM's own loop: megatron-core 0.16.1's GPTModel, schedule and
finalize_model_grads driving our DDP and optimizer, built through megatron-core's call shapes and
config objects; install() switching megatron-core's names over."""
from __future__ import annotations

import pytest

# CI installs megatron-core: import it unconditionally so that a missing dependency fails loudly.
from tests.mcore import mcore_cpu  # noqa: F401  (patches megatron-core for CPU only inside its context manager)
from tests.mcore import cases_megatron as cm

DP_SIZES = (1, 2)
FP32_FACTOR = 2.0  # ours may be at most this many times further from float64 than fp32 torch AdamW
BF16_UPDATE_TOL = 2e-2  # bf16 forward/backward against a float64 model (tests/distributed/test_parity.py's bf16 figure)


def _check(result: dict, bf16: bool) -> None:
    for step, (success, norm, ref_norm) in enumerate(result["norms"]):
        assert success, f"step {step} skipped"
        # The norm catches a wrong gradient scale directly (1/DP too small halves it at DP=2).
        assert norm == pytest.approx(ref_norm, rel=2e-3 if bf16 else 1e-6), f"step {step}: grad norm"
    if bf16:
        assert result["update_error"] <= BF16_UPDATE_TOL, result
    else:
        assert result["update_error"] <= FP32_FACTOR * result["fp32_torch_error"], result


@pytest.mark.parametrize("dp", DP_SIZES)
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "mean_loss"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_gpt_model_megatron_schedule_parity(pools, dp, per_token, overlap):
    results = pools(dp).run(cm.run_parity, per_token, overlap, False)
    for rank, result in enumerate(results):
        _check(result, bf16=False)
    assert results[0]["update_error"] == results[-1]["update_error"]


@pytest.mark.parametrize("dp", DP_SIZES)
def test_gpt_model_bf16_float16module_parity(pools, dp):
    for result in pools(dp).run(cm.run_parity, True, False, True):
        _check(result, bf16=True)


def test_install_switches_megatron_core_names(pools):
    out = pools(1).run(cm.run_unwrap_and_install)[0]
    assert out["late_import_is_ours"] and out["early_import_is_ours"] and out["early_factory_is_ours"], out
    assert out["wrapper_tuple_has_ours"], out
    assert out["optimizer_type"] == "ChainedOptimizer", out  # megatron-core's factory always chains
    assert out["unwrap_is_model"], out
    assert out["buckets"] == 1, out  # disable_bucketing
    assert out["restored"], out
    assert not out["unwrap_after_uninstall_is_model"], out  # megatron-core alone does not know our wrapper


def test_installed_megatron_core_path_equals_direct_use(pools):
    assert all(pools(2).run(cm.run_installed_equals_direct))
