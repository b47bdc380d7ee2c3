"""SOAP: megatron-core's ``optimizer='soap'`` (emerging-optimizers 0.3.0's ``SOAP`` as megatron-core configures
it: Shampoo's Kronecker factors, Adam in their eigenbasis; docs/muon.md, "SOAP"). The first rule of the
whole-tensor family (rules/whole_tensor_rule.py) with per-matrix state: every piece of its state lives once, at the
matrix's home (optimizer/whole_tensor/leaf.py), because each is read in a rotated basis of the whole matrix.

1. elementwise, on the owned ranges:   g = grad * grad_scale
2. per matrix, on its home rank, with its state (t = this update's 1-based count):
       b_t = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)                  (the bias-corrected factor decay)
       L, R = lerp(L, G G^T, 1 - b_t), lerp(R, G^T G, 1 - b_t)               (KL-Shampoo: G R~^-1 G^T / n and
                                                                             G^T L~^-1 G / m, L~, R~ from the
                                                                             old eigenbases, clamped at eps)
       M = Q_L M Q_R^T                                                     (exp_avg back to the plain basis)
       Q sorted by Q^T K Q's diagonal (descending), V permuted alike        (exp_avg_sq follows its columns)
       Q_L, Q_R = eigh(L), eigh(R) at t = 1, else one power step + QR      (orthogonal iteration)
       M = Q_L^T M Q_R,   G' = Q_L^T G Q_R
       M = lerp(M, G', 1 - beta1),   V = lerp(V, G'^2, 1 - beta2)
       D = Q_L [ (M / (1 - beta1^t)) / (sqrt(V / (1 - beta2^t)) + eps) ] Q_R^T
3. elementwise, on the owned ranges:   W = W - lr*wd*W,  then W = W - lr*D  (decoupled weight decay)

megatron-core's configuration: betas = (adam_beta1, adam_beta2), shampoo_beta = soap_shampoo_beta,
use_kl_shampoo = soap_use_kl_shampoo, eps 1e-8 (SOAP's own, not adam_eps), and SOAP's defaults: no Nesterov, bias
correction (also of shampoo_beta), eigh on the first step then one power-iteration step, fp32 matmul precision
'high', no update-RMS clipping. Under tensor parallelism megatron-core runs the plain SOAP on each TP-local
block; so does this rule (``blockwise``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch

from ...errors import UnsupportedConfigError
from .base import CONFIG_OWNER, constant
from .muon import float32_matmul_precision, recompute_master
from .soap_float64 import recompute_soap_step
from .whole_tensor_rule import MatrixFacts, Scalar, TensorDict, WholeTensorRule, state_tp_size_constant

MATMUL_PRECISION = "high"  # emerging-optimizers' default for SOAP's GEMMs and QR (TF32 on CUDA, fp32 on the CPU)
MATRIX_STATE = ("exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # exp_avg / exp_avg_sq storage (the precision-aware optimizer)


@dataclass(frozen=True)
class SOAP(WholeTensorRule):
    """SOAP's constants, with megatron-core's OptimizerConfig defaults."""

    beta1: float = constant(0.9, "adam_beta1", low=0, high=1, help="Adam's beta1 (SOAP's inner Adam takes it)")
    beta2: float = constant(0.999, "adam_beta2", low=0, high=1, help="Adam's beta2 (SOAP's inner Adam takes it)")
    shampoo_beta: float = constant(0.95, "soap_shampoo_beta", low=0, high=1,
                                   help="SOAP's decay of the Kronecker factors L and R")
    use_kl_shampoo: bool = constant(True, "soap_use_kl_shampoo", flag="--soap-no-kl-shampoo",
                                    help="SOAP's plain Shampoo factors instead of KL-Shampoo's (default: KL-Shampoo)")
    # megatron-core has no field for it (it leaves SOAP's own 1e-8, not adam_eps): megatron_opt's own name, carried
    # by OptimizerConfig.rule_constants and the main job's --soap-eps.
    eps: float = constant(1e-8, "soap_eps", low=0, help="SOAP's epsilon (default SOAP's own 1e-8, as megatron-core "
                                                        "leaves it; megatron-core does not pass adam_eps)")
    # The precision-aware optimizer: exp_avg_dtype / exp_avg_sq_dtype store SOAP's Adam moments (in the rotated
    # basis, per matrix); the factors and their bases stay fp32 (their eigenvectors need it).
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    state_tp_size: int = state_tp_size_constant()
    name: ClassVar[str] = "soap"
    aliases: ClassVar[tuple[str, ...]] = ()
    precision_aware: ClassVar[bool] = True
    # Its per-matrix state is 4 (2 m^2 + 2 n^2 + 2 m n) bytes and its step ~m^3 + n^3: balancing them over every
    # rank, not only the matrix's owners, is worth moving the whole matrix (docs/benchmarks.md, "SOAP's state").
    homes_anywhere: ClassVar[bool] = True

    @classmethod
    def check_config(cls, config: Any) -> None:
        """What SOAP does not run, refused by name: fp16, 16-bit masters, fp16 moments, stochastic rounding, the
        device-decided step (its eigendecomposition syncs with the host). (megatron-core 0.19's
        soap_precondition_frequency, which it never reads, is accepted at 1 only: core_config_fields.py.)"""
        if getattr(config, "fp16", False):
            raise UnsupportedConfigError(f"{CONFIG_OWNER}.fp16=True with optimizer='soap': use bf16 (SOAP's state is "
                                         f"fp32; megatron-core's SOAP does not take fp16 either).")
        if getattr(config, "main_params_dtype", torch.float32) != torch.float32:
            raise UnsupportedConfigError(f"{CONFIG_OWNER}.main_params_dtype={config.main_params_dtype} with "
                                         f"optimizer='soap': SOAP keeps fp32 masters; leave it at torch.float32.")
        for field in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(config, field, torch.float32)
            if value not in MOMENT_DTYPES:
                raise UnsupportedConfigError(
                    f"{CONFIG_OWNER}.{field}={value} with optimizer='soap': it stores SOAP's per-matrix "
                    f"{field[:-6]} (and AdamW's {field[:-6]}), implemented in torch.float32 or torch.bfloat16; use "
                    f"one of those.")
        if getattr(config, "stochastic_rounding", False):
            raise UnsupportedConfigError(f"{CONFIG_OWNER}.stochastic_rounding=True with optimizer='soap': implemented "
                                         f"for AdamW's moments only; leave it False.")
        if getattr(config, "optimizer_cuda_graph", False):
            raise UnsupportedConfigError(f"{CONFIG_OWNER}.optimizer_cuda_graph=True with optimizer='soap': SOAP's "
                                         f"first-step eigendecomposition and its step count are read on the host, "
                                         f"which a captured step cannot do; leave optimizer_cuda_graph False.")

    @classmethod
    def from_config(cls, config: Any) -> "SOAP":
        cls.check_config(config)
        aware = getattr(config, "use_precision_aware_optimizer", False)
        return cls(**cls.constants_from(config),
                   exp_avg_dtype=getattr(config, "exp_avg_dtype", torch.float32) if aware else torch.float32,
                   exp_avg_sq_dtype=getattr(config, "exp_avg_sq_dtype", torch.float32) if aware else torch.float32)

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {}  # every piece of SOAP's state is per-matrix (matrix_state)

    # ----------------------------------------------------------------- per-matrix state
    def matrix_state(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        m, n = shape
        f32 = torch.float32
        return {"exp_avg": ((m, n), self.exp_avg_dtype), "exp_avg_sq": ((m, n), self.exp_avg_sq_dtype),
                "L": ((m, m), f32), "R": ((n, n), f32), "Q_L": ((m, m), f32), "Q_R": ((n, n), f32)}

    def new_matrix_state(self, shape: tuple[int, int], device: torch.device) -> TensorDict:
        state = super().new_matrix_state(shape, device)
        state["Q_L"] = torch.eye(shape[0], device=device)
        state["Q_R"] = torch.eye(shape[1], device=device)
        return state

    # ----------------------------------------------------------------- cost model
    def steady_cost(self, shape: tuple[float, float], pieces: int) -> float:
        """Multiply-adds of one step on (m, n): the factor updates (2 m n (m + n) with KL-Shampoo's corrections,
        m n (m + n) without), four projections (2 m n (m + n)), the power step and QR (about 3 (m^3 + n^3))."""
        m, n = shape
        factors = (2.0 if self.use_kl_shampoo else 1.0) * m * n * (m + n)
        return factors + 2.0 * m * n * (m + n) + 3.0 * (m ** 3 + n ** 3)

    def periodic_cost(self, shape: tuple[float, float], pieces: int) -> tuple[float, int]:
        return 0.0, 1  # emerging-optimizers 0.3.0 refreshes the eigenbases every step (in steady_cost)

    # ----------------------------------------------------------------- the step
    def direction(self, grad: torch.Tensor, grad_scale: torch.Tensor, state: TensorDict) -> torch.Tensor:
        return grad.float() * grad_scale

    def matrix_update(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]]) -> torch.Tensor:
        raise UnsupportedConfigError("SOAP's matrix update reads its per-matrix state: matrix_step(u, state, step).")

    def matrix_step(self, g: torch.Tensor, qkv_split: Optional[Sequence[int]], state: TensorDict,
                    step: int) -> tuple[torch.Tensor, TensorDict]:
        """Part 2 on one whole matrix ``g`` at its home (``step``: this update's 1-based count): (D, the new
        state). ``state`` is read, never written: the leaf keeps the new state only once the exchange succeeded."""
        with float32_matmul_precision(MATMUL_PRECISION):
            factors = [state["L"].clone(), state["R"].clone()]
            bases = [state["Q_L"], state["Q_R"]]
            decay = 1.0 - (1.0 - self.shampoo_beta) / (1.0 - self.shampoo_beta ** step)
            self._update_factors(factors, g, decay, bases)
            # 16-bit moments (precision-aware) are widened here; the update reads the unrounded fp32 result and
            # the leaf's commit rounds it once, to nearest (as AdamW's pass 2).
            exp_avg = _project(state["exp_avg"].float(), bases, back=True)
            bases, exp_avg_sq = _sorted_bases(factors, bases, state["exp_avg_sq"].float())
            bases = [_eigenbasis(k) if step == 1 else torch.linalg.qr(k @ q).Q for k, q in zip(factors, bases)]
            exp_avg = _project(exp_avg, bases)
            g_rotated = _project(g, bases)
            exp_avg.lerp_(g_rotated, 1.0 - self.beta1)
            exp_avg_sq.lerp_(g_rotated.square(), 1.0 - self.beta2)
            momentum = exp_avg / (1.0 - self.beta1 ** step)
            adam = momentum / ((exp_avg_sq / (1.0 - self.beta2 ** step)).sqrt() + self.eps)
            update = _project(adam, bases, back=True)
        return update, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "L": factors[0], "R": factors[1],
                        "Q_L": bases[0], "Q_R": bases[1]}

    def _update_factors(self, factors: list[torch.Tensor], g: torch.Tensor, decay: float,
                        bases: list[torch.Tensor]) -> None:
        """L and R in place: lerp towards G G^T and G^T G, or KL-Shampoo's G R~^-1 G^T / n and G^T L~^-1 G / m
        (R~, L~: the factors seen in their current eigenbases, eigenvalues clamped at eps)."""
        if not self.use_kl_shampoo:
            factors[0].lerp_(g @ g.T, 1.0 - decay)
            factors[1].lerp_(g.T @ g, 1.0 - decay)
            return
        targets = []
        for i, (k, q) in enumerate(zip(factors, bases)):
            eigenvalues = _diagonal_in_basis(k, q)
            scale = 1.0 / g.shape[i] * eigenvalues.clamp_min(self.eps) ** -1.0
            inverse = (q * scale[None, :]) @ q.T
            side = g.T if i == 1 else g
            targets.append(side.T @ inverse @ side)
        for k, target in zip(factors, targets[::-1]):  # L takes R~'s correction and R takes L~'s
            k.lerp_(target, 1.0 - decay)

    def finish(self, master: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: Scalar, weight_decay: Scalar,
               matrix: MatrixFacts) -> None:
        """W - lr*wd*W, then - lr*D: emerging-optimizers' two in-place adds, in their order and form (SOAP's step is
        decided on the host: ``lr`` and ``weight_decay`` are floats)."""
        if weight_decay != 0.0:
            master.add_(master, alpha=-float(weight_decay) * float(lr))
        master.add_(update, alpha=-float(lr))

    # ----------------------------------------------------------------- float64 recomputation (verify mode)
    def recompute_direction(self, g: torch.Tensor, state: TensorDict) -> tuple[TensorDict, TensorDict, torch.Tensor]:
        return {}, {}, g  # part 1 is the gradient itself: no elementwise state

    def matrix_tolerance(self, matrix: MatrixFacts, device: torch.device) -> float:
        raise UnsupportedConfigError("SOAP's update bound is elementwise: recompute_matrix_step gives it.")

    def recompute_matrix_step(self, g: torch.Tensor, before: TensorDict, after: TensorDict, step: int
                              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """Part 2 in float64 at the home (soap_float64.py): (D, its elementwise bound, per state name (stored,
        recomputed, bound)), given the eigenbases the step chose (see there why) and the column order it took: its
        own fp32 ops (``basis_order``) on the same stored bits, so the same order."""
        with float32_matmul_precision(MATMUL_PRECISION):
            orders = [basis_order(after[k], before[q]) for k, q in (("L", "Q_L"), ("R", "Q_R"))]
        return recompute_soap_step(self, g, before, after, step, orders)

    def recompute_finish(self, w0: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: float,
                         weight_decay: float, update_tolerance: torch.Tensor, matrix: MatrixFacts
                         ) -> tuple[TensorDict, TensorDict]:
        w, dw = recompute_master(w0, update, lr, weight_decay, update_tolerance)
        return {"master": w}, {"master": dw}


def _project(x: torch.Tensor, bases: Sequence[torch.Tensor], back: bool = False) -> torch.Tensor:
    """Q_L^T X Q_R (into the eigenbasis), or Q_L X Q_R^T (``back``), as tensor contractions in emerging-optimizers'
    order (its results are bitwise those)."""
    dims = [[0], [1]] if back else [[0], [0]]
    for q in bases:
        x = torch.tensordot(x, q, dims=dims)
    return x


def _diagonal_in_basis(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """diag(Q^T K Q): the factor's approximate eigenvalues in the basis Q."""
    return ((q.T @ k) * q.T).sum(dim=1)


def basis_order(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The column order of basis ``q`` by descending approximate eigenvalue of factor ``k``."""
    return torch.argsort(_diagonal_in_basis(k, q), descending=True)


def _sorted_bases(factors: Sequence[torch.Tensor], bases: Sequence[torch.Tensor],
                  exp_avg_sq: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each basis's columns by descending approximate eigenvalue (diag(Q^T K Q)), exp_avg_sq permuted alike."""
    out = []
    for dim, (k, q) in enumerate(zip(factors, bases)):
        order = basis_order(k, q)
        out.append(q[:, order])
        exp_avg_sq = exp_avg_sq.index_select(dim, order)
    return out, exp_avg_sq


def _eigenbasis(k: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of symmetric ``k``, by descending eigenvalue (in float64 if the fp32 solver fails)."""
    try:
        vectors = torch.linalg.eigh(k).eigenvectors
    except (torch.linalg.LinAlgError, RuntimeError):
        vectors = torch.linalg.eigh(k.double()).eigenvectors.to(k.dtype)
    return torch.flip(vectors, [-1])


__all__ = ["SOAP", "MATRIX_STATE", "basis_order"]
