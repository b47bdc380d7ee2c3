"""Worker-side case for Muon's optimizer memory: what each rank allocates, from state_memory(),
against what it must allocate, from the gradient buffers' ownership (DistributedDataParallel's
published shards, which the optimizer does not build)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.distributed import cases_muon
from tests.support import reference_muon as rm


def owned_elements(ddp: mo.DistributedDataParallel) -> dict[str, tuple[int, bool]]:
    """param name -> (elements this rank owns, whether Muon updates it), from DDP's shards."""
    params = dict(ddp.module.named_parameters())
    out: dict[str, tuple[int, bool]] = {}
    for shard in ddp.local_shards():
        for pc in shard.pieces:
            name = shard.names[pc.param_index]
            n = out.get(name, (0, False))[0] + pc.param_range.size
            out[name] = (n, rm.uses_muon(params[name]))
    return out


def memory(precision_aware: bool = False, bucket_size: int = 600) -> dict:
    """A bf16 MuonNet (small buckets: several shards, matrices straddling them, Muon and AdamW params
    interleaved in each) with its Muon optimizer; this rank's state_memory(), the expected bytes, one
    step's success."""
    model = cases_muon.MuonNet().bfloat16()
    model.emb.weight.is_embedding_or_output_parameter = True
    model.attn.linear_qkv.weight.qkv_split_shapes = cases_muon.SPLIT
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        grad_reduce_in_fp32=True, bucket_size=bucket_size))
    extra = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16) if precision_aware else {}
    cfg = mo.OptimizerConfig(optimizer="muon", lr=0.01, bf16=True, use_distributed_optimizer=True, **extra)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    moment = 2 if precision_aware else 4  # exp_avg_dtype: the Muon momentum and AdamW's exp_avg
    expected: dict[str, dict[str, int]] = {}
    for name, (n, muon) in owned_elements(ddp).items():
        # One master per owned element: fp32, except AdamW's precision-aware default
        # (store_param_remainders=True): the bf16 param plus an int16 remainder. Muon's stay fp32.
        expected.setdefault("master", {})[name] = (2 if precision_aware and not muon else 4) * n
        states = {"momentum_buffer": moment} if muon else {"exp_avg": moment, "exp_avg_sq": 4}
        for state, size in states.items():
            expected.setdefault(state, {})[name] = size * n
    ddp.zero_grad_buffer()
    cases_muon._loss(ddp, *cases_muon.batch(0, dist.get_rank())).backward()
    success, _, _ = opt.step()
    ddp.finish_param_sync()
    # The masters, assembled from every rank's runs (each at its place in its shard), are the params
    # before their rounding to bf16: within a bf16 ulp of them (2^-7 relative; remainders truncate), none missing.
    masters = opt.gather_main_params()
    off = {n: float(((masters[n] - p.float()).abs() - p.float().abs() * 2.0 ** -7).max())
           for n, p in model.named_parameters()}
    return {"got": opt.state_memory(), "expected": expected, "success": bool(success), "masters_off": off,
            "master_names": sorted(masters),
            "shards": len(ddp.local_shards()), "owned": sum(n for n, _ in owned_elements(ddp).values())}
