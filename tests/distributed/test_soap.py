"""SOAP (optimizer='soap', emerging-optimizers' SOAP as megatron-core configures it) through the distributed
optimizer at DP 1-4 (3: uneven padding; matrices straddling the shards, each homed on one rank with its per-matrix
state), fed exact gradients, against emerging-optimizers' SOAP fed the same bits (tests/distributed/cases_soap.py
says why SOAP cannot be compared against float64 or across roundings); its per-matrix state through state_dict()
and megatron_opt.checkpoint, resharded.

Bounds: the params within 1e-5 of their change since the start (measured <= 1.2e-6: emerging's inner Adam is
torch.compile'd, whose lerp rounds otherwise than eager's, and its eigenbases keep eigh's column-major layout where
the leaf stores every state contiguous, so a GEMM may round otherwise); the Kronecker factors L and R 1e-6 of their
norm (bitwise but for such a GEMM); the grad norm 1e-6 (the norm of an exact gradient). Break on purpose (the leaf
keeps the old per-matrix state; the step count not advanced): the params move by O(1) of their change.
"""
import pytest
import torch

import megatron_opt.checkpoint as ckpt
from tests.distributed import cases_soap
from tests.support.common import the_same_on_every_rank

PARAM, FACTOR, NORM = 1e-5, 1e-6, 1e-6
TIMEOUT = 240


def _check(results, steps, instances=1, homed_keys=cases_soap.MATRICES):
    homed = []
    for rank, res in enumerate(results):
        assert res["success"] == [True] * steps
        for step, (perr, ferr, nerr) in enumerate(zip(res["param_err"], res["factor_err"], res["norm_err"])):
            assert nerr <= NORM, f"rank {rank} step {step}: grad norm rel {nerr}"
            for name, e in perr.items():
                assert e <= PARAM, f"rank {rank} step {step} {name}: param error {e} of the change"
            for name, e in ferr.items():
                assert e <= FACTOR, f"rank {rank} step {step} {name}: Kronecker factor error {e} of its norm"
        homed += res["homed"]
    assert sorted(homed) == sorted(homed_keys * instances)  # every matrix (block) homed once per instance


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_soap_matches_emerging_optimizers_soap(pools, world):
    _check(pools(world).run(cases_soap.train, 5, timeout=TIMEOUT), 5)


@pytest.mark.parametrize("world", [1, 3])
def test_soap_keeping_the_blocks_of_a_tp2_split_runs_on_each_block(pools, world):
    """matrix_state_tp_size 2 at TP1 (a TP2 checkpoint's state, loaded): each TP-split matrix's state is its TP2
    blocks' (rows of 'a', columns of 'b'; 'c' whole), each block homed once and stepped as emerging-optimizers'
    SOAP steps that block alone (plain Shampoo: the halves are rank-deficient, where KL-Shampoo inverts rounding
    noise and no two implementations agree; cases_soap.BLOCKS_EPS)."""
    _check(pools(world).run(cases_soap.train, 4, use_kl_shampoo=False, blocks=True, timeout=TIMEOUT), 4,
           homed_keys=cases_soap.HOMED_BLOCKS)


@pytest.mark.parametrize("change, match", [
    ("size", "matrix_state_tp_size=3: a.weight of shape (10, 10) does not cut into 3 blocks along dim 0"),
    ("stride", "matrix_state_tp_size=2: a.weight is split over tensor parallelism with stride 2 (SwiGLU"),
])
def test_kept_blocks_the_layout_cannot_cut_are_refused_on_every_rank(pools, change, match):
    """The same UnsupportedConfigError on every rank, naming the param and the way on; every rank finishes (the
    pool's timeout bounds it)."""
    message = the_same_on_every_rank(pools(2).run(cases_soap.blocks_refused, change, timeout=TIMEOUT))
    assert message.startswith("UnsupportedConfigError") and match in message, message


def test_soap_keeping_the_blocks_of_a_tp2_split_passes_verify_mode_with_kl_shampoo(pools):
    """KL-Shampoo on the kept blocks: verify mode (raising) checks every block's step at its home in float64."""
    results = pools(2).run(cases_soap.train, 4, blocks=True, verify_interval=1, verify_action="raise",
                           timeout=TIMEOUT)
    for res in results:
        assert res["success"] == [True] * 4 and res["verified"] == 4, res["success"]
    assert sorted(h for res in results for h in res["homed"]) == cases_soap.HOMED_BLOCKS


def test_soap_homed_off_its_only_owner(pools):
    """Buckets of 100 elements at DP 3: no matrix straddles ranks, and a matrix wholly on one rank is homed on
    another (homes anywhere), so the exchange must still run (found by the fuzzer: it was skipped, and the home
    read an empty buffer, inf)."""
    _check(pools(3).run(cases_soap.train, 2, use_kl_shampoo=False, bucket_size=100, timeout=TIMEOUT), 2)


def test_soap_with_partial_sharding(pools):
    """DP 4 in two optimizer instances: each instance homes every matrix once and computes the same update."""
    _check(pools(4).run(cases_soap.train, 3, instances=2, timeout=TIMEOUT), 3, instances=2)


def test_soap_plain_shampoo_other_beta(pools):
    _check(pools(3).run(cases_soap.train, 4, use_kl_shampoo=False, shampoo_beta=0.8, timeout=TIMEOUT), 4)


def test_soap_state_dict_round_trip_is_bitwise(pools):
    results = pools(3).run(cases_soap.state_dict_round_trip, 2, timeout=TIMEOUT)
    for res in results:
        assert all(res["equal"].values()), res["equal"]
    assert sorted(h for res in results for h in res["homed"]) == cases_soap.MATRICES


def test_a_skipped_step_changes_neither_params_nor_per_matrix_state(pools):
    for res in pools(3).run(cases_soap.skipped_step_changes_nothing, timeout=TIMEOUT):
        assert res == dict(success=False, same_params=True, same_state=True, next_success=True), res


def test_a_state_dict_without_the_per_matrix_state_is_refused_on_every_rank(pools):
    for message in pools(2).run(cases_soap.state_dict_without_matrix_state, timeout=TIMEOUT):
        assert "per-matrix state" in message


@pytest.mark.parametrize("world", [3, 1])
def test_soap_checkpoint_reshards_per_matrix_state(pools, tmp_path, world):
    """Saved at DP2, loaded at DP3 / DP1 (other homes) and saved again: every per-matrix state tensor bitwise the
    saved one, every matrix homed once at the new size, and training goes on bitwise as the straight DP2 run (every
    rank feeds the same exact gradient, so every DP size reduces to the same bits)."""
    path, resave = str(tmp_path / "soap"), str(tmp_path / f"soap{world}")
    straight = pools(2).run(cases_soap.resume, path, "straight", 4, timeout=TIMEOUT)
    pools(2).run(cases_soap.resume, path, "first", 4, timeout=TIMEOUT)
    resumed = pools(world).run(cases_soap.resume, path, "second", 4, resave, timeout=TIMEOUT)
    keys = {f"{n}@0,0+{'x'.join(map(str, cases_soap.SHAPES[n[0]]))}" for n in cases_soap.MATRICES}
    for state in ("L", "R", "Q_L", "Q_R", "exp_avg", "exp_avg_sq"):
        saved, again = ckpt.read_tensors(path, state), ckpt.read_tensors(resave, state)
        assert set(saved) == keys, state
        assert set(again) == set(saved) and all(torch.equal(saved[k], again[k]) for k in saved), state
    assert sorted(k for res in resumed for k in res["matrix_state"].get("L", {})) == cases_soap.MATRICES
    for name, p in resumed[0]["params"].items():  # the same gradient bits at every DP size: the same params
        assert torch.equal(p, straight[0]["params"][name]), name



# ---------------------------------------------------------------------------------------------- verify mode
@pytest.mark.parametrize("use_kl_shampoo", [True, False])
@pytest.mark.parametrize("gaussian", [False, True])
def test_verify_mode_passes_every_correct_soap_step(pools, use_kl_shampoo, gaussian):
    """Verify mode on every step at DP 3 (the float64 recomputation of each matrix at its home, given the eigenbases
    the step chose: optimizer/rules/soap_float64.py), exact and Gaussian gradients of scales 1e-4..10: no finding."""
    for res in pools(3).run(cases_soap.verified, 6, "none", use_kl_shampoo, gaussian=gaussian, timeout=TIMEOUT):
        assert res["error"] is None, res["error"]
        assert res["success"] == [True] * 6 and res["verified"] == 6, res


@pytest.mark.parametrize("fault, check", [("qr", "per-matrix Q_L"), ("tensordot", "per-matrix exp_avg")])
def test_verify_mode_finds_a_compute_fault_in_soaps_step_on_every_rank(pools, fault, check):
    """A compute fault inside SOAP's step at the homes (one element of a QR's Q, or of a projection, off by 1e-3 of
    the largest) at the third step: every rank raises the same VerificationError naming the per-matrix state, and
    every rank finishes (the pool's timeout bounds it)."""
    results = pools(3).run(cases_soap.verified, 5, fault, timeout=TIMEOUT)
    assert all(r["faulted"] for r in results)
    message = the_same_on_every_rank(r["error"] for r in results)
    assert message.startswith("VerificationError") and "step() call 3" in message and check in message, message
    assert all(r["success"] == [True, True] for r in results), results


def test_verify_mode_a_skipped_soap_step_changes_no_per_matrix_state(pools):
    for res in pools(3).run(cases_soap.verified, 5, "skip", timeout=TIMEOUT):
        assert res["error"] is None, res["error"]
        assert res["success"] == [True, True, False, True, True] and res["verified"] == 5, res


# ---------------------------------------------------------------------------------------------- precision-aware
BF16_MOMENTS = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
BF16_PARAM = 5e-3  # measured 1.9e-3 of the change at DP 2 over 5 steps: bf16's half ulp (2^-9) of M and V


def test_soap_with_bf16_moments_differs_by_their_rounding_only(pools):
    """The precision-aware optimizer: SOAP's exp_avg / exp_avg_sq kept in bf16 at the homes (the factors and bases
    fp32, bitwise those of emerging-optimizers' fp32 SOAP on the same exact gradients); the params within bf16's
    rounding of the moments of emerging's fp32 run."""
    results = pools(2).run(cases_soap.train, 5, **BF16_MOMENTS, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert res["success"] == [True] * 5
        assert ("exp_avg", "torch.bfloat16") in res["state_dtypes"] and ("L", "torch.float32") in res["state_dtypes"] \
            or not res["homed"], res["state_dtypes"]
        for step, (perr, ferr) in enumerate(zip(res["param_err"], res["factor_err"])):
            assert max(perr.values()) <= BF16_PARAM, f"rank {rank} step {step}: {perr}"
            assert max(ferr.values(), default=0.0) <= FACTOR, f"rank {rank} step {step}: {ferr}"
    assert sorted(h for res in results for h in res["homed"]) == cases_soap.MATRICES


def test_verify_mode_with_bf16_moments(pools):
    """Verify mode's bounds take the bf16 store of the moments (half an ulp) and the update read from the unrounded
    fp32 moments: six Gaussian steps at DP 3 without a finding."""
    for res in pools(3).run(cases_soap.verified, 6, "none", gaussian=True, **BF16_MOMENTS, timeout=TIMEOUT):
        assert res["error"] is None, res["error"]
        assert res["verified"] == 6
