"""bench_optimizer_step.py --check: two steps of fresh copies of the implementations on the same data;
ours against the Megatron-like and torch fused results, and each 16-bit state option against the
fp32-state ours (tolerances and why: the docstring of megatron_opt_bench.optimizer_step)."""
from __future__ import annotations

import math

import torch

from .optimizer_step_impls import Data, MegatronLike, Ours, TorchFused, free_memory

# --check tolerances (fp32): masters per tensor ||a-b||/||b||, the two-step update ||da-db||/||db||,
# the grad norms, and the share of bf16 params that may differ (a master a few ulps apart can round the
# other way near a bf16 tie).
TOL_MASTER, TOL_UPDATE, TOL_NORM, TOL_BF16_MISMATCH = 1e-5, 1e-4, 1e-5, 1e-3
# --check of a 16-bit state option against the fp32-state run: the per-tensor two-step update (bf16 moments
# round each stored moment by <= 2^-9 relative; see optimizer_step's docstring); norms and bf16 params as above.
TOL_STATE_UPDATE = 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def run_check(data: Data, args, device: torch.device) -> dict:
    """Two steps of fresh copies of the three on the same data; ours against each of the others."""
    grads = [data.grad, data.second_grad()]
    w0 = [w.float() for w in data.views(data.w0)]
    ours = Ours(data, args, device)
    ours_norms = []
    for g in grads:
        ours.set_grads(g)
        ours_norms.append(float(ours.step()))
    ours_masters = [t.clone() for t in ours.masters(data)]
    ours_bf16 = [t.clone() for t in ours.bf16_params()]
    del ours
    free_memory(device)
    report = {"ours_grad_norms": ours_norms}
    ok = True
    for cls in (MegatronLike, TorchFused):
        peer = cls(data, args, device)
        norms = []
        for g in grads:
            peer.set_grads(g)
            norms.append(float(peer.step()))
        result = peer.result()
        master_rel = max(rel(a, b) for a, b in zip(ours_masters, result))
        upd_num = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(ours_masters, result))
        upd_den = sum(float((b.double() - w.double()).square().sum()) for b, w in zip(result, w0))
        update_rel = math.sqrt(upd_num / max(upd_den, 1e-300))
        norm_rel = max(abs(a - b) / abs(b) for a, b in zip(ours_norms, norms))
        entry = {"grad_norms": norms, "master_rel_diff": master_rel, "update_rel_diff": update_rel,
                 "grad_norm_rel_diff": norm_rel}
        # ours' bf16 params against the peer's masters rounded to bf16 (what Megatron writes back)
        mismatched = sum(int((a != b.to(torch.bfloat16)).sum()) for a, b in zip(ours_bf16, result))
        entry["bf16_param_mismatch_fraction"] = mismatched / data.n
        entry["ok"] = (master_rel <= TOL_MASTER and update_rel <= TOL_UPDATE and norm_rel <= TOL_NORM
                       and entry["bf16_param_mismatch_fraction"] <= TOL_BF16_MISMATCH)
        for key in ("master_rel_diff", "update_rel_diff", "grad_norm_rel_diff", "bf16_param_mismatch_fraction"):
            if not math.isfinite(entry[key]):
                entry["ok"] = False
        ok = ok and entry["ok"]
        report[cls.name] = entry
        del peer, result
        free_memory(device)
    report["states"] = {}
    for state in args.mo_states:
        if state == "fp32":
            continue
        entry = check_state(state, data, args, device, grads, w0, ours_masters, ours_norms)
        ok = ok and entry["ok"]
        report["states"][state] = entry
    report["ok"] = ok
    return report


def check_state(state: str, data: Data, args, device: torch.device, grads: list[torch.Tensor],
                w0: list[torch.Tensor], ref_masters: list[torch.Tensor], ref_norms: list[float]) -> dict:
    """Two steps of ours with a 16-bit state option against the fp32-state ours (same data, same grads)."""
    opt = Ours(data, args, device, state=state)
    norms = []
    for g in grads:
        opt.set_grads(g)
        norms.append(float(opt.step()))
    masters = [t.clone() for t in opt.masters(data)]
    bf16 = opt.bf16_params()
    # the bf16 params must be these masters rounded (the write-back of pass 2)
    mismatched = sum(int((p != m.to(torch.bfloat16)).sum()) for p, m in zip(bf16, masters))
    del opt, bf16
    free_memory(device)
    update_rel = max(rel(a - w, b - w) for a, b, w in zip(masters, ref_masters, w0))
    entry = {"grad_norms": norms, "master_rel_diff": max(rel(a, b) for a, b in zip(masters, ref_masters)),
             "update_rel_diff": update_rel, "grad_norm_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                                      zip(norms, ref_norms)),
             "bf16_param_mismatch_fraction": mismatched / data.n,
             "tolerance": {"update_rel_diff (max per tensor)": TOL_STATE_UPDATE, "grad_norm_rel_diff": TOL_NORM,
                           "bf16_param_mismatch_fraction": TOL_BF16_MISMATCH}}
    entry["ok"] = (update_rel <= TOL_STATE_UPDATE and entry["grad_norm_rel_diff"] <= TOL_NORM
                   and entry["bf16_param_mismatch_fraction"] <= TOL_BF16_MISMATCH
                   and all(math.isfinite(entry[k]) for k in ("master_rel_diff", "update_rel_diff",
                                                              "grad_norm_rel_diff")))
    return entry
