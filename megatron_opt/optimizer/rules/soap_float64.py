"""SOAP's float64 recomputation for verify mode (rules/soap.py has the step and its formulas).

SOAP is not a continuous function of its inputs everywhere: the eigenbases of a factor with (nearly) equal
eigenvalues are arbitrary, the order of the basis columns follows near-ties, and Adam in the rotated basis lifts
rounding noise to +-1 (docs/muon.md, "SOAP"). A float64 rerun of the whole step can
therefore differ from a correct fp32 step by O(1). Verify mode checks instead, at the matrix's home, everything
that is a continuous function of the pre-step state, the gradient and the choices the step made:

* the choices: the new bases Q_L', Q_R' (stored) must be orthonormal and be what the step's method makes of the new
  factor: at the first step eigenvectors (K Q = Q diag, eigenvalues descending), after it the Q of a QR
  decomposition of K Q_sorted (Q'^T K Q_sorted upper triangular); the column order is the step's own (the rule
  recomputes it with the step's fp32 ops on the same bits: soap.basis_order);
* the factors L', R' from the pre-step factors, bases and the gradient (KL-Shampoo's clamped inverses included);
* exp_avg' and exp_avg_sq' from the pre-step moments, the old and new bases and the gradient;
* D from the stored exp_avg' and exp_avg_sq' and the new bases, and from it (the leaf) the masters.

Each bound is built, as for the elementwise rules (verify/float64_update.py), from the magnitudes of the terms: a
product of matrices with inner dimension k rounds by at most (k + SLACK) u |A| |B| elementwise (u: fp32's unit
roundoff, TF32's on CUDA at matmul precision 'high'), and an input's bound is carried through each product.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..verify.float64_update import FP32_UNIT, SLACK, rounding_bound

TF32_UNIT = 2.0**-11  # the unit roundoff of TF32's 10-bit mantissa (matmul precision 'high' on CUDA)
# Orthogonality and the structure of Q (eigh, QR) are checked to (k + SLACK) u times this: LAPACK's and cuSOLVER's
# backward errors are a small multiple of k u, with no bound stated per element.
STRUCTURE_SLACK = 64.0

Tensors = dict[str, torch.Tensor]


def _unit(device: torch.device) -> float:
    return TF32_UNIT if device.type == "cuda" else FP32_UNIT


def _mm(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor, unit: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ b in float64 and the bound on an fp32 product of perturbed inputs: |da| |b| + |a| |db| + (k + SLACK) u
    |a| |b| (plus the second-order |da| |db|)."""
    k = a.shape[-1]
    bound = da @ b.abs() + a.abs() @ db + da @ db + (k + SLACK) * unit * (a.abs() @ b.abs())
    return a @ b, bound


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


def _project(x: torch.Tensor, dx: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor, unit: float, back: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q_L^T X Q_R (or Q_L X Q_R^T, ``back``) and its bound, the bases exact (the stored ones)."""
    left, right = (ql, qr.T) if back else (ql.T, qr)
    y, dy = _mm(left, x, _zero(left), dx, unit)
    return _mm(y, right, dy, _zero(right), unit)


def _eigenvalue_estimates(k: torch.Tensor, q: torch.Tensor, unit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """diag(Q^T K Q) as the step computes it (the old basis, the old factor: both exact inputs) and its bound."""
    qk, dqk = _mm(q.T, k, _zero(q), _zero(k), unit)
    values = (qk * q.T).sum(dim=1)
    return values, (dqk * q.T.abs()).sum(dim=1) + (k.shape[0] + SLACK) * unit * (qk.abs() * q.T.abs()).sum(dim=1)


def _kl_targets(rule: Any, g: torch.Tensor, dg: torch.Tensor, factors: list[torch.Tensor], bases: list[torch.Tensor],
                unit: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KL-Shampoo's targets (L's from R~, R's from L~) and their bounds."""
    targets = []
    for i, (k, q) in enumerate(zip(factors, bases)):
        lam, dlam = _eigenvalue_estimates(k, q, unit)
        n = g.shape[i]
        scale = 1.0 / (n * lam.clamp_min(rule.eps))
        # 1 / clamp(., eps) is monotone: its largest move over [lam - dlam, lam + dlam] is at one end. Where a
        # factor is rank-deficient (its first steps, a rectangular matrix) lam is rounding noise near 0, clamped or
        # not by the noise's sign: there the bound is 1 / (n eps), and the check reads no more than the scale.
        dscale = torch.maximum((1.0 / (n * (lam - dlam).clamp_min(rule.eps)) - scale).abs(),
                               (1.0 / (n * (lam + dlam).clamp_min(rule.eps)) - scale).abs()) + SLACK * unit * scale
        inverse, dinverse = _mm(q * scale[None, :], q.T, q.abs() * dscale[None, :], _zero(q), unit)
        side, dside = (g.T, dg.T) if i == 1 else (g, dg)
        left, dleft = _mm(side.T, inverse, dside.T, dinverse, unit)
        targets.append(_mm(left, side, dleft, dside, unit))
    return targets[::-1]  # L takes R~'s correction and R takes L~'s


def _basis_checks(k: torch.Tensor, q_sorted: torch.Tensor, q_new: torch.Tensor, first: bool, unit: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored, wanted, bound) of what the new basis must satisfy, stacked: Q'^T Q' = I, and the method's
    structure: at the first step K Q' = Q' diag(Q'^T K Q') with that diagonal descending; after it the strictly
    lower triangle of Q'^T K Q_sorted zero."""
    size = q_new.shape[0]
    tol = STRUCTURE_SLACK * (size + SLACK) * unit
    gram = q_new.T @ q_new
    got = [gram.reshape(-1)]
    want = [torch.eye(size, dtype=gram.dtype, device=gram.device).reshape(-1)]
    bound = [torch.full_like(gram.reshape(-1), tol)]
    scale = float(k.abs().max()) if k.numel() else 0.0
    if first:
        kq = k @ q_new
        lam = (q_new * kq).sum(dim=0)
        got += [kq.reshape(-1), torch.clamp(lam[1:] - lam[:-1], min=0.0)]
        want += [(q_new * lam[None, :]).reshape(-1), torch.zeros_like(lam[1:])]
        bound += [torch.full_like(kq.reshape(-1), tol * scale * size), torch.full_like(lam[1:], tol * scale * size)]
    else:
        kq = k @ q_sorted
        r = q_new.T @ kq
        lower = torch.tril(r, diagonal=-1).reshape(-1)
        got.append(lower)
        want.append(torch.zeros_like(lower))
        bound.append(torch.full_like(lower, tol * float(kq.norm())))
    return torch.cat(got), torch.cat(want), torch.cat(bound)


def recompute_soap_step(rule: Any, g: torch.Tensor, before: Tensors, after: Tensors, step: int,
                        orders: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                 dict[str, tuple[torch.Tensor, ...]]]:
    """(D, its elementwise bound, {check name: (stored, recomputed, bound)}) of one matrix at its home, from the
    float64 gradient ``g``, the per-matrix state ``before`` the step and as stored ``after`` it, and the column
    order of each old basis the step took (``orders``: L's, R's; soap.basis_order) (module docstring)."""
    unit = _unit(after["L"].device)
    f64 = {name: t.double() for name, t in after.items()}
    old = {name: t.double() for name, t in before.items()}
    dg = (SLACK * unit) * g.abs()  # the fp32 gradient the step read: g * grad_scale, rounded
    checks: dict[str, tuple[torch.Tensor, ...]] = {}

    # The factors.
    decay = 1.0 - (1.0 - rule.shampoo_beta) / (1.0 - rule.shampoo_beta ** step)
    if rule.use_kl_shampoo:
        targets = _kl_targets(rule, g, dg, [old["L"], old["R"]], [old["Q_L"], old["Q_R"]], unit)
    else:
        targets = [_mm(g, g.T, dg, dg.T, unit), _mm(g.T, g, dg.T, dg, unit)]
    for name, (target, dtarget) in zip(("L", "R"), targets):
        kept = decay * old[name]
        want = kept + (1.0 - decay) * target
        checks[name] = (f64[name], want, rounding_bound(kept, (1.0 - decay) * target) + (1.0 - decay) * dtarget)

    # The bases, each checked against the old one in the order the step took.
    for name, factor, order in (("Q_L", "L", orders[0]), ("Q_R", "R", orders[1])):
        checks[name] = _basis_checks(f64[factor], old[name][:, order], f64[name], step == 1, unit)

    # The moments, in the new bases.
    ql, qr = f64["Q_L"], f64["Q_R"]
    plain, dplain = _project(old["exp_avg"], _zero(old["exp_avg"]), old["Q_L"], old["Q_R"], unit, back=True)
    rotated, drotated = _project(plain, dplain, ql, qr, unit)
    g_rot, dg_rot = _project(g, dg, ql, qr, unit)
    beta1, beta2 = rule.beta1, rule.beta2
    exp_avg = beta1 * rotated + (1.0 - beta1) * g_rot
    checks["exp_avg"] = (f64["exp_avg"], exp_avg, rounding_bound(beta1 * rotated, (1.0 - beta1) * g_rot)
                         + beta1 * drotated + (1.0 - beta1) * dg_rot)
    v_old = old["exp_avg_sq"].index_select(0, orders[0]).index_select(1, orders[1])
    square, dsquare = g_rot * g_rot, 2.0 * g_rot.abs() * dg_rot + dg_rot * dg_rot
    exp_avg_sq = beta2 * v_old + (1.0 - beta2) * square
    checks["exp_avg_sq"] = (f64["exp_avg_sq"], exp_avg_sq,
                            rounding_bound(beta2 * v_old, (1.0 - beta2) * square) + (1.0 - beta2) * dsquare)

    # 16-bit moments (the precision-aware optimizer): the store rounds each once more, to nearest.
    for name in ("exp_avg", "exp_avg_sq"):
        stored, want, bound = checks[name]
        checks[name] = (stored, want, bound + _store_rounding(want, bound, after[name].dtype))

    # D from the stored moments (the ones the step used: unrounded where they are 16-bit, so half an ulp of
    # each more, relative, through M / sqrt(V)) and the stored bases.
    m_hat = f64["exp_avg"] / (1.0 - beta1 ** step)
    denominator = (f64["exp_avg_sq"] / (1.0 - beta2 ** step)).sqrt() + rule.eps
    adam = m_hat / denominator
    stored_rounding = _half_ulp(after["exp_avg"].dtype) + _half_ulp(after["exp_avg_sq"].dtype)
    update, dupdate = _project(adam, rounding_bound(adam) + stored_rounding * adam.abs(), ql, qr, unit, back=True)
    return update, dupdate, checks


def _half_ulp(dtype: torch.dtype) -> float:
    """The relative rounding of a store into ``dtype`` (to nearest); none for fp32 (the arithmetic's bound has it)."""
    return 0.0 if dtype in (torch.float32, torch.float64) else torch.finfo(dtype).eps / 2


def _store_rounding(values: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far a store into ``dtype`` may move a value within ``bound`` of ``values``: half an ulp, and one
    subnormal step near zero (as verify mode's elementwise store bound)."""
    if dtype in (torch.float32, torch.float64):
        return torch.zeros_like(values)
    info = torch.finfo(dtype)
    return (values.abs() + bound) * (info.eps / 2) + info.tiny * info.eps


__all__ = ["recompute_soap_step", "TF32_UNIT", "STRUCTURE_SLACK"]
