"""Muon: megatron-core's ``optimizer='muon'`` (emerging-optimizers' orthogonalized optimizer as
megatron-core configures it; docs/muon.md). A whole-tensor rule: its update of a matrix reads the
whole matrix, so the step runs it in three parts (optimizer/whole_tensor/leaf.py):

1. elementwise, on the owned ranges:   g = grad * grad_scale
                                       B = beta*B + (1-beta)*g              (``momentum_buffer``, fp32)
                                       U = (1-beta)*g + beta*B  (Nesterov)  else  U = B
2. per matrix, on its home rank:       O = extra_scale * scale(piece) * NS(U piece)   per piece
   (pieces: the whole matrix, or with ``split_qkv`` its Q, K and V rows across all query groups)
3. elementwise, on the owned ranges:   W = W*(1 - lr*wd) - lr*O               (decoupled weight decay)

NS: X = U / max(||U||_F, 1e-7) in its wide orientation (transposed when rows > cols), then
``num_ns_steps`` times X = a X + (b A + c A A) X with A = X X^T, cycling the quintic (a, b, c).
``fp32_matmul_prec='medium'`` runs the iteration in bf16 (as megatron-core does, on the CPU too);
'high' / 'highest' in fp32 (torch's float32 matmul precision set around it: TF32 for 'high' on GPU).
scale: spectral sqrt(max(m, n)); unit_rms_norm sqrt(m/n); shape_scaling sqrt(max(1, m/n)).

Under tensor parallelism (``tp_mode``): ``blockwise`` runs part 2 on the TP-local block (pieces and
scale from the local shape); ``duplicated`` and ``distributed`` orthogonalise the full matrix of each
piece across the TP ranks (scale from the full shape): optimizer/whole_tensor/tensor_parallel_newton_schulz.py.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence, Union

import torch

from ...errors import InvalidConfigError, UnsupportedConfigError
from ..verify.float64_update import rounding_bound
from .base import CONFIG_OWNER, Needs, constant, is_matrix_param
from .whole_tensor_rule import MatrixFacts, Scalar, TensorDict, WholeTensorRule

# The quintic Newton-Schulz coefficients (a, b, c), used in turn (Keller Jordan's set, as
# emerging-optimizers' "quintic" table).
QUINTIC: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
NS_EPS = 1e-7
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("medium", "high", "highest")
TP_MODES = ("blockwise", "duplicated", "distributed")
QKV_SPLIT_ATTR = "qkv_split_shapes"  # on a param: rows of (Q, K, V) in one query group


def uses_muon(param: torch.Tensor) -> bool:
    """megatron-core's split (``is_matrix_param``): a 2-D param not marked ``is_embedding_or_output_parameter``
    gets Muon."""
    return is_matrix_param(param)


_SCALES = {  # (rows, cols) of the orthogonalised piece -> its scale
    "spectral": lambda m, n: max(m, n) ** 0.5,
    "unit_rms_norm": lambda m, n: (m / n) ** 0.5,
    "shape_scaling": lambda m, n: max(1.0, m / n) ** 0.5,
}


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode not in _SCALES:
        raise InvalidConfigError(f"Muon.scale_mode={mode!r} is not one of {', '.join(repr(m) for m in SCALE_MODES)}.")
    return _SCALES[mode](rows, cols)


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(u: torch.Tensor, steps: int, precision: str = "high") -> torch.Tensor:
    """The quintic Newton-Schulz approximation of the orthogonal polar factor of a 2-D ``u`` (fp32 out;
    float64 in gives float64 out, whatever ``precision``: the verify-mode recomputation)."""
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / x.norm().clamp_min(NS_EPS)
    if precision == "medium" and x.dtype == torch.float32:
        x = x.to(torch.bfloat16)
    with float32_matmul_precision(precision if precision in MATMUL_PRECISIONS else "highest"):
        for i in range(steps):
            x = newton_schulz_step(x, x @ x.T, *QUINTIC[i % len(QUINTIC)])
    x = x.to(u.dtype)
    return x.T if tall else x


def newton_schulz_step(x: torch.Tensor, gram: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One quintic step from ``x`` and its Gram matrix ``x @ x.T``: a x + (b G + c G G) x, as two
    ``addmm`` (megatron-core's arithmetic): the scalings ride in the GEMMs, which on the CPU saves 10% of
    a step in fp32 and 30% in bf16 over separate elementwise passes."""
    return torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a, alpha=1.0)


@dataclass(frozen=True)
class Muon(WholeTensorRule):
    """Muon's constants, with megatron-core's OptimizerConfig defaults (muon_* fields); Megatron-LM's flags
    default to --muon-momentum 0.9 and --muon-tp-mode duplicated."""

    momentum: float = constant(0.95, "muon_momentum", low=0, high=1, flag_default=0.9,
                               help="Muon's momentum (Megatron-LM's default 0.9; megatron-core's OptimizerConfig "
                                    "default is 0.95)")
    nesterov: bool = constant(False, "muon_nesterov", help="Nesterov momentum")
    num_ns_steps: int = constant(5, "muon_num_ns_steps", low=1, integer=True)
    scale_mode: str = constant("spectral", "muon_scale_mode", choices=SCALE_MODES)
    extra_scale_factor: float = constant(1.0, "muon_extra_scale_factor")
    split_qkv: bool = constant(True, "muon_split_qkv", flag="--muon-no-split-qkv",
                               help="orthogonalize the fused QKV weight as one matrix (default: Q, K and V each)")
    fp32_matmul_prec: str = constant("medium", "muon_fp32_matmul_prec", choices=MATMUL_PRECISIONS,
                                     help="Newton-Schulz matmul precision: medium = bf16, high = TF32 on CUDA (fp32 on "
                                          "the CPU), highest = fp32")
    tp_mode: str = constant("blockwise", "muon_tp_mode", choices=TP_MODES, flag_default="duplicated",
                            help="Newton-Schulz of tensor-parallel weights (no effect at tensor-parallel size 1)")
    # momentum_buffer's storage: fp32, or bf16 with the precision-aware optimizer (OptimizerConfig.exp_avg_dtype)
    momentum_dtype: torch.dtype = torch.float32
    name: ClassVar[str] = "muon"
    aliases: ClassVar[tuple[str, ...]] = ("dist_muon",)  # Megatron-LM's synonym (its distributed Muon): the same rule
    needs: ClassVar[Needs] = Needs.WHOLE_TENSORS
    precision_aware: ClassVar[bool] = True  # exp_avg_dtype stores the momentum_buffer
    direction_state: ClassVar[tuple[str, ...]] = ("momentum_buffer",)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """What Muon does not implement, refused by name: other Newton-Schulz coefficients, fp16, stochastic
        rounding, and of the precision-aware optimizer an fp16 momentum or 16-bit masters."""
        if config.muon_coefficient_type != "quintic":
            raise UnsupportedConfigError(f"muon_coefficient_type={config.muon_coefficient_type!r}: only 'quintic' "
                                         f"is implemented.")
        for name, why in (("fp16", "megatron-core refuses fp16 with Muon too; use bf16"),
                          ("stochastic_rounding", "Muon's momentum_buffer rounds to nearest (stochastic rounding "
                                                  "is implemented for AdamW's moments only); leave it False")):
            if getattr(config, name):
                raise UnsupportedConfigError(f"{CONFIG_OWNER}.{name}=True with optimizer={config.optimizer!r}: {why}.")
        # The precision-aware optimizer: exp_avg_dtype stores Muon's momentum_buffer (the first moment,
        # the same EMA of the gradients as AdamW's exp_avg) and AdamW's exp_avg; exp_avg_sq_dtype and
        # store_param_remainders apply to the AdamW params; Muon's masters stay fp32.
        if config.exp_avg_dtype not in (torch.float32, torch.bfloat16):
            raise UnsupportedConfigError(
                f"{CONFIG_OWNER}.exp_avg_dtype={config.exp_avg_dtype} with optimizer={config.optimizer!r}: it stores "
                f"Muon's momentum_buffer, implemented in torch.float32 or torch.bfloat16; use one of those.")
        if config.main_params_dtype != torch.float32:
            raise UnsupportedConfigError(
                f"{CONFIG_OWNER}.main_params_dtype={config.main_params_dtype} with optimizer={config.optimizer!r}: "
                f"Muon keeps fp32 masters (16-bit masters are implemented for AdamW only); leave main_params_dtype "
                f"at torch.float32.")

    @classmethod
    def from_config(cls, config: Any) -> "Muon":
        cls.check_config(config)
        return cls(**cls.constants_from(config),
                   momentum_dtype=(config.exp_avg_dtype if getattr(config, "use_precision_aware_optimizer", False)
                                   else torch.float32))

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"momentum_buffer": self.momentum_dtype}

    # ----------------------------------------------------------------- part 1 and 3: elementwise on owned ranges
    def momentum_direction(self, grad: torch.Tensor, grad_scale: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Part 1 on one owned range: updates ``buf`` in place, returns U (fp32)."""
        beta = self.momentum
        g = grad.float() * grad_scale
        buf.mul_(beta).add_(g, alpha=1.0 - beta)
        return g.mul_(1.0 - beta).add_(buf, alpha=beta) if self.nesterov else buf.clone()

    @staticmethod
    def apply_direction(master: torch.Tensor, direction: torch.Tensor, lr: Union[float, torch.Tensor],
                        weight_decay: Union[float, torch.Tensor]) -> None:
        """Part 3 on one owned range: W = W*(1 - lr*wd) - lr*O, in place. ``lr`` and ``weight_decay`` are
        host floats, or 0-d device tensors (the step decided on the device reads the staged table): the
        same roundings either way (lr*O rounded, then added), so both steps are bitwise the same."""
        if isinstance(weight_decay, torch.Tensor) or weight_decay != 0.0:
            master.mul_(1.0 - lr * weight_decay)
        master.add_(direction * -lr)

    # ----------------------------------------------------------------- part 2: on the whole matrix
    def orthogonalize(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]] = None) -> torch.Tensor:
        """O of a whole matrix ``u`` (fp32 in, fp32 out; float64 in, float64 out): per piece (the matrix,
        or its Q, K and V rows across all query groups) NS times its scale, times the extra scale."""
        outs = [newton_schulz(piece, self.num_ns_steps, self.fp32_matmul_prec) * self.scale(*piece.shape)
                for piece in self.split_pieces(u, qkv_split)]
        return self.join_pieces(outs, u, qkv_split)

    def scale(self, rows: int, cols: int) -> float:
        """The scale of an orthogonalised piece of (rows, cols), the extra scale factor included."""
        return scale_factor(rows, cols, self.scale_mode) * self.extra_scale_factor

    def split_pieces(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]]) -> list[torch.Tensor]:
        """The independently orthogonalised pieces of ``u``: itself, or with a QKV split its Q, K and V
        rows across all query groups (each a 2-D (groups * rows, cols) matrix, groups in order)."""
        split = tuple(qkv_split) if (self.split_qkv and qkv_split is not None) else None
        if split is None:
            return [u]
        rows_per_group, cols = sum(split), u.shape[1]
        grouped = u.reshape(u.shape[0] // rows_per_group, rows_per_group, cols)
        starts = [sum(split[:i]) for i in range(len(split))]
        return [grouped[:, s:s + rows].reshape(-1, cols) for s, rows in zip(starts, split)]

    def join_pieces(self, outs: Sequence[torch.Tensor], u: torch.Tensor,
                    qkv_split: Optional[Sequence[int]]) -> torch.Tensor:
        """The inverse of ``split_pieces``: the pieces' results back in ``u``'s layout."""
        split = tuple(qkv_split) if (self.split_qkv and qkv_split is not None) else None
        if split is None:
            return outs[0]
        groups, cols = u.shape[0] // sum(split), u.shape[1]
        return torch.cat([o.reshape(groups, rows, cols) for o, rows in zip(outs, split)], dim=1).reshape(u.shape)

    def pieces(self, shape: Sequence[int], qkv_split: Optional[Sequence[int]]) -> int:
        """Independent Newton-Schulz problems in one matrix (3 with a QKV split)."""
        return len(qkv_split) if (self.split_qkv and qkv_split is not None) else 1

    # ----------------------------------------------------------------- the whole-tensor family's interface
    @property
    def tensor_parallel_mode(self) -> str:
        return self.tp_mode

    def qkv_split_of(self, name: str, param: torch.Tensor) -> Optional[tuple[int, ...]]:
        return qkv_split_of(name, param, self.split_qkv)

    def steady_cost(self, shape: tuple[float, float], pieces: int) -> float:
        """Newton-Schulz's multiply-adds (whole_tensor/homes.py's cost of a placement)."""
        rows, cols = shape
        s, lo = min(rows / pieces, cols), max(rows / pieces, cols)
        return pieces * (float(self.num_ns_steps) * s * s * (2 * lo + s))

    def direction(self, grad: torch.Tensor, grad_scale: torch.Tensor, state: TensorDict) -> torch.Tensor:
        return self.momentum_direction(grad, grad_scale, state["momentum_buffer"])

    def matrix_update(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]]) -> torch.Tensor:
        return self.orthogonalize(u, qkv_split)

    def finish(self, master: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: Scalar, weight_decay: Scalar,
               matrix: MatrixFacts) -> None:
        self.apply_direction(master, update, lr, weight_decay)

    def recompute_direction(self, g: torch.Tensor, state: TensorDict) -> tuple[TensorDict, TensorDict, torch.Tensor]:
        b, db, u = recompute_momentum(self, g, state["momentum_buffer"])
        return {"momentum_buffer": b}, {"momentum_buffer": db}, u

    def matrix_tolerance(self, matrix: MatrixFacts, device: torch.device) -> float:
        return ns_relative_error(self.fp32_matmul_prec, device) * o_norm_bound(self, matrix.shape, matrix.qkv_split,
                                                                               matrix.tensor_split_multiple)

    def recompute_finish(self, w0: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: float,
                         weight_decay: float, update_tolerance: float, matrix: MatrixFacts
                         ) -> tuple[TensorDict, TensorDict]:
        w, dw = recompute_master(w0, update, lr, weight_decay, update_tolerance)
        return {"master": w}, {"master": dw}


def qkv_split_of(name: str, param: torch.Tensor, split_qkv: bool) -> Optional[tuple[int, ...]]:
    """The QKV split of a Muon param: its ``qkv_split_shapes`` attribute (rows of Q, K and V in one query
    group), checked against its rows. megatron-core tags ``linear_qkv.weight`` by name: such a param
    without the attribute is refused while ``muon_split_qkv`` is on (the split is not in the tensor)."""
    split = getattr(param, QKV_SPLIT_ATTR, None)
    if not split_qkv:
        return None
    if split is None:
        if "linear_qkv.weight" in name:
            raise InvalidConfigError(
                f"muon_split_qkv=True and {name} is a QKV weight, but its split is unknown: set "
                f"param.{QKV_SPLIT_ATTR} = (q_rows, k_rows, v_rows) of one query group (e.g. "
                f"(heads // groups * kv_channels, kv_channels, kv_channels)), or muon_split_qkv=False.")
        return None
    split = tuple(int(r) for r in split)
    if len(split) != 3 or min(split) <= 0 or param.shape[0] % sum(split) != 0:
        raise InvalidConfigError(f"{name}.{QKV_SPLIT_ATTR}={split}: need three positive row counts whose sum divides "
                                 f"the param's {param.shape[0]} rows.")
    return split


# ------------------------------------------------------------------------------ float64 recomputation (verify mode)
# Part 1 is elementwise:  B = beta*B0 + (1-beta)*g,  U = (1-beta)*g + beta*B (Nesterov) or B; its bound
# is the rounding bound of its terms, as for every elementwise rule. Part 2 is not elementwise: the home
# recomputes O in float64 on the whole matrix from the float64 U, and the bound is RELATIVE TO THE MATRIX:
#     ||O_fp32 - O_f64||_F <= NS_RELATIVE_ERROR[prec] * ||O_f64||_F,   ||O_f64||_F <= o_norm_bound(...)
# so every element of the update may differ by lr * NS_RELATIVE_ERROR * o_norm_bound (|e_ij| <= ||E||_F).
# NS_RELATIVE_ERROR: fp32 ('highest', and 'high' on the CPU) 1e-4 (megatron-core's fp32 Muon vs float64:
# 7.8e-6..3e-5, docs/muon.md); TF32 ('high' on CUDA) 5e-2; bf16 ('medium') 0.5 (bf16's 2^-8 amplified on
# the small singular values: 0.2 measured on random matrices), which checks little more than the scale.
NS_RELATIVE_ERROR = {"highest": 1e-4, "high": 1e-4, "high-cuda": 5e-2, "medium": 0.5}
NS_SINGULAR_VALUE_MAX = 1.5  # the quintic iteration leaves the singular values in about [0.7, 1.2]


def ns_relative_error(precision: str, device: torch.device) -> float:
    return NS_RELATIVE_ERROR["high-cuda" if (precision == "high" and device.type == "cuda") else precision]


def recompute_momentum(rule: Muon, g: torch.Tensor, b0: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Part 1 in float64: (B, its bound, U)."""
    beta = rule.momentum
    b = beta * b0 + (1.0 - beta) * g
    db = rounding_bound(beta * b0, (1.0 - beta) * g)
    u = (1.0 - beta) * g + beta * b if rule.nesterov else b
    return b, db, u


def o_norm_bound(rule: Muon, shape: Sequence[int], qkv_split: Optional[Sequence[int]],
                 scale_multiple: Sequence[int] = (1, 1)) -> float:
    """An upper bound on ||O||_F of one matrix of ``shape``: per piece, scale^2 * min(m, n) * sigma_max^2.
    ``scale_multiple``: how many times each dimension the orthogonalised matrix is (a TP-local block of
    a matrix orthogonalised whole: its scale is the full matrix's, its norm at most the block's)."""
    split = tuple(qkv_split) if (rule.split_qkv and qkv_split is not None) else None
    rows, cols = shape
    pieces = [(rows // sum(split) * r, cols) for r in split] if split else [(rows, cols)]
    fr, fc = scale_multiple
    total = sum(scale_factor(m * fr, n * fc, rule.scale_mode) ** 2 * min(m, n) for m, n in pieces)
    return NS_SINGULAR_VALUE_MAX * abs(rule.extra_scale_factor) * total ** 0.5


def recompute_master(w0: torch.Tensor, o: torch.Tensor, lr: float, weight_decay: float, o_tolerance: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Part 3 in float64: W = W0*(1 - lr*wd) - lr*O, with the rounding bound of its terms plus lr times
    the (matrix-relative) bound on O."""
    decayed = w0 * (1.0 - lr * weight_decay)
    return decayed - lr * o, rounding_bound(decayed, lr * o) + lr * o_tolerance


__all__ = ["Muon", "uses_muon", "recompute_momentum", "recompute_master", "o_norm_bound", "ns_relative_error",
           "newton_schulz", "newton_schulz_step", "scale_factor", "qkv_split_of", "float32_matmul_precision",
           "QUINTIC", "NS_EPS",
           "SCALE_MODES", "MATMUL_PRECISIONS", "TP_MODES", "QKV_SPLIT_ATTR"]
