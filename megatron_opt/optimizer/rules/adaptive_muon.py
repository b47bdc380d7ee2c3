"""AdaptiveMuon: megatron-core's ``optimizer='adaptive_muon'`` (``TensorParallelAdaptiveMuon``: emerging-optimizers'
AdaptiveMuon step over megatron-core's tensor-parallel Muon orthogonalisation; docs/muon.md, "AdaptiveMuon").
A rule of the whole-tensor family (rules/whole_tensor_rule.py), Muon's with a second moment taken AFTER
orthogonalisation (megatron-core's order), of one of two kinds (``adaptive_muon_moment2_method``):

1. elementwise, on the owned ranges:   B, U as Muon's (``momentum_buffer``; Nesterov with ``muon_nesterov``)
2. per matrix, on its home rank:       O = extra_scale * scale(piece) * NS(U piece)   per piece (Muon's part 2)
   'normuon' (NorMuon), also at the home, on the TP-local block of O (m x n): per row when m >= n, else per column,
       V = lerp(V, mean(O*O along the other dimension), 1 - beta2)         (``moment2_buffer``: per-matrix state,
                                                                             m x 1 or 1 x n, fp32)
       N = O * rsqrt(max(V, eps)),   N = N * ||O||_F / max(||N||_F, eps)   (O's Frobenius norm kept)
3. elementwise, on the owned ranges:   'adamuon' (the default):
                                       V = lerp(V, O*O, 1 - beta2)                     (``moment2_buffer``, fp32)
                                       D = O / (sqrt(V) + eps) * scale(rows, cols) * extra_scale
                                       'normuon':  D = N * scale(rows, cols) * extra_scale
                                       W = W*(1 - lr*wd) - lr*D                        (decoupled weight decay)

The scale is applied twice, as megatron-core does: TensorParallelMuon's orthogonalisation returns the scaled O
(per piece, from the full shape under ``duplicated`` / ``distributed``), and AdaptiveMuon's step scales the
normalised update again by the scale of the whole TP-local matrix (``update.size(-2)``, ``update.size(-1)``).
With ``adamuon`` the first scale cancels but for ``eps``; with ``normuon`` it stays (the Frobenius norm of the
scaled O is kept). The constants are Muon's (``muon_*``) plus ``adaptive_muon_moment2_method``,
``adaptive_muon_beta2`` and ``adaptive_muon_eps``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from ...errors import UnsupportedConfigError
from ..verify.float64_update import FP32_UNIT, rounding_bound
from .base import CONFIG_OWNER, constant
from .muon import Muon, recompute_master
from .whole_tensor_rule import MatrixFacts, Scalar, TensorDict, state_tp_size_constant

MOMENT2_METHODS = ("adamuon", "normuon")  # megatron-core main's; emerging-optimizers' 'namo' it does not offer
# The elementwise part 3 in fp32: V's and D's roundings, relative to |D| (a few ulps, with headroom).
FINISH_RELATIVE_ERROR = 2e-6


@dataclass(frozen=True)
class AdaptiveMuon(Muon):
    """AdaptiveMuon's constants: Muon's (muon_* fields) and megatron-core's adaptive_muon_* fields, with its
    OptimizerConfig defaults."""

    beta2: float = constant(0.95, "adaptive_muon_beta2", low=0, high=1, help="AdaptiveMuon's second-moment decay")
    eps: float = constant(1e-8, "adaptive_muon_eps", low=0, low_open=False,
                          help="AdaptiveMuon's second-moment epsilon")
    moment2_method: str = constant("adamuon", "adaptive_muon_moment2_method", choices=MOMENT2_METHODS,
                                   help="AdaptiveMuon's second moment: adamuon = elementwise, normuon = per row "
                                        "(or column) of each matrix")
    state_tp_size: int = state_tp_size_constant()  # NorMuon's per-matrix moment (no effect with adamuon)
    name: ClassVar[str] = "adaptive_muon"
    aliases: ClassVar[tuple[str, ...]] = ()
    precision_aware: ClassVar[bool] = False  # fp32 moments only (refused by name by the registry)
    # NorMuon's per-matrix moment is read after part 2's update, on its TP-local block (megatron-core's order at
    # every muon_tp_mode).
    state_follows_update: ClassVar[bool] = True

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        method = getattr(config, "adaptive_muon_moment2_method", "adamuon")
        if method not in MOMENT2_METHODS:
            raise UnsupportedConfigError(
                f"{CONFIG_OWNER}.adaptive_muon_moment2_method={method!r}: megatron_opt implements "
                f"{' and '.join(repr(m) for m in MOMENT2_METHODS)}, megatron-core's choices (emerging-optimizers' "
                f"'namo' megatron-core does not offer); use one of those.")
        if method == "normuon" and getattr(config, "optimizer_cuda_graph", False):
            raise UnsupportedConfigError(
                f"{CONFIG_OWNER}.optimizer_cuda_graph=True with adaptive_muon_moment2_method='normuon': its per-row "
                f"second moment is per-matrix state, replaced by a host-decided step; leave optimizer_cuda_graph "
                f"False (or use 'adamuon').")

    @property
    def per_row(self) -> bool:
        """NorMuon: the second moment per row (or column) of each matrix, kept at its home."""
        return self.moment2_method == "normuon"

    @property
    def finish_state(self) -> tuple[str, ...]:  # type: ignore[override]
        return () if self.per_row else ("moment2_buffer",)

    def state_dtypes(self) -> dict[str, torch.dtype]:
        if self.per_row:
            return {"momentum_buffer": self.momentum_dtype}
        return {"momentum_buffer": self.momentum_dtype, "moment2_buffer": torch.float32}

    # ----------------------------------------------------------------- NorMuon's per-matrix state
    def matrix_state(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not self.per_row:
            return {}
        return {"moment2_buffer": (_reduced_shape(shape), torch.float32)}

    def update_with_state(self, update: torch.Tensor, state: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        """NorMuon (the module docstring) on the TP-local block of O, emerging-optimizers' operations in order."""
        if not self.per_row:
            return update, state
        dim = _averaged_dim(update.shape)
        v = torch.lerp(state["moment2_buffer"], update.square().mean(dim=dim, keepdim=True), 1.0 - self.beta2)
        normalised = update * v.clamp_min(self.eps).rsqrt()
        kept = torch.linalg.vector_norm(update) / torch.linalg.vector_norm(normalised).clamp_min(self.eps)
        return normalised * kept, {"moment2_buffer": v}

    def recompute_update_with_state(self, update: torch.Tensor, tolerance: float, before: TensorDict,
                                    after: TensorDict
                                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """NorMuon in float64 from O (||O - O_fp32||_F <= ``tolerance``, so each element, row and column too) and
        the stored pre-step V; bounds carried through each operation (a row's mean of squares moves by at most
        (2 ||O_row|| tau + tau^2) / k, Cauchy-Schwarz), plus fp32's roundings (a reduction over k elements:
        (sqrt(k) + 16) ulps relative, its blocked summation's error with headroom)."""
        if not self.per_row:
            return super().recompute_update_with_state(update, tolerance, before, after)
        o, tau, u = update, float(tolerance), FP32_UNIT
        dim = _averaged_dim(o.shape)
        k = o.shape[dim]
        v0 = before["moment2_buffer"].double()
        mean = (o * o).mean(dim=dim, keepdim=True)
        v = v0 + (1.0 - self.beta2) * (mean - v0)
        line_norm = torch.linalg.vector_norm(o, dim=dim, keepdim=True)
        d_mean = (2 * line_norm * tau + tau * tau) / k + (k ** 0.5 + 16) * u * mean
        dv = rounding_bound(self.beta2 * v0, (1.0 - self.beta2) * mean) + (1.0 - self.beta2) * d_mean
        s = v.clamp_min(self.eps).rsqrt()
        ds = torch.maximum((v - dv).clamp_min(self.eps).rsqrt() - s, s - (v + dv).clamp_min(self.eps).rsqrt()) \
            + 4 * u * s
        y = o * s
        dy = tau * s + (o.abs() + tau) * ds + 2 * u * y.abs()
        n_o, n_y = torch.linalg.vector_norm(o), torch.linalg.vector_norm(y)
        norm_rounding = (o.numel() ** 0.5 + 16) * u
        dn_o = tau + norm_rounding * n_o
        # ||Y - Y_fp32||_F: O's error (Frobenius tau) through s, s's through O, and Y's rounding.
        dn_y = tau * float(s.max()) + torch.linalg.vector_norm((o.abs() + tau) * ds) \
            + torch.linalg.vector_norm(2 * u * y) + norm_rounding * n_y
        c = n_o / n_y.clamp_min(self.eps)
        low = (n_y - dn_y).clamp_min(self.eps)
        dc = (n_o + dn_o) / low - c if n_y > self.eps else (dn_o / self.eps) * torch.ones_like(c)
        out = y * c
        bound = dy * (c + dc) + y.abs() * dc + 4 * u * out.abs()
        stored = after["moment2_buffer"].double()
        return out, bound, {"moment2_buffer": (stored, v, dv)}

    # ----------------------------------------------------------------- part 3
    def whole_scale(self, matrix: MatrixFacts) -> float:
        """The second scale: of the whole (TP-local) matrix, the extra scale included."""
        return self.scale(*matrix.shape)

    def finish(self, master: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: Scalar, weight_decay: Scalar,
               matrix: MatrixFacts) -> None:
        if self.per_row:  # normalised at the home (update_with_state)
            self.apply_direction(master, update * self.whole_scale(matrix), lr, weight_decay)
            return
        v = state["moment2_buffer"]
        v.lerp_(update.square(), 1.0 - self.beta2)
        normalised = update / (v.sqrt() + self.eps) * self.whole_scale(matrix)
        self.apply_direction(master, normalised, lr, weight_decay)

    def recompute_finish(self, w0: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: float,
                         weight_decay: float, update_tolerance: float, matrix: MatrixFacts
                         ) -> tuple[TensorDict, TensorDict]:
        """Part 3 in float64. The bound on D: O's (matrix-relative) error moves V by (1-beta2)*(2|O|dO + dO^2) and D by
        at most dO/(sqrt(V)+eps) * (1 + |O|*(1-beta2)*|O|/(sqrt(V)*(sqrt(V)+eps))) <= 2*dO/(sqrt(V)+eps), scaled;
        plus fp32's roundings of V and D. NorMuon: D = N * scale, N and its bound from the home."""
        if self.per_row:
            scale = self.whole_scale(matrix)
            d = update * scale
            w, dw = recompute_master(w0, d, lr, weight_decay, 0.0)
            dd = update_tolerance * abs(scale) + FINISH_RELATIVE_ERROR * d.abs()
            return {"master": w}, {"master": dw + lr * dd}
        v0 = state["moment2_buffer"]
        o2 = update * update
        v = v0 + (1.0 - self.beta2) * (o2 - v0)
        denom = v.sqrt() + self.eps
        scale = self.whole_scale(matrix)
        d = update / denom * scale
        # O's error dO moves O^2 by up to 2|O| dO + dO^2: the square term matters where O is near 0 and dO is large
        # (muon_fp32_matmul_prec 'medium', bf16 Newton-Schulz: dO is half the scale).
        dv = rounding_bound(self.beta2 * v0, (1.0 - self.beta2) * o2) + (1.0 - self.beta2) \
            * (2 * update.abs() * update_tolerance + update_tolerance * update_tolerance)
        # |O| / sqrt(V) <= 1 / sqrt(1 - beta2): |D| never exceeds that, whatever O's error.
        dd = torch.clamp(2 * update_tolerance / denom, max=2 / (1.0 - self.beta2) ** 0.5) * abs(scale) \
            + FINISH_RELATIVE_ERROR * d.abs()
        w, dw = recompute_master(w0, d, lr, weight_decay, 0.0)
        return {"master": w, "moment2_buffer": v}, {"master": dw + lr * dd, "moment2_buffer": dv}


def _averaged_dim(shape: Sequence[int]) -> int:
    """NorMuon's averaged dimension: along each row (-1) when rows >= cols, else along each column (-2)."""
    return -1 if shape[-2] >= shape[-1] else -2


def _reduced_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The shape of NorMuon's second moment of a (rows, cols) matrix: (rows, 1) or (1, cols)."""
    rows, cols = shape
    return (rows, 1) if _averaged_dim(shape) == -1 else (1, cols)


__all__ = ["AdaptiveMuon", "MOMENT2_METHODS"]
