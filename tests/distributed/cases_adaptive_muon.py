"""Worker-side cases for AdaptiveMuon through the distributed optimizer (DP only), against the float64
reference of tests/support/reference_adaptive_muon.py fed the same global batch (cases_muon's model and data)."""
from __future__ import annotations


import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.distributed.cases_muon import SPLIT, _assemble, _loss, batch, model_and_reference
from tests.support import reference_adaptive_muon as ram
from tests.support import reference_muon as rm


def train(steps: int, nesterov: bool = False, clip: float = 0.5, weight_decay: float = 0.1, split_qkv: bool = True,
          scale_mode: str = "spectral", extra_scale: float = 1.0, eps: float = 1e-8, verify: bool = False,
          matmul_prec: str = "highest") -> dict:
    """Train MuonNet with optimizer='adaptive_muon' ``steps`` steps; per step the errors against the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = model_and_reference()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True))
    lr = 0.02
    cfg = mo.OptimizerConfig(optimizer="adaptive_muon", lr=lr, weight_decay=weight_decay, clip_grad=clip,
                             use_distributed_optimizer=True, muon_nesterov=nesterov, muon_split_qkv=split_qkv,
                             muon_scale_mode=scale_mode, muon_extra_scale_factor=extra_scale,
                             muon_fp32_matmul_prec=matmul_prec, adaptive_muon_eps=eps,
                             verify_interval=1 if verify else 0)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    reference = ram.reference_adaptive_muon(ref, lr, weight_decay, split_shapes=SPLIT, nesterov=nesterov,
                                            split_qkv=split_qkv, scale_mode=scale_mode,
                                            extra_scale_factor=extra_scale, eps=eps)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    names = sorted(n for n, p in model.named_parameters() if rm.uses_muon(p))
    out = dict(param_err=[], state_err=[], success=[], names=names)
    for step in range(steps):
        ddp.zero_grad_buffer()
        _loss(ddp, *batch(step, rank)).backward()
        success, norm, _ = opt.step()
        out["success"].append(bool(success))
        reference.zero_grad()
        for r in range(world):
            (_loss(ref, *batch(step, r)) / world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf"))
        reference.step()
        ddp.finish_param_sync()
        out["param_err"].append({n: float((p.detach().double() - ref_params[n].detach()).norm()
                                          / (ref_params[n].detach() - initial[n]).norm())
                                 for n, p in model.named_parameters()})
        sd = opt.state_dict()
        errs = {}
        for state in ("momentum_buffer", "moment2_buffer"):
            mine = _assemble(sd, state, {n: shapes[n] for n in names})
            for n in names:
                theirs = reference.state[ref_params[n]][state]
                errs[f"{n}:{state}"] = float((mine[n] - theirs).norm() / theirs.norm())
        out["state_err"].append(errs)
    out["verified"] = opt.verify_report.verified_steps if verify else None
    return out
