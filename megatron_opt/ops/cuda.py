"""CUDA implementations of the step's fused operations (wrapping the compiled ``megatron_opt._C``).

Same signatures and semantics as :mod:`megatron_opt.ops.reference`. Importing this module raises
ImportError when the extension was not built (``megatron_opt.ops`` then falls back to the reference).

The kernels run over a :class:`~megatron_opt.ops.step_plan.StepPlan` (all shards of a launch group,
one launch per pass); the ``*_planned`` functions take a plan built once, the single-shard functions
build a one-shard plan per call (argument checks with friendly messages happen here).

Nothing here synchronises with the host: every per-step scalar (inv_scale, grad_scale, step,
found_inf) and the per-group (lr, weight decay) table stay on the device. Unlike the reference, the
pass-2 ops read ``found_inf`` on the device: when it is nonzero the kernel writes nothing.

Shapes: every flat tensor (grad, master, moments, param_out) is 1-D, contiguous, on the same CUDA
device, with at least ``table.numel`` elements; the table's coordinates index them directly.

Precision-aware state (``ops/precision.py``) is AdamW's: the master float32, float16 or the int16
remainder of a bfloat16 ``param_out``; the moments float32 / bfloat16 / float16, bf16 moments
optionally rounded stochastically. The kernel handles the moment pairs (exp_avg, exp_avg_sq) in
``KERNEL_STATE_PAIRS`` in its one pass; for any other pair ``adamw_step_planned`` runs
``ops.reference.adamw_step`` shard by shard on the same CUDA tensors (same results; it reads the
lr table, ``found_inf`` and ``step`` on the host, so it syncs and cannot be captured in a CUDA graph).
SGD and Lion take float32 master and state only (TypeError otherwise).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch  # must precede the extension import (it loads libc10 / libtorch)

from .. import _C  # noqa: E402  (raises ImportError when the extension was not built)
from . import reference
from .piece_table import PieceTable
from .precision import MASTER_DTYPES, STATE_DTYPES
from .step_plan import DTYPE_CODES, MASTER_CODES, ShardOperands, StepPlan, check_no_overlap, lr_wd_table

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_ONLY = (torch.float32,)
# (exp_avg, exp_avg_sq) dtype pairs the AdamW kernel is instantiated for (csrc/pass2.cuh
# supported_state_pair); other pairs run the reference (see adamw_step_planned).
KERNEL_STATE_PAIRS = frozenset({(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                (torch.float16, torch.float16), (torch.bfloat16, torch.float32)})
_KERNEL_PAIRS_TEXT = "(float32, float32), (bfloat16, bfloat16), (float16, float16), (bfloat16, float32)"
_RULE_NAMES = {"sgd_step": "SGD", "lion_step": "Lion"}
_FP32_RULE_HINT = ("; precision-aware state (16-bit moments, float16 or int16-remainder masters) is "
                   "implemented for AdamW only, {rule} takes float32 master and state")


def _where(op: str, name: str) -> str:
    return f"{op}: {name}"


def _check_flat(op: str, name: str, t: torch.Tensor, device: torch.device, dtypes, table: PieceTable,
                hint: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_where(op, name)} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{_where(op, name)} is on {t.device}, expected {device}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{_where(op, name)} has dtype {t.dtype}, expected one of: {names}{hint}")
    if t.dim() != 1:
        raise ValueError(f"{_where(op, name)} must be a flat 1-D shard, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{_where(op, name)} must be contiguous")
    if t.numel() < table.numel:
        raise ValueError(f"{_where(op, name)} has {t.numel()} elements but the piece table covers {table.numel}")


def _check_scalar(op: str, name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_where(op, name)} must be a one-element {dtype} tensor on {device}, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{_where(op, name)} is on {t.device}, expected {device} (keep per-step scalars on the device)")
    if t.dtype != dtype:
        raise TypeError(f"{_where(op, name)} has dtype {t.dtype}, expected {dtype}")
    if t.numel() != 1:
        raise ValueError(f"{_where(op, name)} must have exactly one element, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{_where(op, name)} must be contiguous")


def _cuda_device(op: str, grad: torch.Tensor) -> torch.device:
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{op}: grad must be a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_cuda:
        raise ValueError(f"{op}: the CUDA implementation needs CUDA tensors, grad is on {grad.device}")
    return grad.device


def _check_update(op: str, table: PieceTable, grad: torch.Tensor, master: torch.Tensor,
                  state: dict[str, torch.Tensor], param_out: Optional[torch.Tensor], grad_scale: torch.Tensor,
                  found_inf: Optional[torch.Tensor], precision_aware: bool = False) -> torch.device:
    """The checks every pass-2 op shares: flat operands, the device scalars, no overlapping outputs.
    ``precision_aware`` (AdamW): 16-bit moments and float16 / int16-remainder masters are allowed,
    else (SGD, Lion) master and state must be float32."""
    device = _cuda_device(op, grad)
    _check_flat(op, "grad", grad, device, _GRAD_DTYPES, table)
    hint = "" if precision_aware else _FP32_RULE_HINT.format(rule=_RULE_NAMES.get(op, op))
    _check_flat(op, "master", master, device, MASTER_DTYPES if precision_aware else _FP32_ONLY, table, hint)
    for name, t in state.items():
        _check_flat(op, name, t, device, STATE_DTYPES if precision_aware else _FP32_ONLY, table, hint)
    if param_out is not None:
        _check_flat(op, "param_out", param_out, device, _PARAM_DTYPES, table)
    if master.dtype == torch.int16 and (param_out is None or param_out.dtype != torch.bfloat16):
        got = "no param_out" if param_out is None else f"param_out of dtype {param_out.dtype}"
        raise TypeError(f"{op}: an int16 master is the remainder of a bfloat16 param and needs that param as "
                        f"param_out (bfloat16), got {got}")
    _check_scalar(op, "grad_scale", grad_scale, device, torch.float32)
    if found_inf is not None:
        _check_scalar(op, "found_inf", found_inf, device, torch.float32)
    check_no_overlap(op, {"grad": grad, "master": master, **state, "param_out": param_out})
    return device


def _group_lists(op: str, table: PieceTable, lr: Sequence[float], weight_decay: Sequence[float]):
    lr_l = [float(x) for x in lr]
    wd_l = [float(x) for x in weight_decay]
    if len(lr_l) != len(wd_l):
        raise ValueError(f"{op}: lr has {len(lr_l)} entries but weight_decay has {len(wd_l)}")
    if table.group:
        lo, hi = min(table.group), max(table.group)
        if lo < 0 or hi >= len(lr_l):
            raise ValueError(f"{op}: piece group ids span [{lo}, {hi}] but lr/weight_decay have {len(lr_l)} entries")
    return lr_l, wd_l


_PLAN_CACHE_SIZE = 8


def _cached(table: PieceTable, key: tuple, build):
    """A small per-table cache, so that the single-shard ops can be warmed up and then captured in a
    CUDA graph (the capture reuses the plan and the lr table built outside it)."""
    cache = table._device_cache.setdefault("cuda_single_shard", {})
    if key not in cache:
        if len(cache) >= _PLAN_CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = build()
    return cache[key]


def _plan(table: PieceTable, grad, master=None, state=(), param_out=None, update=True) -> StepPlan:
    arrays = (grad, master, *state, param_out)
    key = ("plan", update, tuple(None if t is None else (t.data_ptr(), t.dtype, t.numel()) for t in arrays))
    return _cached(table, key, lambda: StepPlan((ShardOperands(table, grad, master, tuple(state), param_out),),
                                                update=update))


def _lr_wd(op: str, table: PieceTable, lr: Sequence[float], weight_decay: Sequence[float],
           device: torch.device) -> torch.Tensor:
    lr_l, wd_l = _group_lists(op, table, lr, weight_decay)
    return _cached(table, ("lr_wd", str(device), tuple(lr_l), tuple(wd_l)), lambda: lr_wd_table(lr_l, wd_l, device))


def _param_code(plan: StepPlan) -> int:
    return -1 if plan.param_dtype is None else DTYPE_CODES[plan.param_dtype]


def _check_fp32_plan(plan: StepPlan, op: str) -> None:
    """SGD and Lion kernels: float32 master and state only."""
    rule = _RULE_NAMES.get(op, op)
    if plan.master_dtype not in (None, torch.float32) or any(d != torch.float32 for d in plan.state_dtypes):
        raise TypeError(f"{op}: the plan has master dtype {plan.master_dtype} and state dtypes "
                        f"{list(plan.state_dtypes)}; precision-aware state (16-bit moments, float16 or "
                        f"int16-remainder masters) is implemented for AdamW only, {rule} takes float32 master and state")


# ------------------------------------------------------------------------------------------------
# Pass 1
# ------------------------------------------------------------------------------------------------
def grad_stats(
    grad: torch.Tensor,
    table: PieceTable,
    inv_scale: torch.Tensor,
    stats: torch.Tensor,
    count_zeros: bool = True,
) -> None:
    op = "grad_stats"
    device = _cuda_device(op, grad)
    _check_flat(op, "grad", grad, device, _GRAD_DTYPES, table)
    _check_scalar(op, "inv_scale", inv_scale, device, torch.float32)
    if not isinstance(stats, torch.Tensor) or stats.device != device or stats.dtype != torch.float64:
        raise TypeError(f"{op}: stats must be a float64 tensor of 3 elements on {device}")
    if stats.numel() != 3 or not stats.is_contiguous():
        raise ValueError(f"{op}: stats must be a contiguous float64 tensor with 3 elements, got shape {tuple(stats.shape)}")
    if table.num_pieces:
        grad_stats_planned(_plan(table, grad, update=False), inv_scale, stats, count_zeros)


def grad_stats_planned(plan: StepPlan, inv_scale: torch.Tensor, stats: torch.Tensor, count_zeros: bool = True) -> None:
    """Pass 1 over every shard of ``plan``: one launch plus a one-block reduction."""
    if not plan.num_chunks:
        return
    d = plan.device_tensors()
    _C.grad_stats(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], inv_scale, stats, d["sumsq_ws"],
                  d["counts_ws"], bool(count_zeros))


def advance_step(step: torch.Tensor, found_inf: Optional[torch.Tensor] = None) -> None:
    op = "advance_step"
    if not isinstance(step, torch.Tensor) or not step.is_cuda:
        raise ValueError(f"{op}: step must be a CUDA tensor")
    _check_scalar(op, "step", step, step.device, torch.int64)
    if found_inf is not None:
        _check_scalar(op, "found_inf", found_inf, step.device, torch.float32)
    _C.advance_step(step, found_inf)


# ------------------------------------------------------------------------------------------------
# Pass 2
# ------------------------------------------------------------------------------------------------
def adamw_step(
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: Optional[torch.Tensor],
    table: PieceTable,
    *,
    lr: Sequence[float],
    weight_decay: Sequence[float],
    grad_scale: torch.Tensor,
    step: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    found_inf: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
) -> None:
    op = "adamw_step"
    device = _check_update(op, table, grad, master, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, param_out,
                           grad_scale, found_inf, precision_aware=True)
    _check_scalar(op, "step", step, device, torch.int64)
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (exp_avg, exp_avg_sq), param_out)
        adamw_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step, beta1=beta1, beta2=beta2, eps=eps,
                           found_inf=found_inf, stochastic_rounding=stochastic_rounding)


def adamw_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                       beta1: float, beta2: float, eps: float, clip_coef: float = 1.0,
                       found_inf: Optional[torch.Tensor] = None, stochastic_rounding: bool = False) -> None:
    """AdamW over every shard of ``plan`` in one launch, precision-aware state included (module doc).
    Moment pairs outside ``KERNEL_STATE_PAIRS`` run the reference shard by shard instead."""
    if not plan.num_chunks:
        return
    plan.check_groups(lr_wd, "adamw_step")
    if len(plan.state_dtypes) != 2:
        raise ValueError(f"adamw_step: a plan for AdamW holds two states per shard (exp_avg, exp_avg_sq), "
                         f"this one has {len(plan.state_dtypes)}")
    if plan.state_dtypes not in KERNEL_STATE_PAIRS:
        _adamw_reference_fallback(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step, beta1=beta1, beta2=beta2,
                                  eps=eps, clip_coef=clip_coef, found_inf=found_inf,
                                  stochastic_rounding=stochastic_rounding)
        return
    d = plan.device_tensors()
    s0, s1 = plan.state_codes()
    _C.adamw_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan),
                  MASTER_CODES[plan.master_dtype], s0, s1, lr_wd, grad_scale, float(clip_coef), step, float(beta1),
                  float(beta2), float(eps), found_inf, bool(stochastic_rounding))


def _adamw_reference_fallback(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                              beta1: float, beta2: float, eps: float, clip_coef: float,
                              found_inf: Optional[torch.Tensor], stochastic_rounding: bool) -> None:
    """Moment pairs without a kernel instantiation (e.g. fp32 exp_avg with bf16 exp_avg_sq): the
    reference per shard on the CUDA tensors, same semantics (widen, fp32 update, round once). It reads
    lr_wd, found_inf and step on the host, so it cannot run inside a CUDA graph capture."""
    if plan.device is not None and plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"adamw_step: no kernel for moment dtypes {list(plan.state_dtypes)} (the kernels take "
                           f"{_KERNEL_PAIRS_TEXT}); the reference fallback syncs with the host and cannot be "
                           "captured in a CUDA graph")
    pairs = lr_wd.tolist()
    lr, wd = [p[0] for p in pairs], [p[1] for p in pairs]
    scale = grad_scale if clip_coef == 1.0 else grad_scale * clip_coef
    for s in plan.shards:
        reference.adamw_step(s.grad, s.master, s.state[0], s.state[1], s.param_out, s.table, lr=lr, weight_decay=wd,
                             grad_scale=scale, step=step, beta1=beta1, beta2=beta2, eps=eps, found_inf=found_inf,
                             stochastic_rounding=stochastic_rounding)


def sgd_step(
    grad: torch.Tensor,
    master: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    param_out: Optional[torch.Tensor],
    table: PieceTable,
    *,
    lr: Sequence[float],
    weight_decay: Sequence[float],
    grad_scale: torch.Tensor,
    momentum: float,
    nesterov: bool = False,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    op = "sgd_step"
    if momentum != 0 and momentum_buffer is None:
        raise ValueError("sgd_step: momentum != 0 needs a momentum buffer")
    device = _check_update(op, table, grad, master,
                           {"momentum_buffer": momentum_buffer} if momentum != 0 else {}, param_out,
                           grad_scale, found_inf)
    if momentum == 0 and momentum_buffer is not None:  # unused, but still checked
        _check_flat(op, "momentum_buffer", momentum_buffer, device, _FP32_ONLY, table,
                    _FP32_RULE_HINT.format(rule="SGD"))
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (momentum_buffer,) if momentum != 0 else (), param_out)
        sgd_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, momentum=momentum, nesterov=nesterov,
                         found_inf=found_inf)


def sgd_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, momentum: float,
                     nesterov: bool = False, clip_coef: float = 1.0, found_inf: Optional[torch.Tensor] = None) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, "sgd_step")
        _check_fp32_plan(plan, "sgd_step")
        if (momentum != 0) != (len(plan.shards[0].state) == 1):
            raise ValueError("sgd_step: a plan for momentum != 0 holds one momentum buffer per shard, else none")
        d = plan.device_tensors()
        _C.sgd_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd, grad_scale,
                    float(clip_coef), float(momentum), bool(nesterov), found_inf)


def lion_step(
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    param_out: Optional[torch.Tensor],
    table: PieceTable,
    *,
    lr: Sequence[float],
    weight_decay: Sequence[float],
    grad_scale: torch.Tensor,
    beta1: float,
    beta2: float,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    op = "lion_step"
    device = _check_update(op, table, grad, master, {"exp_avg": exp_avg}, param_out, grad_scale, found_inf)
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (exp_avg,), param_out)
        lion_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, beta1=beta1, beta2=beta2, found_inf=found_inf)


def lion_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, beta1: float, beta2: float,
                      clip_coef: float = 1.0, found_inf: Optional[torch.Tensor] = None) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, "lion_step")
        _check_fp32_plan(plan, "lion_step")
        d = plan.device_tensors()
        _C.lion_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd, grad_scale,
                     float(clip_coef), float(beta1), float(beta2), found_inf)


__all__ = ["KERNEL_STATE_PAIRS", "grad_stats", "grad_stats_planned", "adamw_step_planned", "sgd_step_planned", "lion_step_planned", "advance_step", "adamw_step", "sgd_step", "lion_step"]
