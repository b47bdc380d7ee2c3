"""Worker-side cases: the step decided on the device (optimizer_cuda_graph) against the host-decided step."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tests.support.common import TinyLM, build, flat_params, global_batch, token_loss_sum

# Per step: a grad multiplier and the lr. The plain norm is ~12: x0.1 clips with a coefficient in
# (0.5, 1), x1 and up clip harder, x10 crosses a threshold of 100, inf is an overflow on rank 0, and
# x50 / x1e4 overflow fp16 at the loss scale in use.
SCHEDULE = [(1.0, 1e-2), (0.15, 9e-3), (50.0, 8e-3), (float("inf"), 6e-3), (0.14, 5e-3), (10.0, 4.5e-3),
            (1e4, 4e-3), (1.0, 3e-3), (2.0, 2e-3)]


def _run(device_step: bool, precision: str, skip_threshold):
    rank = dist.get_rank()
    model = TinyLM(torch.float16 if precision == "fp16" else torch.float32)
    kw = dict(fp16=True, initial_loss_scale=2.0**12, loss_scale_window=2, hysteresis=1, min_loss_scale=1.0) \
        if precision == "fp16" else {}
    ddp, opt = build(model, clip_grad=1.0, weight_decay=0.1, grad_norm_skip_threshold=skip_threshold,
                     log_num_zeros_in_grad=True, optimizer_cuda_graph=device_step, **kw)
    batches = global_batch(2 * dist.get_world_size(), seed=3)
    out = []
    for i, (mult, lr) in enumerate(SCHEDULE):
        for g in opt.param_groups:
            g["lr"] = lr
        ddp.zero_grad_buffer()
        x, y = batches[(2 * rank + i) % len(batches)]
        loss = token_loss_sum(ddp(x), y)[0]
        loss = loss * mult if math.isfinite(mult) else loss
        opt.scale_loss(loss).backward()
        if not math.isfinite(mult) and rank == 0:  # an overflow on one rank only
            next(p for p in model.parameters()).main_grad.view(-1)[0] = float("inf")
        success, norm, zeros = opt.step()
        out.append(dict(success=bool(success), norm=None if norm is None else float(norm),
                        zeros=None if zeros is None else int(zeros), scale=float(opt.get_loss_scale()),
                        params=flat_params(model), skipped=opt.skipped_steps,
                        types=(type(success).__name__, type(norm).__name__)))
    return out


def device_step_equals_host_step(precision: str, skip_threshold) -> dict:
    return {"host": _run(False, precision, skip_threshold), "device": _run(True, precision, skip_threshold)}


# Muon (a whole-tensor rule): per step a grad multiplier, the lr, and whether the last rank's grad gets a NaN.
MUON_SCHEDULE = [(1.0, 2e-2, False), (5.0, 1.5e-2, False), (1.0, 1e-2, True), (0.2, 1e-2, False), (3.0, 8e-3, False)]


def _run_muon(device_step: bool, dtype: str, nesterov: bool):
    from tests.distributed import cases_muon as cm
    import megatron_opt as mo

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = cm.MuonNet()
    if dtype == "bf16":
        model = model.bfloat16()
        model.emb.weight.is_embedding_or_output_parameter = True
        model.attn.linear_qkv.weight.qkv_split_shapes = cm.SPLIT
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True))
    cfg = mo.OptimizerConfig(optimizer="muon", lr=2e-2, weight_decay=0.1, clip_grad=0.5, bf16=dtype == "bf16",
                             use_distributed_optimizer=True, muon_nesterov=nesterov, muon_fp32_matmul_prec="highest",
                             log_num_zeros_in_grad=True, optimizer_cuda_graph=device_step)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    out = []
    for i, (mult, lr, nan) in enumerate(MUON_SCHEDULE):
        for g in opt.param_groups:
            g["lr"] = lr
        ddp.zero_grad_buffer()
        x, t = cm.batch(i, rank)
        (cm._loss(ddp, x, t) * mult).backward()
        if nan:
            ddp.finish_grad_sync()
            shard = next(s for s in ddp.local_shards() if s.pieces)
            if rank == world - 1:
                shard.grad[shard.pieces[0].shard_range.start] = float("nan")
        success, norm, zeros = opt.step()
        ddp.finish_param_sync()
        sd = opt.state_dict()
        out.append(dict(success=bool(success), norm=None if norm is None else float(norm),
                        zeros=None if zeros is None else int(zeros),
                        params=flat_params(model), skipped=opt.skipped_steps,
                        state={k: {p: v["values"].clone() for p, v in per.items()} for k, per in sd["state"].items()},
                        scalars=repr(sd["scalars"]),
                        types=(type(success).__name__, type(norm).__name__)))
    return out


def muon_device_step_equals_host_step(dtype: str, nesterov: bool) -> dict:
    return {"host": _run_muon(False, dtype, nesterov), "device": _run_muon(True, dtype, nesterov)}
