"""A single-process float64 SOAP, written from the formulas (issue 39, item 6), as megatron-core configures
emerging-optimizers' SOAP for ``optimizer='soap'``: betas (adam_beta1, adam_beta2), shampoo_beta, KL-Shampoo or
plain Shampoo factors, eps 1e-8, decoupled weight decay, bias correction of the moments and of shampoo_beta, the
eigenbases by eigh at the first step and one power step + QR after, no Nesterov, no update-RMS clipping.

Per step t (1-based), gradient G (m x n), state L, R, Q_L, Q_R, M, V:

    b_t  = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)
    L   <- b_t L + (1 - b_t) G G^T,  R <- b_t R + (1 - b_t) G^T G                        (plain Shampoo)
           KL-Shampoo: L targets G R^-1~ G^T / n, R targets G^T L^-1~ G / m, where X^-1~ = Q diag(1/max(d, eps)) Q^T
           and d = diag(Q^T X Q) with the factors and bases before this step (both targets from them)
    M   <- Q_L M Q_R^T                                                                    (back to the plain basis)
    each basis Q sorted by d = diag(Q^T X Q) of its new factor, descending; V's rows / columns permuted alike
    Q   <- eigenvectors of X, eigenvalues descending (t = 1); else QR(X Q).Q
    M   <- Q_L^T M Q_R;  G' = Q_L^T G Q_R
    M   <- b1 M + (1 - b1) G';  V <- b2 V + (1 - b2) G'^2
    D    = Q_L [ (M / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps) ] Q_R^T
    W   <- W - lr wd W - lr D

SOAP reads rounding noise at its first steps (tests/distributed/cases_soap.py): this reference matches an fp32 SOAP
only where that noise stays far below eps, i.e. for small gradients (tests/unit/test_soap_reference.py).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from tests.support import reference_muon as rm


def init_state(shape: tuple[int, int]) -> dict:
    m, n = shape
    f64 = torch.float64
    return {"step": 0, "M": torch.zeros(m, n, dtype=f64), "V": torch.zeros(m, n, dtype=f64),
            "L": torch.zeros(m, m, dtype=f64), "R": torch.zeros(n, n, dtype=f64),
            "Q_L": torch.eye(m, dtype=f64), "Q_R": torch.eye(n, dtype=f64)}


def _diag_in_basis(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(q.T @ x @ q)


def _clamped_inverse(x: torch.Tensor, q: torch.Tensor, eps: float) -> torch.Tensor:
    return q @ torch.diag(1.0 / _diag_in_basis(x, q).clamp_min(eps)) @ q.T


def soap_direction(grad: torch.Tensor, state: dict, *, beta1: float, beta2: float, shampoo_beta: float, eps: float,
                   use_kl_shampoo: bool) -> torch.Tensor:
    """One step's D (before lr) from ``grad``; ``state`` advanced in place."""
    g = grad.double()
    m, n = g.shape
    state["step"] += 1
    t = state["step"]
    b = 1.0 - (1.0 - shampoo_beta) / (1.0 - shampoo_beta ** t)
    L, R, QL, QR = state["L"], state["R"], state["Q_L"], state["Q_R"]
    if use_kl_shampoo:
        target_l = g @ _clamped_inverse(R, QR, eps) @ g.T / n
        target_r = g.T @ _clamped_inverse(L, QL, eps) @ g / m
    else:
        target_l, target_r = g @ g.T, g.T @ g
    L = b * L + (1.0 - b) * target_l
    R = b * R + (1.0 - b) * target_r
    M = QL @ state["M"] @ QR.T
    V = state["V"]
    order_l = torch.argsort(_diag_in_basis(L, QL), descending=True)
    order_r = torch.argsort(_diag_in_basis(R, QR), descending=True)
    QL, QR, V = QL[:, order_l], QR[:, order_r], V[order_l][:, order_r]
    if t == 1:
        QL = torch.flip(torch.linalg.eigh(L).eigenvectors, [-1])
        QR = torch.flip(torch.linalg.eigh(R).eigenvectors, [-1])
    else:
        QL, QR = torch.linalg.qr(L @ QL).Q, torch.linalg.qr(R @ QR).Q
    M = QL.T @ M @ QR
    gr = QL.T @ g @ QR
    M = beta1 * M + (1.0 - beta1) * gr
    V = beta2 * V + (1.0 - beta2) * gr * gr
    d = QL @ ((M / (1.0 - beta1 ** t)) / ((V / (1.0 - beta2 ** t)).sqrt() + eps)) @ QR.T
    state.update(L=L, R=R, Q_L=QL, Q_R=QR, M=M, V=V)
    return d


def soap_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float,
              shampoo_beta: float, eps: float, weight_decay: float, use_kl_shampoo: bool) -> torch.Tensor:
    """One step on ``param`` (float64, in place) from ``grad``; returns D (before lr)."""
    d = soap_direction(grad, state, beta1=beta1, beta2=beta2, shampoo_beta=shampoo_beta, eps=eps,
                       use_kl_shampoo=use_kl_shampoo)
    with torch.no_grad():
        param.sub_(lr * weight_decay * param).sub_(lr * d)
    return d


class ReferenceSOAP(rm.ReferenceMuon):
    """SOAP for the groups marked ``muon=True`` (megatron-core's matrix split), AdamW for the rest, in float64.
    Under tensor parallelism megatron-core runs SOAP on each TP-local block: so does this reference, with one
    state per block (``state[p]["blocks"]``)."""

    def __init__(self, params: Iterable, matrices: Mapping[torch.Tensor, rm.MuonMatrix], lr: float,
                 weight_decay: float, *, soap: Mapping[str, Any], **options) -> None:
        super().__init__(params, matrices, lr, weight_decay, **options)
        self.soap = dict(soap)

    def _muon_direction(self, p: torch.Tensor) -> torch.Tensor:
        matrix, g = self.matrices[p], p.grad
        dim, parts = (matrix.partition_dim, matrix.tp_size) if matrix.partition_dim is not None else (0, 1)
        blocks = g.chunk(parts, dim=dim)
        states = self.state[p].setdefault("blocks", [init_state(tuple(b.shape)) for b in blocks])
        return torch.cat([soap_direction(b, s, **self.soap) for b, s in zip(blocks, states)], dim=dim)


def reference_soap(model: torch.nn.Module, lr: float, weight_decay: float, *, soap: Mapping[str, Any],
                   **options) -> ReferenceSOAP:
    """reference_muon's groups over ``model``, the matrices stepped by SOAP (``soap``: soap_direction's
    constants; ``options``: reference_muon's)."""
    muon = rm.reference_muon(model, lr, weight_decay, **options)
    kept = {k: v for k, v in options.items() if k not in ("tp_size", "expert_tp_size", "split_shapes",
                                                           "group_overrides")}
    return ReferenceSOAP(muon.param_groups, muon.matrices, lr, weight_decay, soap=soap, **kept)


__all__ = ["init_state", "soap_direction", "soap_step", "ReferenceSOAP", "reference_soap"]
