"""Bad input gets a clear error naming the problem and the fix, and no rank is left hanging."""
import pytest
import torch

from tests.distributed import cases_errors as ce
import megatron_opt as mo
from tests.support.common import TinyLM, build


def test_unsupported_param_dtype_names_the_param():
    model = torch.nn.Linear(4, 4).double()
    with pytest.raises(ValueError, match=r"param 'weight' has dtype torch.float64.*Cast the module"):
        mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))


def test_frozen_params_stay_out_of_the_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    managed = {id(p) for b in ddp.buffers for p in b.params}
    assert id(model[0].weight) not in managed and not hasattr(model[0].weight, "main_grad")
    assert id(model[0].bias) in managed


def test_module_without_trainable_params():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        mo.DistributedDataParallel(model)


def test_optimizer_and_ddp_disagree_on_distributed_optimizer():
    ddp = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(use_distributed_optimizer=False))
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), ddp)


def test_param_group_with_a_foreign_param():
    ddp = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    cfg = mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="not in this optimizer's buffers"):
        mo.DistributedOptimizer(cfg, [ddp],
                                [{"params": list(ddp.module.parameters()) + [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ValueError, match="missing from every param group"):
        mo.DistributedOptimizer(cfg, [ddp], [{"params": [ddp.module.fc.weight]}])


def test_optimizer_needs_wrapped_chunks():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3), torch.nn.Linear(2, 2))


def test_state_dict_of_another_model_is_refused():
    _, opt_a = build(TinyLM())
    _, opt_b = build(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="Load a checkpoint saved by this model"):
        opt_b.load_state_dict(opt_a.state_dict())
    with pytest.raises(ValueError, match="not a megatron_opt"):
        opt_a.load_state_dict({"state": {}})


def test_step_state_machine_errors():
    model = TinyLM()
    ddp, opt = build(model)
    with pytest.raises(RuntimeError, match="needs prepare_grads"):
        opt.step_with_ready_grads()
    ddp.zero_grad_buffer()
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert opt.step()[0]
    with pytest.raises(RuntimeError, match="rule 1 of docs/contract.md"):
        opt.step()  # again, without a new backward


@pytest.mark.parametrize("distributed", [True, False])
@pytest.mark.parametrize("only_rank", [-1, 1])
def test_step_without_backward_raises_on_every_rank(pools, only_rank, distributed):
    for rank, err in enumerate(pools(2).run(ce.step_without_backward, only_rank, distributed, timeout=120)):
        assert "StepOrderError" in err and "no gradient since zero_grad_buffer()" in err, (rank, err)


def test_nan_check_raises_on_every_rank(pools):
    for rank, err in enumerate(pools(2).run(ce.nan_check_before_reduction, timeout=120)):
        assert "check_for_nan_in_grad" in err, (rank, err)


def test_train_step_rejects_a_bad_loss_fn(pools):
    for err in pools(1).run(ce.train_step_bad_loss_fn):
        assert "loss_fn must return (loss_sum, num_tokens" in err
