"""Verify mode on gloo pools: each check catches the fault it is for, on every rank together and
within the case timeout (a hang fails the test); "warn" goes on bitwise as without verify mode; the
interval is honoured; skipped steps are verified to change nothing; verify mode never changes results."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import cases_verify
from tests.support.common import the_same_on_every_rank

TIMEOUT_S = 120  # every rank must finish (raise or go on) within this


def _raised_everywhere(results: list, check: str, param: str, rank: int) -> str:
    """Every rank raised the same VerificationError naming the check, the param and the rank at fault."""
    assert [r["error"] for r in results] == ["VerificationError"] * len(results), [r["error"] for r in results]
    assert not any(r["is_rank_error"] for r in results)
    message = the_same_on_every_rank(r["message"] for r in results)
    assert f"{check}: param '{param}', rank {rank} at fault" in message, message
    assert "max abs diff" in message and "max rel diff" in message, message
    return message


@pytest.mark.parametrize("world, k", [(2, 1), (3, 1), (4, 2)])
def test_replica_names_the_perturbed_param_and_rank(pools, world, k):
    results = pools(world).run(cases_verify.run, "replica", k=k, timeout=TIMEOUT_S)
    message = _raised_everywhere(results, "replica", cases_verify.REPLICA_TARGET, world - 1)
    assert "differ from the copy of the owner rank" in message, message
    assert all(r["reports"] == results[0]["reports"] for r in results)
    assert len(results[0]["reports"]) == 1  # the fault came before call 2: call 1 passed, call 2 raised


@pytest.mark.parametrize("chained", [False, True])
def test_update_catches_a_compute_fault_on_one_rank(pools, chained):
    results = pools(2).run(cases_verify.run, "update", chained=chained, timeout=TIMEOUT_S)
    message = _raised_everywhere(results, "update", results[1]["target"], 1)
    assert "float64 recomputation" in message


@pytest.mark.parametrize("precision, k", [("bf16", 1), ("fp16", 2)])
def test_cast_catches_a_master_changed_between_steps(pools, precision, k):
    world = 2 * k
    results = pools(world).run(cases_verify.run, "cast", precision=precision, k=k, timeout=TIMEOUT_S)
    _raised_everywhere(results, "cast", results[-1]["target"], world - 1)


def test_cast_under_a_chained_optimizer(pools):
    results = pools(2).run(cases_verify.run, "cast", chained=True, timeout=TIMEOUT_S)
    _raised_everywhere(results, "cast", results[1]["target"], 1)


def test_update_catches_a_master_written_during_the_step(pools):
    results = pools(2).run(cases_verify.run, "master_in_step", timeout=TIMEOUT_S)
    _raised_everywhere(results, "update", results[1]["target"], 1)


@pytest.mark.parametrize("fault", ["replica", "update", "cast"])
def test_warn_logs_on_every_rank_and_goes_on_bitwise(pools, fault):
    """With "warn", every rank logs the same WARNING and training goes on exactly as it would
    without verify mode (the same fault, verify off)."""
    results = pools(2).run(cases_verify.run_pair, fault, action="warn", steps=4, timeout=TIMEOUT_S)
    for r in results:
        assert r["same"], "verify mode (warn) changed the training"
        assert r["on"]["error"] is None and r["off_error"] is None, r
        assert len(r["on"]["warnings"]) == 1 and fault in r["on"]["warnings"][0], r["on"]["warnings"]
        assert [rep["checks"] for rep in r["on"]["reports"]] == [[], [fault], [], []]
    assert len({r["on"]["warnings"][0] for r in results}) == 1


def test_interval_runs_the_checks_on_exactly_the_nth_calls(pools):
    """N=3 over 8 calls, a fault injected before every call and a skipped step at call 4: findings
    show on calls 3 and 6 only, and the public counter tracks the calls, skipped ones included."""
    results = pools(2).run(cases_verify.run, "cast", action="warn", interval=3, steps=8,
                           fault_calls=tuple(range(1, 9)), timeout=TIMEOUT_S)
    for r in results:
        reps = r["reports"]
        assert [rep["calls"] for rep in reps] == list(range(1, 9))
        assert [rep["last"] for rep in reps] == [None, None, 3, 3, 3, 6, 6, 6]
        assert [rep["verified"] for rep in reps] == [0, 0, 1, 1, 1, 2, 2, 2]
        assert [rep["checks"] for rep in reps] == [[], [], ["cast"], ["cast"], ["cast"], ["cast"], ["cast"], ["cast"]]
        assert len(r["warnings"]) == 2


def test_interval_counts_skipped_steps(pools):
    results = pools(2).run(cases_verify.run, "skip", interval=2, steps=4, fault_calls=(2,), timeout=TIMEOUT_S)
    for r in results:
        assert r["error"] is None, r["message"]
        assert [rep["success"] for rep in r["reports"]] == [True, False, True, True]
        assert [rep["last"] for rep in r["reports"]] == [None, 2, 2, 4]


def test_skipped_step_is_verified_to_change_nothing(pools):
    """A skipped step passes verification (it never raises by itself); a master written during a
    skipped step does not."""
    clean = pools(2).run(cases_verify.run, "skip", steps=3, timeout=TIMEOUT_S)
    for r in clean:
        assert r["error"] is None, r["message"]
        assert [rep["success"] for rep in r["reports"]] == [True, False, True]
        assert [rep["last"] for rep in r["reports"]] == [1, 2, 3]
    changed = pools(2).run(cases_verify.run, "skip_change", steps=3, timeout=TIMEOUT_S)
    message = _raised_everywhere(changed, "update", changed[1]["target"], 1)
    assert "the step was skipped but" in message


@pytest.mark.parametrize("world, options", [
    (1, dict(precision="fp32")),
    (2, dict(precision="bf16", overlap=True)),
    (2, dict(precision="bf16", chained=True, optimizer="lion")),
    (2, dict(precision="fp32", optimizer="sgd")),
    (2, dict(precision="bf16", use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
             exp_avg_sq_dtype=torch.bfloat16)),
    (4, dict(precision="fp16", k=2, overlap=True)),
    (2, dict(precision="bf16", device_step=True)),
])
def test_verify_interval_1_is_bitwise_interval_0(pools, world, options):
    results = pools(world).run(cases_verify.run_pair, steps=4, **options, timeout=TIMEOUT_S)
    for r in results:
        assert r["on"]["error"] is None, r["on"]["message"]
        assert r["same"]
        assert r["on"]["reports"][-1]["verified"] == 4 and r["on"]["reports"][-1]["checks"] == []


@pytest.mark.parametrize("device_step", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_overflow_clip_and_norm_skips_pass_and_change_nothing(pools, device_step, precision):
    """The step schedule of the device-step tests (lr changes, clipping, an overflow on one rank, a
    norm over the threshold; dynamic loss scaling in fp16), verified at every call: no finding, and
    bitwise the run without verify mode, on the host API and on the device-decided step."""
    results = pools(2).run(cases_verify.schedule_pair, device_step, precision, timeout=TIMEOUT_S)
    for r in results:
        assert r["same"]
        assert any(r["skipped"]) and not all(r["skipped"])
        assert r["report"] == (len(r["skipped"]), 0)


def test_custom_rule_needs_a_float64_recompute(pools):
    (result,) = pools(1).run(cases_verify.custom_rule_without_recompute, timeout=TIMEOUT_S)
    for name in ("SignSGD", "AdamWVariant"):
        kind, message = result[name]
        assert kind == "UnsupportedConfigError", result
        assert "float64_update" in message and "verify_interval" in message, message
