"""Worker-side parity cases: megatron_opt after several steps vs a single-process fp64 torch AdamW."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.support.common import (TinyLM, assert_identical_across_ranks, build, cosine_diff, flat_params, fp64_copy,
                    full_main_params, reference_optimizer,
                    rel_l2, token_loss_sum, train_with_reference)

PRECISIONS = {
    "fp32": dict(dtype=torch.float32, opt=dict()),
    "bf16": dict(dtype=torch.bfloat16, opt=dict(bf16=True)),
    "fp16": dict(dtype=torch.float16, opt=dict(fp16=True, initial_loss_scale=2.0**10)),
}


class MasterWeightReference:
    """Single process, whole global batch. fp32: an fp64 model and fp64 AdamW. bf16/fp16: a model of the
    same dtype for forward/backward (so both sides see the same rounding of activations), gradients
    summed in fp64, and AdamW on fp64 master weights copied back into the model after each step."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, optimizer: str = "adam") -> None:
        self.masters = fp64_copy(model)
        self.compute = self.masters if model.out.weight.dtype == torch.float32 else copy.deepcopy(model)
        self.opt = reference_optimizer(optimizer, self.masters, lr, weight_decay)

    def step(self, batches: list, clip_grad: float, world: int, loss_mult: float = 1.0) -> float:
        """Same objective and the same split as the ranks: each micro-batch backpropagates its mean / GA
        in the model dtype, and the sum over micro-batches is divided by DP in fp64."""
        self.opt.zero_grad()
        for p in self.compute.parameters():
            p.grad = None
        ga = len(batches) // world
        for x, y in batches:
            loss_sum, n = token_loss_sum(self.compute(x), y)
            if self.compute is self.masters:  # fp64 end to end: the split does not matter
                (loss_sum / n / ga / world * loss_mult).backward()
                continue
            (loss_sum / n / ga * loss_mult).backward()
            for m, c in zip(self.masters.parameters(), self.compute.parameters()):
                g = c.grad.double() / world
                m.grad = g if m.grad is None else m.grad + g
                c.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        self.opt.step()
        if self.compute is not self.masters:
            with torch.no_grad():
                for m, c in zip(self.masters.parameters(), self.compute.parameters()):
                    c.copy_(m)
        return float(norm)


def run_parity(precision: str, ga: int, overlap: bool, steps: int = 5, clip_grad: float = 1.0,
               lr: float = 1e-2, weight_decay: float = 0.1, loss_mult: float = 1.0, distributed: bool = True,
               optimizer: str = "adam") -> dict:
    """Train TinyLM for ``steps`` steps on DP ranks x ``ga`` micro-batches and compare with fp64 AdamW.

    Each micro-batch loss is its token mean; every micro-batch has the same token count, so the
    global objective is the mean over all W*GA micro-batches. Returns the error metrics.
    """
    world = dist.get_world_size()
    spec = PRECISIONS[precision]
    model = TinyLM(spec["dtype"])
    ref = MasterWeightReference(model, lr, weight_decay, optimizer)
    ddp, opt = build(model, distributed=distributed, overlap_grad=overlap, overlap_param=overlap,
                     bucket_size=300 if overlap else None, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                     optimizer=optimizer, **spec["opt"])
    init = {n: p.detach().double().clone() for n, p in ref.masters.named_parameters()}
    norms = train_with_reference(ddp, opt, ga, steps, lambda batches: ref.step(batches, clip_grad, world, loss_mult),
                                 loss_mult)
    if ddp.ddp_config.overlap_param_gather:
        ddp.finish_param_sync()
    assert_identical_across_ranks(flat_params(model))
    masters = full_main_params(ddp, opt)
    errors = {}
    for name, p in ref.masters.named_parameters():
        delta_ours, delta_ref = masters[name].double() - init[name], p.detach() - init[name]
        errors[name] = (rel_l2(delta_ours, delta_ref), cosine_diff(delta_ours, delta_ref),
                        float((masters[name].double() - p.detach()).abs().max()))
    return {"errors": errors, "norms": norms}
