"""AdaptiveMuon: megatron-core's ``optimizer='adaptive_muon'`` (``TensorParallelAdaptiveMuon``: emerging-optimizers'
AdaptiveMuon step over megatron-core's tensor-parallel Muon orthogonalisation; docs/muon.md, "AdaptiveMuon").
A rule of the whole-tensor family (rules/whole_tensor_rule.py), Muon's with an elementwise second moment
taken AFTER orthogonalisation (megatron-core's order; ``moment2_method='adamuon'``):

1. elementwise, on the owned ranges:   B, U as Muon's (``momentum_buffer``; Nesterov with ``muon_nesterov``)
2. per matrix, on its home rank:       O = extra_scale * scale(piece) * NS(U piece)   per piece (Muon's part 2)
3. elementwise, on the owned ranges:   V = lerp(V, O*O, 1 - beta2)                     (``moment2_buffer``, fp32)
                                       D = O / (sqrt(V) + eps) * scale(rows, cols) * extra_scale
                                       W = W*(1 - lr*wd) - lr*D                        (decoupled weight decay)

The scale is applied twice, as megatron-core does: TensorParallelMuon's orthogonalisation returns the scaled O
(per piece, from the full shape under ``duplicated`` / ``distributed``), and AdaptiveMuon's step scales the
normalised update again by the scale of the whole TP-local matrix (``update.size(-2)``, ``update.size(-1)``).
With ``adamuon`` the first scale cancels but for ``eps``. The constants are Muon's (``muon_*``) plus
``adaptive_muon_beta2`` and ``adaptive_muon_eps``; ``adaptive_muon_moment2_method`` must be ``'adamuon'``
(``normuon`` keeps per-row state at the matrix's home, which is not implemented yet; refused by name).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import UnsupportedConfigError
from ..verify.float64_update import rounding_bound
from .base import CONFIG_OWNER, constant
from .muon import Muon, recompute_master
from .whole_tensor_rule import MatrixFacts, Scalar, TensorDict

MOMENT2_METHODS = ("adamuon",)  # megatron-core main also takes "normuon" (per-matrix state: not implemented yet)
# The elementwise part 3 in fp32: V's and D's roundings, relative to |D| (a few ulps, with headroom).
FINISH_RELATIVE_ERROR = 2e-6


@dataclass(frozen=True)
class AdaptiveMuon(Muon):
    """AdaptiveMuon's constants: Muon's (muon_* fields) and megatron-core's adaptive_muon_* fields, with its
    OptimizerConfig defaults."""

    beta2: float = constant(0.95, "adaptive_muon_beta2", low=0, high=1, help="AdaptiveMuon's second-moment decay")
    eps: float = constant(1e-8, "adaptive_muon_eps", low=0, low_open=False,
                          help="AdaptiveMuon's second-moment epsilon")
    name: ClassVar[str] = "adaptive_muon"
    aliases: ClassVar[tuple[str, ...]] = ()
    precision_aware: ClassVar[bool] = False  # fp32 moments only (refused by name by the registry)
    finish_state: ClassVar[tuple[str, ...]] = ("moment2_buffer",)

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        method = getattr(config, "adaptive_muon_moment2_method", "adamuon")
        if method not in MOMENT2_METHODS:
            raise UnsupportedConfigError(
                f"{CONFIG_OWNER}.adaptive_muon_moment2_method={method!r}: megatron_opt implements 'adamuon' (the "
                f"elementwise second moment, megatron-core's default); 'normuon' keeps a per-row second moment at "
                f"each matrix's home (per-matrix state), not implemented yet (issue #39).")

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"momentum_buffer": self.momentum_dtype, "moment2_buffer": torch.float32}

    def whole_scale(self, matrix: MatrixFacts) -> float:
        """The second scale: of the whole (TP-local) matrix, the extra scale included."""
        return self.scale(*matrix.shape)

    def finish(self, master: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: Scalar, weight_decay: Scalar,
               matrix: MatrixFacts) -> None:
        v = state["moment2_buffer"]
        v.lerp_(update.square(), 1.0 - self.beta2)
        normalised = update / (v.sqrt() + self.eps) * self.whole_scale(matrix)
        self.apply_direction(master, normalised, lr, weight_decay)

    def recompute_finish(self, w0: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: float,
                         weight_decay: float, update_tolerance: float, matrix: MatrixFacts
                         ) -> tuple[TensorDict, TensorDict]:
        """Part 3 in float64. The bound on D: O's (matrix-relative) error moves V by (1-beta2)*(2|O|dO + dO^2) and D by
        at most dO/(sqrt(V)+eps) * (1 + |O|*(1-beta2)*|O|/(sqrt(V)*(sqrt(V)+eps))) <= 2*dO/(sqrt(V)+eps), scaled;
        plus fp32's roundings of V and D."""
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


__all__ = ["AdaptiveMuon", "MOMENT2_METHODS"]
