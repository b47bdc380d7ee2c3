"""Ranks that fail alone or disagree: a clear error on every rank within a bound, never a hang."""
from __future__ import annotations

import pytest

from tests.distributed import cases_reliability as cr

BOUND_S = 20


@pytest.mark.parametrize("fault", ["raise_first", "raise_last", "empty", "aux_one_rank"])
@pytest.mark.parametrize("overlap", [False, True])
def test_train_step_failure_on_one_rank_raises_on_every_rank(pools, fault, overlap):
    results = pools(2).run(cr.train_step_fault, fault, overlap, timeout=60)
    for res in results:
        assert res["error"] is not None and res["error"].startswith("RankError"), res
        if fault == "aux_one_rank":
            assert "different aux losses" in res["error"], res
        else:
            assert "on rank 1" in res["error"] and ("KeyError" in res["error"] or "got none" in res["error"]), res
        assert res["seconds"] < BOUND_S, res
        assert res["after"], "the next step must work on every rank"


def test_scheduler_advances_by_the_global_sample_count(pools):
    results = pools(2).run(cr.scheduler_counts_global_samples)
    assert results[0]["num_steps"] == results[1]["num_steps"] == 2 * (1 + 3)
    assert results[0]["lr"] == results[1]["lr"]


@pytest.mark.parametrize("kind, expect", [("reshaped", "trainable param"), ("order", "trainable param"),
                                          ("dtype", "trainable param"), ("float64", "dtype torch.float64"),
                                          ("bucket_size", "ddp_config.bucket_size"),
                                          ("distributed_optimizer", "ddp_config.use_distributed_optimizer")])
def test_ranks_that_wrap_different_things_raise_at_construction(pools, kind, expect):
    for res in pools(2).run(cr.ddp_mismatch, kind, timeout=60):
        assert res["error"] is not None and expect in res["error"] and "rank 1" in res["error"], res
        assert res["seconds"] < BOUND_S


@pytest.mark.parametrize("kind, expect", [("to_bf16", "no longer lives in megatron_opt's buffer"),
                                          ("assign", "is not the param that was wrapped"),
                                          ("freeze", "requires_grad set to False"),
                                          ("wrap_twice", "already wrapped")])
def test_params_changed_after_wrapping_are_caught(pools, kind, expect):
    for res in pools(2).run(cr.param_changed_after_wrapping, kind, timeout=60):
        assert res["error"] is not None and expect in res["error"], res
        assert res["seconds"] < BOUND_S


@pytest.mark.parametrize("grad_fp32", [False, True])
def test_16bit_grad_buffers_are_prescaled_before_their_reduction(pools, grad_fp32):
    for res in pools(2).run(cr.fp16_buffer_reduction, grad_fp32):
        assert res["success"], "the data-parallel sum of fp16 gradients overflowed: no pre-scaling"
        assert res["norm"] == pytest.approx(40000.0 * 8, rel=1e-3)  # the average gradient, 64 elements


# ----------------------------------------------------------------------------- clear errors, single process
def _one_step(loss_fn, mode="per_token"):

    import megatron_opt as mo
    from tests.support.common import TinyLM, build, global_batch

    ddp, opt = build(TinyLM())
    return mo.train_step(ddp, opt, None, global_batch(1, seed=2), loss_fn, loss_mode=mode)


@pytest.mark.parametrize("returns, expect", [
    ("float", "must be a scalar torch.Tensor with its autograd graph, got float"),
    ("vector", "must be a scalar tensor (sum or average it), got shape (2, 8)"),
    ("aux_list", "aux losses must be a dict"),
    ("count_vector", "number of supervised tokens (one number)"),
])
def test_bad_loss_fn_outputs_get_clear_errors(returns, expect):
    import torch.nn.functional as F

    from tests.support.common import token_loss_sum

    def loss_fn(m, b):
        loss, n = token_loss_sum(m(b[0]), b[1])
        if returns == "float":
            return float(loss), n
        if returns == "vector":
            logits = m(b[0])
            return F.cross_entropy(logits.transpose(1, 2), b[1], reduction="none"), n
        if returns == "aux_list":
            return loss, n, [loss * 0]
        return loss, b[1].ne(-100)

    with pytest.raises(Exception) as ei:
        _one_step(loss_fn)
    assert expect in str(ei.value), str(ei.value)


def test_nested_no_sync_keeps_accumulating():

    from tests.support.common import TinyLM, build, global_batch, token_loss_sum

    model = TinyLM()
    ddp, opt = build(model, overlap_grad=True)
    ddp.zero_grad_buffer()
    batches = global_batch(3, seed=4)
    with ddp.no_sync():
        with ddp.no_sync():
            token_loss_sum(ddp(batches[0][0]), batches[0][1])[0].backward()
        token_loss_sum(ddp(batches[1][0]), batches[1][1])[0].backward()  # still inside the outer no_sync
    token_loss_sum(ddp(batches[2][0]), batches[2][1])[0].backward()
    assert opt.step()[0]


def test_zero_element_param_is_named():
    import torch

    import megatron_opt as mo

    model = torch.nn.Linear(4, 4)
    model.empty = torch.nn.Parameter(torch.zeros(0))
    with pytest.raises(ValueError, match="param 'empty' has no elements"):
        mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig())


@pytest.mark.parametrize("kind, expect", [("lr", "config.lr"), ("beta", "config.adam_beta2"),
                                          ("rule", "config.optimizer")])
def test_ranks_that_build_different_optimizers_raise_at_construction(pools, kind, expect):
    for res in pools(2).run(cr.optimizer_mismatch, kind, timeout=60):
        assert res["error"] is not None and expect in res["error"] and "rank 1" in res["error"], res
        assert res["seconds"] < BOUND_S


def test_nonfinite_optimizer_state_dict_is_refused_before_any_change():
    import torch

    from tests.support.common import TinyLM, build, global_batch, token_loss_sum

    import megatron_opt as mo

    model = TinyLM()
    ddp, opt = build(model)
    mo.train_step(ddp, opt, None, global_batch(1, seed=2), lambda m, b: token_loss_sum(m(b[0]), b[1]))
    sd = opt.state_dict()
    next(iter(sd["state"]["exp_avg"].values()))["values"][0] = float("nan")
    before = {k: v.clone() for k, v in opt.local_state_tensors().items()}
    with pytest.raises(ValueError, match="non-finite"):
        opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt.local_state_tensors().items())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fault_injection_skips_exactly_the_planted_steps(pools, precision):
    for seed in (1, 2):
        for res in pools(2).run(cr.fault_injection, precision, 9, seed, timeout=120):
            planted = set(res["planted"])
            assert planted, "the plan planted nothing"
            for step, success, unchanged in res["faulty"]:
                if step in planted:
                    assert not success and unchanged, \
                        f"{precision} seed {seed}: planted step {step} was not a clean skip"
                else:
                    assert success and not unchanged, f"{precision} seed {seed}: clean step {step} did not update"
            assert all(success for _, success, _ in res["clean"])
            assert res["params_equal"] and res["state_equal"], \
                f"{precision} seed {seed}: the faulty run does not end where the run without the planted steps ends"


def test_a_group_without_this_rank_is_refused(pools):
    rank0, rank1 = pools(2).run(cr.group_without_this_rank, timeout=60)
    assert rank0["error"] is None, rank0
    assert rank1["error"] is not None and "not a member of the data_parallel_group" in rank1["error"], rank1


def test_ddp_built_before_init_process_group_is_caught(monkeypatch):
    import torch.distributed as dist

    import megatron_opt as mo
    from tests.support.common import TinyLM

    ddp = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    ddp.zero_grad_buffer()  # fine while there is no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(mo.StepOrderError, match="built before init_process_group"):
        ddp.zero_grad_buffer()


def test_a_param_made_trainable_after_wrapping_is_caught():
    import megatron_opt as mo
    from tests.support.common import TinyLM

    model = TinyLM()
    model.fc.bias.requires_grad_(False)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig())
    model.fc.bias.requires_grad_(True)
    with pytest.raises(ValueError, match="param 'fc.bias' is not the param that was wrapped.*became trainable"):
        ddp.zero_grad_buffer()


@pytest.mark.parametrize("device_step", [False, True])
def test_an_update_failing_on_one_rank_raises_on_every_rank(pools, device_step):
    for res in pools(2).run(cr.update_fails_on_one_rank, device_step, timeout=60):
        assert res["error"] is not None and res["error"].startswith("RankError"), res
        assert "rank 1" in res["error"] and "update kernel failed" in res["error"], res
        assert res["seconds"] < BOUND_S


def test_gloo_reduce_scatter_and_all_gather_in_slices_equal_one_collective(pools):
    assert all(pools(3).run(cr.chunked_all_gather))


def test_a_state_dict_refused_on_one_rank_is_refused_on_every_rank(pools):
    for res in pools(2).run(cr.state_dict_nan_on_one_rank, timeout=60):
        assert res["error"] is not None and "non-finite" in res["error"] and "rank 1" in res["error"], res
        assert res["untouched"] and res["seconds"] < BOUND_S


def test_control_flags_live_on_the_device_an_nccl_group_needs(monkeypatch):
    import torch
    import torch.distributed as dist

    from megatron_opt import collectives

    assert collectives.flag_device(None) == torch.device("cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.flag_device(None) == torch.device("cuda", 3)


@pytest.mark.parametrize("overlap", [False, True])
def test_late_gradient_in_one_ranks_backward_hook_raises_on_every_rank(pools, overlap):
    """A LateGradientError seen in one rank's backward hook, outside train_step: every rank raises it in the
    step, naming the rank and the param, within the bound (before, the other rank waited for the timeout)."""
    for res in pools(2).run(cr.late_gradient_in_one_ranks_hook, overlap, timeout=60):
        assert res["error"] is not None and res["error"].startswith("LateGradientError"), res
        assert "rank 1" in res["error"] and "arrived after its bucket" in res["error"], res
        assert res["seconds"] < BOUND_S and res["params_finite"], res
