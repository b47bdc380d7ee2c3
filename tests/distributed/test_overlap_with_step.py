"""OptimizerConfig.overlap_param_gather_with_optimizer_step (Megatron-LM's name and semantics).

get_megatron_optimizer gives the first model chunk's dense params their own child optimizer; the
step applies that child's update, agrees on it across ranks, dispatches the chunk's param
all-gather asynchronously and only then updates the other children, so the all-gather overlaps
the rest of the step. The chunk's forward pre-hooks wait for it. Multi-rank cases run in
tests/distributed/cases_overlap_with_step.py on the persistent gloo pools, each bounded by its timeout.
"""
from __future__ import annotations

import pytest
import torch

import megatron_opt as mo

from tests.distributed import cases_overlap_with_step as cases
from tests.distributed.test_parity import TOL

BOUND_S = 120  # a case that hangs (a rank stuck in a collective) fails the test after this


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_and_bitwise_equal_to_no_overlap(pools, world, precision):
    """Two chunks, several buckets each, at DP 1-4: against the float64 AdamW reference with the
    tolerances of tests/distributed/test_parity.py, and bitwise the same params, masters and norms as the same
    run without the option (only the order of the communication changes)."""
    for rank, res in enumerate(pools(world).run(cases.run_parity, precision, timeout=BOUND_S)):
        where = f"DP={world} {precision} rank={rank}"
        assert res["bitwise_same_as_off"], f"{where}: the run differs from the one without the option"
        for name, (rl2, cos) in res["errors"].items():
            assert rl2 <= TOL[precision]["rel_l2"], f"{where} param={name}: update rel L2 {rl2:.3g}"
            assert cos <= TOL[precision]["cos"], f"{where} param={name}: update cosine diff {cos:.3g}"
        for ours, ref in res["norms"]:
            assert ours == pytest.approx(ref, rel=1e-5 if precision == "fp32" else 3e-2), where


def test_device_decided_step_is_bitwise_the_host_decided_one(pools):
    """optimizer_cuda_graph (eager on CPU) with the option: the all-gathers start after the update,
    first chunk first; the numbers are bitwise those of the host-decided step without the option."""
    for rank, res in enumerate(pools(2).run(cases.run_parity, "fp32", device_step=True, timeout=BOUND_S)):
        assert res["bitwise_same_as_off"], f"rank {rank}: the device-decided run differs"
        for name, (rl2, _) in res["errors"].items():
            assert rl2 <= TOL["fp32"]["rel_l2"], (rank, name, rl2)


@pytest.mark.parametrize("overlap_with_step", [False, True])
def test_first_chunk_gathers_before_the_rest_updates(pools, overlap_with_step):
    """The profiled step: with the option, pass 2 of the first chunk, its all-gather, then pass 2 of
    the other chunk and its all-gather; without it, one pass 2 then the all-gathers. Afterwards the
    first chunk's plain start_param_sync() dispatches nothing (megatron-core's semantics: the
    optimizer already did), force_dispatch=True does, and the other chunk's always does."""
    for rank, res in enumerate(pools(2).run(cases.run_dispatch_order, overlap_with_step, timeout=BOUND_S)):
        assert res["success"], rank
        if overlap_with_step:
            assert res["order"] == ["pass2", "param_sync", "pass2", "param_sync"], (rank, res["order"])
            assert res["first"] == 0, f"rank {rank}: the first chunk's start_param_sync() all-gathered again"
        else:
            assert res["order"] == ["pass2", "param_sync"], (rank, res["order"])
            assert res["first"] > 0, rank
        assert res["first_forced"] > 0 and res["last"] > 0, (rank, res)


def test_needs_overlap_param_gather_on_every_rank(pools):
    for rank, res in enumerate(pools(2).run(cases.run_unwrapped_overlap_error, timeout=BOUND_S)):
        assert res["kind"] == "InvalidConfigError", (rank, res)
        assert "overlap_param_gather=True" in res["message"] and "rank 0" in res["message"], (rank, res)


def test_a_later_child_failing_on_one_rank_raises_on_every_rank(pools):
    """The first chunk's all-gather was dispatched on every rank before rank 1's second child failed:
    every rank raises RankError within the bound and the first chunk's params agree across ranks."""
    results = pools(2).run(cases.run_second_child_fails_on_one_rank, timeout=BOUND_S)
    for rank, res in enumerate(results):
        assert res["error"] is not None and res["error"].startswith("RankError"), (rank, res["error"])
        assert "rank 1" in res["error"] and "second child's update failed" in res["error"], res["error"]
        assert res["seconds"] < BOUND_S / 2, (rank, res["seconds"])
    assert torch.equal(results[0]["first_chunk"], results[1]["first_chunk"])


def test_config_needs_the_distributed_optimizer():
    with pytest.raises(mo.InvalidConfigError, match="overlap_param_gather_with_optimizer_step=True .* needs "
                                                    "use_distributed_optimizer=True"):
        mo.OptimizerConfig(lr=1e-3, overlap_param_gather_with_optimizer_step=True)
    assert mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True,
                              overlap_param_gather_with_optimizer_step=True).overlap_param_gather_with_optimizer_step


def test_megatron_core_config_converts():
    from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig
    from megatron_opt.config_conversion import as_optimizer_config

    core = CoreOptimizerConfig(lr=1e-3, use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=True)
    assert as_optimizer_config(core).overlap_param_gather_with_optimizer_step is True


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_resumes_and_reshards(pools, tmp_path, world):
    """The split optimizer saves and loads in model space like any other: from DP=2 into DP=2 or 3,
    masters and params bitwise; at DP=2 the next step is bitwise the uninterrupted run's (so the
    moments came back too), at DP=3 it runs on every rank."""
    saved = pools(2).run(cases.run_save, str(tmp_path / "ckpt"), timeout=BOUND_S)[0]
    for rank, res in enumerate(pools(world).run(cases.run_load_and_step, str(tmp_path / "ckpt"), timeout=BOUND_S)):
        assert res["masters"].keys() == saved["masters"].keys()
        for name, t in saved["masters"].items():
            assert torch.equal(res["masters"][name], t), f"rank {rank}: master {name} changed DP=2 -> DP={world}"
        assert torch.equal(res["params"], saved["params"]), rank
        assert res["success"] and res["norm"] > 0, (rank, res["success"], res["norm"])
        if world == 2:
            assert torch.equal(res["params_after_next_step"], saved["params_after_next_step"]), (
                f"rank {rank}: the resumed step differs from the uninterrupted one")
