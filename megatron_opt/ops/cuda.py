"""CUDA implementations of the step's fused operations (wrapping the compiled ``megatron_opt._C``).

Same signatures and semantics as :mod:`megatron_opt.ops.reference`. Importing this module raises
ImportError when the extension was not built (``megatron_opt.ops`` then falls back to the reference).

The kernels run over a :class:`~megatron_opt.ops.step_plan.StepPlan` (every shard one launch covers,
one launch per pass); the ``*_planned`` functions take a plan built once, the single-shard functions
build a one-shard plan per call (after the argument checks of ``ops/operand_checks.py``).

Nothing here synchronises with the host: every per-step scalar (inv_scale, grad_scale, step,
found_inf) and the per-param-group (lr, weight decay) table stay on the device. Unlike the reference, the
pass-2 ops read ``found_inf`` on the device: when it is nonzero the kernel writes nothing.

Shapes: every flat tensor (grad, master, moments, param_out) is 1-D, contiguous, on the same CUDA
device, with at least ``table.numel`` elements; the table's coordinates index them directly.

Precision-aware state (``ops/precision.py``) is AdamW's: the master float32, float16 or the int16
remainder of a bfloat16 ``param_out``; the moments float32 / bfloat16 / float16, bf16 moments
optionally rounded stochastically. The kernel handles the moment pairs (exp_avg, exp_avg_sq) in
``precision.KERNEL_MOMENT_PAIRS`` in its one pass; for any other pair ``adamw_step_planned`` runs
``ops.reference.adamw_step`` shard by shard on the same CUDA tensors (same results; it reads the
lr table, ``found_inf`` and ``step`` on the host, so it syncs and cannot be captured in a CUDA graph).
SGD and Lion take float32 master and state only (TypeError otherwise).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch  # must precede the extension import (it loads libc10 / libtorch)

from .. import _C  # noqa: E402  (raises ImportError when the extension was not built)
from . import reference
from .operand_checks import (FP32_ONLY, check_flat, check_fp32_state, check_scalar, check_stats, check_update_operands,
                             fp32_rule_hint, param_group_lists)
from .piece_table import PieceTable
from .precision import FLOAT_DTYPES, KERNEL_MOMENT_PAIRS, dtype_names
from .step_plan import DTYPE_CODES, MASTER_CODES, ShardOperands, StepPlan, lr_wd_table

# The kernels still take a clip coefficient beside grad_scale; the optimizer folds the clip into
# grad_scale (one multiplier, one fp32 rounding), so it is always 1 here.
_KERNEL_CLIP = 1.0


def _cuda_device(op: str, grad: torch.Tensor) -> torch.device:
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{op}: grad must be a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_cuda:
        raise ValueError(f"{op}: the CUDA implementation needs CUDA tensors, grad is on {grad.device}")
    return grad.device


_PLAN_CACHE_SIZE = 8


def _cached(table: PieceTable, key: tuple, build):
    """A small per-table cache, so that the single-shard ops can be warmed up and then captured in a
    CUDA graph (the capture reuses the plan and the lr table built outside it)."""
    return table.memo("cuda_single_shard", key, build, max_entries=_PLAN_CACHE_SIZE)


def _plan(table: PieceTable, grad, master=None, state=(), param_out=None, update=True) -> StepPlan:
    arrays = (grad, master, *state, param_out)
    key = ("plan", update, tuple(None if t is None else (t.data_ptr(), t.dtype, t.numel()) for t in arrays))
    return _cached(table, key, lambda: StepPlan((ShardOperands(table, grad, master, tuple(state), param_out),),
                                                update=update))


def _lr_wd(op: str, table: PieceTable, lr: Sequence[float], weight_decay: Sequence[float],
           device: torch.device) -> torch.Tensor:
    lr_l, wd_l = param_group_lists(op, table, lr, weight_decay)
    return _cached(table, ("lr_wd", str(device), tuple(lr_l), tuple(wd_l)), lambda: lr_wd_table(lr_l, wd_l, device))


def _param_code(plan: StepPlan) -> int:
    return -1 if plan.param_dtype is None else DTYPE_CODES[plan.param_dtype]


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
    check_flat(f"{op}: grad", grad, device, table.numel, FLOAT_DTYPES)
    check_scalar(f"{op}: inv_scale", inv_scale, device, torch.float32)
    check_stats(op, stats, device)
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
    check_scalar(f"{op}: step", step, step.device, torch.int64)
    if found_inf is not None:
        check_scalar(f"{op}: found_inf", found_inf, step.device, torch.float32)
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
    device = _cuda_device(op, grad)
    check_update_operands(op, device, table, grad, master, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, param_out,
                          {"grad_scale": grad_scale, "found_inf": found_inf}, precision_aware=True)
    check_scalar(f"{op}: step", step, device, torch.int64)
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (exp_avg, exp_avg_sq), param_out)
        adamw_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step, beta1=beta1, beta2=beta2, eps=eps,
                           found_inf=found_inf, stochastic_rounding=stochastic_rounding)


def adamw_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                       beta1: float, beta2: float, eps: float, found_inf: Optional[torch.Tensor] = None,
                       stochastic_rounding: bool = False) -> None:
    """AdamW over every shard of ``plan`` in one launch, precision-aware state included (module doc).
    Moment pairs outside ``KERNEL_MOMENT_PAIRS`` run the reference shard by shard instead."""
    if not plan.num_chunks:
        return
    plan.check_groups(lr_wd, "adamw_step")
    if len(plan.state_dtypes) != 2:
        raise ValueError(f"adamw_step: a plan for AdamW holds two states per shard (exp_avg, exp_avg_sq), "
                         f"this one has {len(plan.state_dtypes)}")
    if plan.state_dtypes not in KERNEL_MOMENT_PAIRS:
        _adamw_reference_fallback(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step, beta1=beta1, beta2=beta2,
                                  eps=eps, found_inf=found_inf, stochastic_rounding=stochastic_rounding)
        return
    d = plan.device_tensors()
    s0, s1 = plan.state_codes()
    _C.adamw_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan),
                  MASTER_CODES[plan.master_dtype], s0, s1, lr_wd, grad_scale, _KERNEL_CLIP, step, float(beta1),
                  float(beta2), float(eps), found_inf, bool(stochastic_rounding))


def _adamw_reference_fallback(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                              beta1: float, beta2: float, eps: float, found_inf: Optional[torch.Tensor],
                              stochastic_rounding: bool) -> None:
    """Moment pairs without a kernel instantiation (e.g. fp32 exp_avg with bf16 exp_avg_sq): the
    reference per shard on the CUDA tensors, same semantics (widen, fp32 update, round once). It reads
    lr_wd, found_inf and step on the host, so it cannot run inside a CUDA graph capture."""
    if plan.device is not None and plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"adamw_step: no kernel for moment dtypes {list(plan.state_dtypes)} (the kernels take "
                           f"{dtype_names(KERNEL_MOMENT_PAIRS)}); the reference fallback syncs with the host and "
                           "cannot be captured in a CUDA graph")
    pairs = lr_wd.tolist()
    lr, wd = [p[0] for p in pairs], [p[1] for p in pairs]
    for s in plan.shards:
        reference.adamw_step(s.grad, s.master, s.state[0], s.state[1], s.param_out, s.table, lr=lr, weight_decay=wd,
                             grad_scale=grad_scale, step=step, beta1=beta1, beta2=beta2, eps=eps, found_inf=found_inf,
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
    device = _cuda_device(op, grad)
    state = {"momentum_buffer": momentum_buffer} if momentum != 0 else {}
    check_update_operands(op, device, table, grad, master, state, param_out,
                          {"grad_scale": grad_scale, "found_inf": found_inf})
    if momentum == 0 and momentum_buffer is not None:  # unused, but still checked
        check_flat(f"{op}: momentum_buffer", momentum_buffer, device, table.numel, FP32_ONLY, fp32_rule_hint(op))
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (momentum_buffer,) if momentum != 0 else (), param_out)
        sgd_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, momentum=momentum, nesterov=nesterov,
                         found_inf=found_inf)


def sgd_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, momentum: float,
                     nesterov: bool = False, found_inf: Optional[torch.Tensor] = None) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, "sgd_step")
        check_fp32_state("sgd_step", plan.master_dtype, plan.state_dtypes)
        if (momentum != 0) != (len(plan.shards[0].state) == 1):
            raise ValueError("sgd_step: a plan for momentum != 0 holds one momentum buffer per shard, else none")
        d = plan.device_tensors()
        _C.sgd_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd, grad_scale,
                    _KERNEL_CLIP, float(momentum), bool(nesterov), found_inf)


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
    device = _cuda_device(op, grad)
    check_update_operands(op, device, table, grad, master, {"exp_avg": exp_avg}, param_out,
                          {"grad_scale": grad_scale, "found_inf": found_inf})
    lr_wd = _lr_wd(op, table, lr, weight_decay, device)
    if table.num_pieces:
        plan = _plan(table, grad, master, (exp_avg,), param_out)
        lion_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, beta1=beta1, beta2=beta2, found_inf=found_inf)


def lion_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, beta1: float, beta2: float,
                      found_inf: Optional[torch.Tensor] = None) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, "lion_step")
        check_fp32_state("lion_step", plan.master_dtype, plan.state_dtypes)
        d = plan.device_tensors()
        _C.lion_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd, grad_scale,
                     _KERNEL_CLIP, float(beta1), float(beta2), found_inf)


__all__ = ["grad_stats", "grad_stats_planned", "adamw_step_planned", "sgd_step_planned", "lion_step_planned", "advance_step", "adamw_step", "sgd_step", "lion_step"]
