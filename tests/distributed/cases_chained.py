"""Worker-side cases for the ChainedOptimizer (dense + expert-parallel) and norm bookkeeping."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import flat_params


class ExpertModel(torch.nn.Module):
    """A dense layer replicated over DP and an 'expert' layer that differs per rank (EP = world)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(8, 8)
        torch.manual_seed(100 + rank)
        self.expert = torch.nn.Linear(8, 4)
        for p in self.expert.parameters():
            p.allreduce = False  # Megatron's marker for expert-parallel params

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x)))


def chained_expert_step(inject_expert_inf: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    model = ExpertModel(rank)
    ref = copy.deepcopy(model).double()
    ddp = mo.DistributedDataParallel(
        model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        expert_data_parallel_group=singles[rank])
    cfg = mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True, clip_grad=0.0, fp16=False)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    g = torch.Generator().manual_seed(rank)
    x, t = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    ddp.zero_grad_buffer()
    ((ddp(x) - t) ** 2).sum().backward()
    ddp.finish_grad_sync()
    if inject_expert_inf and rank == 1:
        shard = next(s for s in ddp.local_shards(expert_parallel=True) if s.pieces)
        shard.grad[shard.pieces[0].shard_range.start] = float("inf")
    before = flat_params(model)
    success, norm, _ = opt.step()
    ((ref(x.double()) - t.double()) ** 2).sum().backward()
    dense = torch.cat([p.grad.reshape(-1) for p in ref.dense.parameters()])
    dist.all_reduce(dense)
    expert_sq = torch.cat([p.grad.reshape(-1) for p in ref.expert.parameters()]).div(world).square().sum()
    dist.all_reduce(expert_sq)
    ref_norm = float((dense.div(world).square().sum() + expert_sq).sqrt())
    return dict(kind=type(opt).__name__, children=len(getattr(opt, "chained_optimizers", [])),
                one_scaler=len({id(c.grad_scaler) for c in opt.chained_optimizers}) == 1,
                success=success, norm=norm, ref_norm=ref_norm,
                dense_unchanged=torch.equal(before[:72], flat_params(model)[:72]),
                all_unchanged=torch.equal(before, flat_params(model)))


def shared_param_excluded_from_norm() -> dict:
    """A param marked shared (e.g. a tied embedding's second copy) counts once, i.e. not here."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.shared = True
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, clip_grad=0.0), ddp)
    ref = copy.deepcopy(model).double()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp.zero_grad_buffer()
    ddp(x).sum().backward()
    _, norm, _ = opt.step()
    ref(x.double()).sum().backward()
    grads = [p.grad for n, p in ref.named_parameters() if n != "1.weight"]
    for g in grads:
        dist.all_reduce(g)
    return dict(norm=norm, ref=float(torch.cat([g.reshape(-1) / dist.get_world_size() for g in grads]).norm()))
