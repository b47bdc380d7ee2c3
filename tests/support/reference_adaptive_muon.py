"""AdaptiveMuon + AdamW in float64 on whole-model tensors, written from the formulas (a test reference).

The semantics are megatron-core's ``OptimizerConfig(optimizer="adaptive_muon")`` (``TensorParallelAdaptiveMuon``:
emerging-optimizers' AdaptiveMuon step over megatron-core's tensor-parallel Muon orthogonalisation,
moment2_method 'adamuon'), stated as formulas. Params, groups, momentum, Nesterov, NS, pieces and AdamW are
tests/support/reference_muon.py's; per AdaptiveMuon param:

      W <- W * (1 - lr*wd)                                   decoupled weight decay
      B <- beta*B + (1-beta)*g,  U = (1-beta)*g + beta*B (Nesterov) or B
      O  = orthogonalized_update(U)     reference_muon's: per piece NS * scale(piece) * extra_scale
                                        (``prescale=False``: NS of the whole matrix alone, no pieces:
                                        emerging-optimizers' own AdaptiveMuon class)
      V <- beta2*V + (1-beta2)*O*O                            ``moment2_buffer``: AFTER orthogonalisation
      D  = O / (sqrt(V) + eps) * scale(rows, cols) * extra_scale     the TP-local matrix's shape
      W <- W - lr * D

``moment2_method='normuon'`` (NorMuon), on each TP-local block of O (rows x cols):
      V <- beta2*V + (1-beta2)*mean_j(O_ij^2)   per row when rows >= cols (V: rows x 1), else per column (1 x cols)
      N  = O / sqrt(max(V, eps)),   N <- N * ||O||_F / max(||N||_F, eps)
      D  = N * scale(rows, cols) * extra_scale
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from tests.support import reference_muon as rm


class ReferenceAdaptiveMuon(rm.ReferenceMuon):
    """AdaptiveMuon for the groups marked ``muon=True``, AdamW for the rest (see the module docstring)."""

    def __init__(self, params: Iterable, matrices: Mapping[torch.Tensor, rm.MuonMatrix], lr: float,
                 weight_decay: float, *, beta2: float = 0.95, eps: float = 1e-8, prescale: bool = True,
                 moment2_method: str = "adamuon", **options) -> None:
        super().__init__(params, matrices, lr, weight_decay, **options)
        self.adaptive = dict(beta2=beta2, eps=eps, prescale=prescale, moment2_method=moment2_method)

    def _muon_direction(self, p: torch.Tensor) -> torch.Tensor:
        m, a = self.muon, self.adaptive
        extra = m["extra_scale"]
        o = super()._muon_direction(p) if a["prescale"] else self._unscaled(p)
        if a["moment2_method"] == "normuon":
            return self._normuon(p, o) * extra
        v = self.state[p].setdefault("moment2_buffer", torch.zeros_like(p))
        v.mul_(a["beta2"]).add_((1 - a["beta2"]) * o * o)
        rows, cols = self._local_shape(p)
        return o / (v.sqrt() + a["eps"]) * rm.scale_factor(rows, cols, m["scale_mode"]) * extra

    def _normuon(self, p: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """NorMuon on each TP-local block of ``o``, times the block's scale (without the extra scale). The state:
        ``moment2_blocks`` (one V per block, in block order) and ``moment2_buffer`` (the first block's)."""
        a = self.adaptive
        matrix = self.matrices[p]
        split = matrix.tp_size > 1 and matrix.partition_dim is not None
        blocks = o.chunk(matrix.tp_size, dim=matrix.partition_dim) if split else (o,)
        vs = self.state[p].setdefault("moment2_blocks", [None] * len(blocks))
        out = []
        for i, b in enumerate(blocks):
            dim = -1 if b.shape[0] >= b.shape[1] else -2
            mean = (b * b).mean(dim=dim, keepdim=True)
            vs[i] = (1 - a["beta2"]) * mean if vs[i] is None else a["beta2"] * vs[i] + (1 - a["beta2"]) * mean
            n = b / vs[i].clamp_min(a["eps"]).sqrt()
            n = n * (b.norm() / n.norm().clamp_min(a["eps"]))
            out.append(n * rm.scale_factor(*b.shape, self.muon["scale_mode"]))
        self.state[p]["moment2_buffer"] = vs[0]
        return torch.cat(out, dim=matrix.partition_dim) if split else out[0]

    def _unscaled(self, p: torch.Tensor) -> torch.Tensor:
        return rm.newton_schulz(self._momentum(p), self.muon["steps"])

    def _local_shape(self, p: torch.Tensor) -> tuple[int, int]:
        matrix = self.matrices[p]
        rows, cols = p.shape
        if matrix.tp_size > 1 and matrix.partition_dim is not None:
            if matrix.partition_dim == 0:
                rows //= matrix.tp_size
            else:
                cols //= matrix.tp_size
        return rows, cols


def reference_adaptive_muon(model: torch.nn.Module, lr: float, weight_decay: float, *, beta2: float = 0.95,
                            eps: float = 1e-8, prescale: bool = True, moment2_method: str = "adamuon",
                            **options) -> ReferenceAdaptiveMuon:
    """reference_muon's groups over ``model``, stepped as AdaptiveMuon (``options``: reference_muon's)."""
    muon = rm.reference_muon(model, lr, weight_decay, **options)
    kept = {k: v for k, v in options.items() if k not in ("tp_size", "expert_tp_size", "split_shapes",
                                                           "group_overrides")}
    return ReferenceAdaptiveMuon(muon.param_groups, muon.matrices, lr, weight_decay, beta2=beta2, eps=eps,
                                 prescale=prescale, moment2_method=moment2_method, **kept)


__all__ = ["ReferenceAdaptiveMuon", "reference_adaptive_muon"]
