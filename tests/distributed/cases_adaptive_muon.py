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
          matmul_prec: str = "highest", moment2_method: str = "adamuon", instances: int = 1) -> dict:
    """Train MuonNet with optimizer='adaptive_muon' ``steps`` steps; per step the errors against the reference
    (NorMuon's per-matrix second moment: at its home; ``homed``: the matrices homed on this rank). ``instances``:
    partial sharding (num_distributed_optimizer_instances), each instance homing every matrix."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = model_and_reference()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True,
        num_distributed_optimizer_instances=instances))
    lr = 0.02
    cfg = mo.OptimizerConfig(optimizer="adaptive_muon", lr=lr, weight_decay=weight_decay, clip_grad=clip,
                             use_distributed_optimizer=True, muon_nesterov=nesterov, muon_split_qkv=split_qkv,
                             muon_scale_mode=scale_mode, muon_extra_scale_factor=extra_scale,
                             muon_fp32_matmul_prec=matmul_prec, adaptive_muon_eps=eps,
                             adaptive_muon_moment2_method=moment2_method, verify_interval=1 if verify else 0)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    reference = ram.reference_adaptive_muon(ref, lr, weight_decay, split_shapes=SPLIT, nesterov=nesterov,
                                            split_qkv=split_qkv, scale_mode=scale_mode,
                                            extra_scale_factor=extra_scale, eps=eps, moment2_method=moment2_method)
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
        elementwise = ("momentum_buffer",) if moment2_method == "normuon" else ("momentum_buffer", "moment2_buffer")
        for state in elementwise:
            mine = _assemble(sd, state, {n: shapes[n] for n in names})
            for n in names:
                theirs = reference.state[ref_params[n]][state]
                errs[f"{n}:{state}"] = float((mine[n] - theirs).norm() / theirs.norm())
        homed = sd.get("matrix_state", {}).get("moment2_buffer", {})
        for n, v in homed.items():  # NorMuon's per-matrix second moment, at its home
            theirs = reference.state[ref_params[n]]["moment2_buffer"]
            assert v.shape == theirs.shape, (n, v.shape, theirs.shape)
            errs[f"{n}:moment2_buffer@home"] = float((v.double() - theirs).norm() / theirs.norm())
        out["homed"] = sorted(homed)
        out["state_err"].append(errs)
    out["verified"] = opt.verify_report.verified_steps if verify else None
    return out


def _faulty(op: str, fault_step: int, calls: list, step_of: list):
    """A compute fault inside NorMuon's step at a home, on step ``fault_step`` (0-based), once: 'lerp' adds 1e-2 of its
    largest element to one element of the new second moment (torch.lerp onto an (m, 1) / (1, n) moment); 'norm'
    scales the first Frobenius norm of a matrix by 1.01 (torch.linalg.vector_norm of a whole 2-D tensor). (Verify mode
    checks the update to fp32 Newton-Schulz's bound, 1e-4 of ||O||_F on every element: about 0.7% of a typical
    element of these small matrices, so a fault much smaller than 1% of the whole update hides in it.)"""
    module, attr = (torch, "lerp") if op == "lerp" else (torch.linalg, "vector_norm")
    real = getattr(module, attr)

    def faulty(*args, **kwargs):
        out = real(*args, **kwargs)
        hit = (1 in out.shape) if op == "lerp" else (args[0].dim() == 2 and "dim" not in kwargs)  # not the grad norm's
        if step_of[0] == fault_step and not calls and hit and out.dtype == torch.float32:
            calls.append(1)
            out = out.clone()
            if op == "lerp":
                out.view(-1)[0] += 1e-2 * float(out.abs().max())
            else:
                out = out * 1.01
        return out

    return module, attr, real, faulty


def verified_with_fault(steps: int, fault: str, fault_step: int = 2) -> dict:
    """NorMuon with verify mode on every step (verify_action 'raise') and ``fault`` (see _faulty) on every rank at
    step ``fault_step``: this rank's steps' successes, whether the fault fired, and the error message if any."""
    rank = dist.get_rank()
    model, _ = model_and_reference()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True))
    cfg = mo.OptimizerConfig(optimizer="adaptive_muon", lr=0.02, weight_decay=0.1, clip_grad=0.5,
                             use_distributed_optimizer=True, muon_fp32_matmul_prec="highest",
                             adaptive_muon_moment2_method="normuon", verify_interval=1, verify_action="raise")
    opt = mo.get_megatron_optimizer(cfg, ddp)
    out = dict(success=[], error=None)
    calls: list = []
    step_of = [-1]
    module, attr, real, faulty = _faulty(fault, fault_step, calls, step_of)
    setattr(module, attr, faulty)
    try:
        for step in range(steps):
            step_of[0] = step
            ddp.zero_grad_buffer()
            _loss(ddp, *batch(step, rank)).backward()
            out["success"].append(bool(opt.step()[0]))
            ddp.finish_param_sync()
    except Exception as exc:  # noqa: BLE001  (the test reads the message on every rank)
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        setattr(module, attr, real)
    out["faulted"] = bool(calls)
    return out
