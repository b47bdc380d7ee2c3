"""Model-parallel groups through megatron_opt's own API: context parallelism's reduction and scale,
replicated tensor-parallel params counted once, and a NaN on one peer stopping every rank."""
import pytest

from tests.distributed.cases_model_parallel_groups import (run_context_parallel,
                                                           run_expert_data_parallel_group_is_required,
                                                           run_edit_after_grad_sync_survives,
                                                           run_optimizer_pg_collection_must_match_the_wrapper,
                                                           run_tensor_parallel_replica_check,
                                                           run_replicated_tensor_parallel)


def test_context_parallel_matches_the_whole_batch_reference(pools):
    results = pools(4).run(run_context_parallel)
    for r in results:
        for got, want in zip(r["loss"], r["ref_loss"]):
            assert got == pytest.approx(want, rel=1e-6)
        for got, want in zip(r["norm"], r["ref_norm"]):
            assert got == pytest.approx(want, rel=1e-6)
        assert r["update_error"] < 2e-4
    assert len({r["params_crc"] for r in results}) == 1  # every rank holds the same params


def test_context_parallel_without_the_context_group_in_the_reduction_is_wrong(pools):
    """The negative control: reducing over the data-parallel ranks only gives another result."""
    r = pools(4).run(run_context_parallel, cp_in_reduction=False)[0]
    assert any(abs(g - w) > 1e-3 * abs(w) for g, w in zip(r["norm"], r["ref_norm"]))


def test_replicated_tensor_parallel_params_count_once(pools):
    for r in pools(4).run(run_replicated_tensor_parallel):
        assert r["error"] is None
        for got, want in zip(r["norm"], r["ref_norm"]):
            assert got == pytest.approx(want, rel=1e-6)


def test_nan_on_one_tensor_parallel_peer_stops_every_rank(pools):
    results = pools(4).run(run_replicated_tensor_parallel, nan_on_rank=1, timeout=60)
    for r in results:
        assert r["error"] is not None and "non-finite" in r["error"], r["error"]


def test_expert_parallel_needs_its_own_data_parallel_group(pools):
    for r in pools(4).run(run_expert_data_parallel_group_is_required):
        assert "expert_data_parallel_group" in r["ours"]
        assert "no 'expt_dp' group" in r["megatron-core"]


def test_optimizer_pg_collection_must_match_the_wrapper(pools):
    for message in pools(4).run(run_optimizer_pg_collection_must_match_the_wrapper):
        assert ("pg_collection.tp has 1 rank(s) but the model chunks were wrapped with a tensor-parallel size of 2"
                in message)


@pytest.mark.parametrize("overlap,instances", [(True, 1), (False, 1), (True, 2)])
def test_an_edit_of_the_reduced_gradient_survives_a_second_grad_sync(pools, overlap, instances):
    assert all(pools(4).run(run_edit_after_grad_sync_survives, overlap, instances))


def test_verify_mode_compares_tensor_parallel_copies_of_replicated_params(pools):
    for r in pools(4).run(run_tensor_parallel_replica_check, "norm.weight"):
        assert r["error"] is not None and "replica" in r["error"] and "norm.weight" in r["error"], r
        assert "rank 1" in r["error"] and "rank 3" in r["error"], r["error"]  # the two TP-rank-1 copies


def test_verify_mode_leaves_tensor_parallel_slices_alone(pools):
    for r in pools(4).run(run_tensor_parallel_replica_check, "fc.weight"):
        assert r["error"] is None and r["last_verified"] == 2, r
