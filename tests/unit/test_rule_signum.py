"""The throwaway Signum rule (issue 38): a rule with two constants is its file, its kernel file and this test.
Registered by being in optimizer/rules/, configured through OptimizerConfig.rule_constants and its derived
flags, checked by its declaration, and trained by get_megatron_optimizer."""
from __future__ import annotations

import pytest
import torch

import megatron_opt as mo
import megatron_opt.ops as ops
from megatron_opt.megatron import arguments as megatron_args
from megatron_opt.ops.piece_table import full_table
from megatron_opt.optimizer.rules.registry import UPDATE_RULES, update_rule_from_config
from megatron_opt.optimizer.rules.signum import Signum, recompute
from megatron_opt.optimizer.verify.float64_update import Float64Inputs

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2"]


def test_the_registry_the_config_and_the_flags_find_it():
    assert UPDATE_RULES["signum"] is Signum
    assert update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="signum")) == Signum(0.9, 1.0)
    config = mo.OptimizerConfig(lr=1e-3, optimizer="signum", rule_constants={"signum_beta": 0.5, "signum_scale": 2.0})
    assert update_rule_from_config(config) == Signum(beta=0.5, scale=2.0)
    with pytest.raises(mo.InvalidConfigError, match=r"OptimizerConfig.signum_beta=1.0 is out of range"):
        update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="signum", rule_constants={"signum_beta": 1.0}))
    args = megatron_args.parse_megatron_args([*MODEL, "--optimizer", "signum", "--signum-beta", "0.5",
                                              "--signum-scale", "2"], world_size=1)
    assert update_rule_from_config(megatron_args.optimizer_config_from_args(args)) == Signum(beta=0.5, scale=2.0)


def test_the_reference_matches_the_float64_recomputation():
    n, lr, wd = 1000, 1e-2, 0.1
    gen = torch.Generator().manual_seed(0)
    g, w, m = (torch.randn(n, generator=gen) for _ in range(3))
    rule = Signum(beta=0.8, scale=0.5)
    master, state = w.clone(), m.clone()
    plan = ops.StepPlan((ops.ShardOperands(full_table(n), g, master, (state,)),))
    rule.apply(plan, lr_wd=ops.lr_wd_table([lr], [wd], g.device), grad_scale=torch.ones(1), step=torch.ones(1),
               backend="reference")
    want = recompute(Float64Inputs(w.double(), g.double(), {"exp_avg": m.double()}, lr, wd, 1), 0.8, 0.5)
    for name, got in (("master", master), ("exp_avg", state)):
        assert ((got.double() - want.values[name]).abs() <= want.tolerance[name]).all(), name


def test_get_megatron_optimizer_trains_with_it():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=0.1, optimizer="signum", use_distributed_optimizer=True,
                                                       rule_constants={"signum_scale": 0.5}), ddp)
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad_buffer()
    ddp(torch.randn(2, 4)).square().sum().backward()
    assert opt.step()[0] and type(opt.update_rule) is Signum and opt.update_rule.scale == 0.5
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
