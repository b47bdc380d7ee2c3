"""Worker-side cases for precision-aware optimizer state (16-bit moments, fp16 masters, remainders)."""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import (TinyLM, assert_identical_across_ranks, cosine_diff, flat_params, fp64_copy,
                                  full_main_params, global_batch, rel_l2, token_loss_sum, train_with_reference)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name -> (model dtype, OptimizerConfig fields)
KINDS = {
    "fp32_state": (BF16, dict()),
    "bf16_moments_fp32_model": (FP32, dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16,
                                           exp_avg_sq_dtype=BF16)),
    "bf16_moments_remainders": (BF16, dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16,
                                           exp_avg_sq_dtype=BF16)),
    "fp16_moments_fp16_master": (BF16, dict(use_precision_aware_optimizer=True, exp_avg_dtype=FP16,
                                            exp_avg_sq_dtype=FP16, main_params_dtype=FP16)),
    "bf16_moments_stochastic": (BF16, dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16,
                                           exp_avg_sq_dtype=BF16, stochastic_rounding=True)),
}


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if dtype == FP32 else t.to(dtype).double()


class RoundedStateReference:
    """Single process, the whole global batch, float64 AdamW whose moments and masters are stored
    rounded to the dtypes the optimizer under test keeps (fp32 values for remainders)."""

    def __init__(self, model: torch.nn.Module, lr: float, wd: float, moment_dtype: torch.dtype,
                 master_dtype: torch.dtype) -> None:
        self.masters = fp64_copy(model)
        self.compute = self.masters if model.out.weight.dtype == FP32 else copy.deepcopy(model)
        self.lr, self.wd, self.beta1, self.beta2, self.eps = lr, wd, 0.9, 0.999, 1e-8
        self.moment_dtype, self.master_dtype = moment_dtype, master_dtype
        self.m = {n: torch.zeros_like(p) for n, p in self.masters.named_parameters()}
        self.v = {n: torch.zeros_like(p) for n, p in self.masters.named_parameters()}
        self.t = 0

    def step(self, batches: list, world: int) -> float:
        ga = len(batches) // world
        for p in list(self.masters.parameters()) + list(self.compute.parameters()):
            p.grad = None
        grads = {n: torch.zeros_like(p) for n, p in self.masters.named_parameters()}
        for x, y in batches:
            loss_sum, n = token_loss_sum(self.compute(x), y)
            (loss_sum / n / ga).backward()
            for (name, c) in self.compute.named_parameters():
                grads[name] += c.grad.double() / world
                c.grad = None
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        clip = min(1.0, 1.0 / (norm + 1e-6))
        self.t += 1
        bc1, bc2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        with torch.no_grad():
            for name, w in self.masters.named_parameters():
                g = grads[name] * clip
                # the update uses the unrounded moments; they are rounded once, on store (as pass 2 does)
                m = self.beta1 * self.m[name] + (1 - self.beta1) * g
                v = self.beta2 * self.v[name] + (1 - self.beta2) * g * g
                self.m[name], self.v[name] = _round(m, self.moment_dtype), _round(v, self.moment_dtype)
                wd = 0.0 if (w.ndim == 1 or name.endswith(".bias")) else self.wd  # megatron's no-wd rule
                new = w * (1 - self.lr * wd) - (self.lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + self.eps)
                # keep params (fp32 in the model) always have fp32 masters
                dtype = FP32 if dict(self.compute.named_parameters())[name].dtype == FP32 else self.master_dtype
                w.copy_(_round(new, dtype) if dtype != FP32 else new.float().double())
            if self.compute is not self.masters:
                for (name, c), w in zip(self.compute.named_parameters(), self.masters.parameters()):
                    c.copy_(w)
        return norm


def build(kind: str, model: torch.nn.Module, lr: float, wd: float):
    _, fields = KINDS[kind]
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                             grad_reduce_in_fp32=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=lr, weight_decay=wd, clip_grad=1.0,
                                                       use_distributed_optimizer=True,
                                                       bf16=model.out.weight.dtype == BF16, **fields), ddp)
    return ddp, opt


def run_precision_parity(kind: str, ga: int = 2, steps: int = 5, lr: float = 1e-2, wd: float = 0.1) -> dict:
    world = dist.get_world_size()
    dtype, fields = KINDS[kind]
    model = TinyLM(dtype)
    moment = fields.get("exp_avg_dtype", FP32)
    master = fields.get("main_params_dtype", FP32)
    rounded = RoundedStateReference(model, lr, wd, moment, master)
    plain = RoundedStateReference(model, lr, wd, FP32, FP32)  # fp32 state: how far rounding moves things
    init = {n: p.detach().double().clone() for n, p in rounded.masters.named_parameters()}
    ddp, opt = build(kind, model, lr, wd)
    norms = train_with_reference(ddp, opt, ga, steps,
                                 lambda batches: (rounded.step(batches, world), plain.step(batches, world))[0])
    assert_identical_across_ranks(flat_params(model))
    masters = full_main_params(ddp, opt)

    def errors(ref: RoundedStateReference) -> dict:
        out = {}
        for name, p in ref.masters.named_parameters():
            ours, theirs = masters[name].double() - init[name], p.detach() - init[name]
            out[name] = (rel_l2(ours, theirs), cosine_diff(ours, theirs))
        return out

    dtypes = sorted({str(t.dtype) for t in opt.local_state_tensors().values()})
    return {"rounded": errors(rounded), "plain": errors(plain), "norms": norms, "state_dtypes": dtypes}


def run_skip_leaves_state_unchanged(kind: str) -> dict:
    """A step with a non-finite gradient on one rank changes no byte of the 16-bit state or the params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, _ = KINDS[kind]
    model = TinyLM(dtype)
    ddp, opt = build(kind, model, 1e-2, 0.1)
    for step in range(3):
        x, y = global_batch(world, seed=step)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss, n = token_loss_sum(ddp(x), y)
        (loss / n).backward()
        if step == 2 and rank == world - 1:
            model.fc.weight.main_grad[0, 0] = float("inf")
        if step == 2:
            before = {k: v.clone() for k, v in opt.local_state_tensors().items()}
            params_before = flat_params(model).clone()
        success, _, _ = opt.step()
    after = opt.local_state_tensors()
    return {"success": success,
            "state_unchanged": all(torch.equal(before[k].view(torch.uint8) if before[k].dim() else before[k],
                                               after[k].view(torch.uint8) if after[k].dim() else after[k])
                                   for k in before),
            "params_unchanged": torch.equal(flat_params(model), params_before),
            "dtypes": sorted({str(t.dtype) for t in after.values()})}
