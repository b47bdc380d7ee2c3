"""Muon + AdamW in float64 on whole-model tensors, written from the formulas (a test reference).

The semantics are megatron-core's Muon (``OptimizerConfig(optimizer="muon")``: emerging-optimizers'
orthogonalized optimizer as megatron-core configures it), stated here as formulas:

* Which params: a 2-D param not marked ``is_embedding_or_output_parameter`` gets Muon (a 2-D position
  embedding included); every other param gets AdamW with the ``adam_*`` settings.
* Muon, per param, with lr and wd of its group (the scheduler's, i.e. ``max_lr`` / ``wd_mult`` applied):
      W <- W * (1 - lr*wd)                                   decoupled weight decay
      B <- beta*B + (1-beta)*g                               ``momentum_buffer`` (EMA form)
      U  = (1-beta)*g + beta*B  if nesterov  else  B
      W <- W - lr * extra_scale * scale(rows, cols) * NS(U)
  per orthogonalised piece; decay and update both apply to the pre-step W (the order cannot matter).
* NS: X = U / max(||U||_F, 1e-7) on the wide orientation (transposed when rows > cols), then
  ``num_ns_steps`` times X <- a*X + (b*A + c*A@A) @ X with A = X @ X^T, cycling the five quintic
  (a, b, c) triples.
* scale(rows, cols): spectral sqrt(max(rows, cols)); unit_rms_norm sqrt(rows/cols); shape_scaling
  sqrt(max(1, rows/cols)); taken on the piece that is orthogonalised.
* Pieces: with QKV splitting, ``linear_qkv.weight`` (rows = query groups x [q, k, v] rows of a group)
  is viewed as [groups, q+k+v, cols]; the Q rows of all groups form one matrix, likewise K and V; each
  is orthogonalised alone and scaled by its own shape, and the result goes back in place.
* Tensor parallelism on whole tensors: the whole tensor is the concatenation of its TP shards along
  the param's ``partition_dim``. ``blockwise``: every shard is a matrix of its own (split into Q/K/V
  inside the shard, scaled by the shard's piece shape). ``duplicated`` and ``distributed``: the whole
  tensor (both orthogonalise the full matrix; in exact arithmetic they agree, NS being
  transpose-equivariant), i.e. the TP-1 result.
* AdamW: torch's formula (decoupled decay W*(1-lr*wd), bias-corrected moments, eps outside the root).

Gradients come in unscaled (megatron-core's Muon refuses fp16, so there is no loss scale); clipping
by the global norm over every param is the caller's ``torch.nn.utils.clip_grad_norm_``, as megatron-core's
``ChainedOptimizer`` clips Muon's and Adam's grads with one coefficient.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

# Newton-Schulz quintic coefficients (a, b, c) (Keller Jordan's modded-nanogpt set), used in turn.
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
NS_EPS = 1e-7
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")


@dataclasses.dataclass(frozen=True)
class MuonMatrix:
    """How one Muon param is cut into orthogonalised pieces.

    qkv_split_shapes: rows of Q, K and V in one query group (None: the param is not split);
    tp_size: how many TP shards the whole tensor concatenates; partition_dim: along which dim
    (None: the param is not TP-split, every TP rank holds all of it)."""

    qkv_split_shapes: Optional[tuple[int, ...]] = None
    tp_size: int = 1
    partition_dim: Optional[int] = None


def qkv_split_shapes(num_attention_heads: int, num_query_groups: int, kv_channels: int) -> tuple[int, int, int]:
    """Rows of Q, K and V in one query group of ``linear_qkv.weight``."""
    return (num_attention_heads // num_query_groups * kv_channels, kv_channels, kv_channels)


def newton_schulz(x: torch.Tensor, steps: int, coefficients: Sequence[tuple[float, float, float]] = QUINTIC,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of the orthogonal polar factor of a 2-D ``x``."""
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / X.norm().clamp_min(eps)
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"unknown muon scale mode {mode!r}")


def _orthogonalize_block(u: torch.Tensor, split: Optional[tuple[int, ...]], steps: int,
                         scale_mode: str) -> torch.Tensor:
    """One TP block: whole, or its Q, K and V pieces apart (each across all the block's query groups)."""
    if split is None:
        return newton_schulz(u, steps) * scale_factor(*u.shape, scale_mode)
    rows_per_group, cols = sum(split), u.shape[1]
    assert u.shape[0] % rows_per_group == 0, f"QKV rows {u.shape[0]} not a multiple of {rows_per_group}"
    grouped = u.reshape(u.shape[0] // rows_per_group, rows_per_group, cols)
    out = torch.empty_like(grouped)
    start = 0
    for rows in split:
        piece = grouped[:, start:start + rows].reshape(-1, cols)
        orth = newton_schulz(piece, steps) * scale_factor(*piece.shape, scale_mode)
        out[:, start:start + rows] = orth.reshape(grouped.shape[0], rows, cols)
        start += rows
    return out.reshape(u.shape)


def orthogonalized_update(u: torch.Tensor, matrix: MuonMatrix, *, tp_mode: str, steps: int, scale_mode: str,
                          extra_scale: float = 1.0, split_qkv: bool = True) -> torch.Tensor:
    """The scaled orthogonalised update of a whole tensor ``u`` (momentum, Nesterov applied)."""
    if tp_mode not in TP_MODES:
        raise ValueError(f"unknown muon tp mode {tp_mode!r}")
    split = matrix.qkv_split_shapes if split_qkv else None
    if tp_mode == "blockwise" and matrix.tp_size > 1 and matrix.partition_dim is not None:
        blocks = u.chunk(matrix.tp_size, dim=matrix.partition_dim)
        assert all(b.shape == blocks[0].shape for b in blocks), "TP shards of unequal size"
        out = torch.cat([_orthogonalize_block(b, split, steps, scale_mode) for b in blocks], dim=matrix.partition_dim)
    else:
        out = _orthogonalize_block(u, split, steps, scale_mode)
    return out * extra_scale


class ReferenceMuon(torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (each param described by ``matrices[param]``), AdamW
    for the rest; lr and weight_decay per group, as megatron-core's scheduler sets them."""

    def __init__(self, params: Iterable, matrices: Mapping[torch.Tensor, MuonMatrix], lr: float,
                 weight_decay: float, *, momentum: float = 0.95, nesterov: bool = False, num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, split_qkv: bool = True,
                 tp_mode: str = "blockwise", adam_betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8) -> None:
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"unknown muon scale mode {scale_mode!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, muon=False))
        self.matrices = dict(matrices)
        self.muon = dict(momentum=momentum, nesterov=nesterov, steps=num_ns_steps, scale_mode=scale_mode,
                         extra_scale=extra_scale_factor, split_qkv=split_qkv, tp_mode=tp_mode)
        self.adam = dict(betas=adam_betas, eps=adam_eps)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> None:
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    update = self._muon_direction(p)
                else:
                    update = self._adam_direction(p)
                p.mul_(1 - lr * wd).sub_(lr * update)

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        """B = beta*B + (1-beta)*g in place; U: Nesterov's (1-beta)*g + beta*B, or B."""
        m, g = self.muon, p.grad
        beta = m["momentum"]
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.mul_(beta).add_((1 - beta) * g)
        return (1 - beta) * g + beta * buf if m["nesterov"] else buf

    def _muon_direction(self, p: torch.Tensor) -> torch.Tensor:
        m, u = self.muon, self._momentum(p)
        return orthogonalized_update(u, self.matrices[p], tp_mode=m["tp_mode"], steps=m["steps"],
                                     scale_mode=m["scale_mode"], extra_scale=m["extra_scale"],
                                     split_qkv=m["split_qkv"])

    def _adam_direction(self, p: torch.Tensor) -> torch.Tensor:
        (beta1, beta2), eps, g = self.adam["betas"], self.adam["eps"], p.grad
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        state["exp_avg"].mul_(beta1).add_((1 - beta1) * g)
        state["exp_avg_sq"].mul_(beta2).add_((1 - beta2) * g * g)
        t = state["step"]
        denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt() + eps
        return state["exp_avg"] / (1 - beta1 ** t) / denom


def uses_muon(param: torch.Tensor) -> bool:
    """megatron-core's split: 2-D and not marked as the embedding or output layer."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def muon_matrix(name: str, param: torch.Tensor, *, tp_size: int = 1, expert_tp_size: Optional[int] = None,
                split_shapes: Optional[Sequence[int]] = None) -> MuonMatrix:
    """The pieces of a Muon param from megatron-core's tags: ``linear_qkv.weight`` whose rows divide into
    query groups is QKV; a TP layer's ``partition_dim`` (-1: not split) says how its shards concatenate;
    expert weights ('experts' in the name, not 'shared') use the expert-TP size."""
    is_expert = "experts" in name and "shared" not in name
    size = (expert_tp_size or tp_size) if is_expert else tp_size
    partition_dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
    split = None
    if split_shapes is not None and "linear_qkv.weight" in name and param.shape[0] % sum(split_shapes) == 0:
        split = tuple(split_shapes)
    return MuonMatrix(qkv_split_shapes=split, tp_size=size,
                      partition_dim=None if partition_dim == -1 else partition_dim)


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 1 or name.endswith(".bias")


def reference_muon(model: torch.nn.Module, lr: float, weight_decay: float, *, tp_size: int = 1,
                   expert_tp_size: Optional[int] = None, split_shapes: Optional[Sequence[int]] = None,
                   group_overrides: Optional[Callable[[str, torch.Tensor], dict]] = None,
                   **options) -> ReferenceMuon:
    """ReferenceMuon over ``model`` with megatron-core's groups: Muon / AdamW, no decay on biases and 1-D
    params (``wd_mult`` 0), and ``group_overrides(name, param)``'s keys (``max_lr``, ``wd_mult``, as in
    megatron-core's config_overrides) on top. Each group starts at lr = max_lr and weight_decay =
    weight_decay * wd_mult; a megatron-core OptimizerParamScheduler may drive it from there.
    ``options``: ReferenceMuon's keyword options (momentum, nesterov, ..., tp_mode)."""
    groups: dict[tuple, dict] = {}
    matrices = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        extra = dict(wd_mult=0.0 if _no_weight_decay(name, p) else 1.0)
        extra.update(group_overrides(name, p) if group_overrides else {})
        muon = uses_muon(p)
        if muon:
            matrices[p] = muon_matrix(name, p, tp_size=tp_size, expert_tp_size=expert_tp_size,
                                      split_shapes=split_shapes)
        key = (muon, tuple(sorted(extra.items())))
        group = groups.setdefault(key, dict(params=[], muon=muon, **extra))
        group["params"].append(p)
    for group in groups.values():
        group["lr"] = group.get("max_lr", lr)
        group["weight_decay"] = weight_decay * group["wd_mult"]
    return ReferenceMuon(list(groups.values()), matrices, lr, weight_decay, **options)


__all__ = ["QUINTIC", "NS_EPS", "SCALE_MODES", "TP_MODES", "MuonMatrix", "qkv_split_shapes", "newton_schulz",
           "scale_factor", "orthogonalized_update", "ReferenceMuon", "uses_muon", "muon_matrix", "reference_muon"]
