"""CUDA implementations of the step's fused operations (wrapping the compiled ``megatron_opt._C``).

Same semantics as :mod:`megatron_opt.ops.reference`, and the backend form every backend has
(``ops/op_args.py``): ``op(shard, args)`` / ``op(shard, lr_wd, args)``. Importing this module raises
ImportError when the extension was not built (``megatron_opt.ops`` then falls back to the reference).
``kernels`` is the compiled module every launch goes through.

The kernels run over a :class:`~megatron_opt.ops.step_plan.StepPlan` (every shard one launch covers,
one launch per pass); the ``*_planned`` functions take a plan built once (``op_planned(plan, args)``,
``op_planned(plan, lr_wd, args)`` with the ``[groups, 2]`` device table), the single-shard functions
build a one-shard plan per call (after the argument checks of ``ops/operand_checks.py``, which
``cuda_device`` starts: the device the op runs on).

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

from dataclasses import replace
from typing import Callable, Optional

import torch  # must precede the extension import (it loads libc10 / libtorch)

from .. import _C as kernels  # noqa: E402  (raises ImportError when the extension was not built)
from . import reference
from .op_args import AdamWArgs, LionArgs, LrWd, SGDArgs, ShardOperands, StatsArgs, UpdateArgs
from .operand_checks import (FP32_ONLY, check_flat, check_fp32_state, check_scalar, check_stats, check_update_operands,
                             fp32_rule_hint, param_group_lists)
from .piece_table import PieceTable
from .precision import FLOAT_DTYPES, KERNEL_MOMENT_PAIRS, dtype_names
from .step_plan import DTYPE_CODES, MASTER_CODES, StepPlan, lr_wd_table

# The kernels still take a clip coefficient beside grad_scale; the optimizer folds the clip into
# grad_scale (one multiplier, one fp32 rounding), so it is always 1 here.
_KERNEL_CLIP = 1.0


def cuda_device(op: str, grad: torch.Tensor) -> torch.device:
    """The CUDA device ``op`` runs on: the grad's (TypeError / ValueError for anything but a CUDA
    tensor). The first check of every single-shard op; the wrapper tests replace it to send CPU
    tensors on to the compiled module's own checks."""
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


def _plan(shard: ShardOperands, update: bool = True) -> StepPlan:
    arrays = (shard.grad, shard.master, *shard.state, shard.param_out)
    key = ("plan", update, tuple(None if t is None else (t.data_ptr(), t.dtype, t.numel()) for t in arrays))
    return _cached(shard.table, key, lambda: StepPlan((shard,), update=update))


def _lr_wd_table(op: str, table: PieceTable, lr_wd: LrWd, device: torch.device) -> torch.Tensor:
    lr_l, wd_l = param_group_lists(op, table, lr_wd.lr, lr_wd.weight_decay)
    return _cached(table, ("lr_wd", str(device), tuple(lr_l), tuple(wd_l)), lambda: lr_wd_table(lr_l, wd_l, device))


def _param_code(plan: StepPlan) -> int:
    return -1 if plan.param_dtype is None else DTYPE_CODES[plan.param_dtype]


# ------------------------------------------------------------------------------------------------
# Pass 1
# ------------------------------------------------------------------------------------------------
def grad_stats(shard: ShardOperands, args: StatsArgs) -> None:
    op, grad, table = "grad_stats", shard.grad, shard.table
    device = cuda_device(op, grad)
    check_flat(f"{op}: grad", grad, device, table.numel, FLOAT_DTYPES)
    check_scalar(f"{op}: inv_scale", args.inv_scale, device, torch.float32)
    check_stats(op, args.stats, device)
    if table.num_pieces:
        grad_stats_planned(_plan(ShardOperands(table, grad), update=False), args)


def grad_stats_planned(plan: StepPlan, args: StatsArgs) -> None:
    """Pass 1 over every shard of ``plan``: one launch plus a one-block reduction."""
    if not plan.num_chunks:
        return
    d = plan.device_tensors()
    kernels.grad_stats(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], args.inv_scale, args.stats,
                       d["sumsq_ws"], d["counts_ws"], bool(args.count_zeros))


def advance_step(step: torch.Tensor, found_inf: Optional[torch.Tensor] = None) -> None:
    op = "advance_step"
    if not isinstance(step, torch.Tensor) or not step.is_cuda:
        raise ValueError(f"{op}: step must be a CUDA tensor")
    check_scalar(f"{op}: step", step, step.device, torch.int64)
    if found_inf is not None:
        check_scalar(f"{op}: found_inf", found_inf, step.device, torch.float32)
    kernels.advance_step(step, found_inf)


# ------------------------------------------------------------------------------------------------
# Pass 2: the single-shard ops check their operands by name, then run the planned op on a one-shard plan
# ------------------------------------------------------------------------------------------------
def _checked_device(shard: ShardOperands, args: UpdateArgs, state: dict[str, torch.Tensor],
                    precision_aware: bool = False) -> torch.device:
    device = cuda_device(args.op, shard.grad)
    check_update_operands(args.op, device, shard.table, shard.grad, shard.master, state, shard.param_out,
                          {"grad_scale": args.grad_scale, "found_inf": args.found_inf}, precision_aware=precision_aware)
    return device


def _run_one_shard(shard: ShardOperands, lr_wd: LrWd, args: UpdateArgs, device: torch.device,
                   planned: Callable[[StepPlan, torch.Tensor, UpdateArgs], None]) -> None:
    lr_wd_device = _lr_wd_table(args.op, shard.table, lr_wd, device)
    if shard.table.num_pieces:
        planned(_plan(shard), lr_wd_device, args)


def adamw_step(shard: ShardOperands, lr_wd: LrWd, args: AdamWArgs) -> None:
    device = _checked_device(shard, args, {"exp_avg": shard.state[0], "exp_avg_sq": shard.state[1]},
                             precision_aware=True)
    check_scalar(f"{args.op}: step", args.step, device, torch.int64)
    _run_one_shard(shard, lr_wd, args, device, adamw_step_planned)


def adamw_step_planned(plan: StepPlan, lr_wd: torch.Tensor, args: AdamWArgs) -> None:
    """AdamW over every shard of ``plan`` in one launch, precision-aware state included (module doc).
    Moment pairs outside ``KERNEL_MOMENT_PAIRS`` run the reference shard by shard instead."""
    if not plan.num_chunks:
        return
    plan.check_groups(lr_wd, args.op)
    if len(plan.state_dtypes) != 2:
        raise ValueError(f"adamw_step: a plan for AdamW holds two states per shard (exp_avg, exp_avg_sq), "
                         f"this one has {len(plan.state_dtypes)}")
    if plan.state_dtypes not in KERNEL_MOMENT_PAIRS:
        _adamw_reference_fallback(plan, lr_wd, args)
        return
    d = plan.device_tensors()
    s0, s1 = plan.state_codes()
    kernels.adamw_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan),
                       MASTER_CODES[plan.master_dtype], s0, s1, lr_wd, args.grad_scale, _KERNEL_CLIP, args.step,
                       float(args.beta1), float(args.beta2), float(args.eps), args.found_inf,
                       bool(args.stochastic_rounding))


def _adamw_reference_fallback(plan: StepPlan, lr_wd: torch.Tensor, args: AdamWArgs) -> None:
    """Moment pairs without a kernel instantiation (e.g. fp32 exp_avg with bf16 exp_avg_sq): the
    reference per shard on the CUDA tensors, same semantics (widen, fp32 update, round once). It reads
    lr_wd, found_inf and step on the host, so it cannot run inside a CUDA graph capture."""
    if plan.device is not None and plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"adamw_step: no kernel for moment dtypes {list(plan.state_dtypes)} (the kernels take "
                           f"{dtype_names(KERNEL_MOMENT_PAIRS)}); the reference fallback syncs with the host and "
                           "cannot be captured in a CUDA graph")
    host_lr_wd = LrWd.from_table(lr_wd)
    for s in plan.shards:
        reference.adamw_step(s, host_lr_wd, args)


def sgd_step(shard: ShardOperands, lr_wd: LrWd, args: SGDArgs) -> None:
    momentum_buffer = shard.state[0] if shard.state else None
    if args.momentum != 0 and momentum_buffer is None:
        raise ValueError("sgd_step: momentum != 0 needs a momentum buffer")
    with_momentum = args.momentum != 0
    device = _checked_device(shard, args, {"momentum_buffer": momentum_buffer} if with_momentum else {})
    if not with_momentum and momentum_buffer is not None:  # unused, but still checked
        check_flat(f"{args.op}: momentum_buffer", momentum_buffer, device, shard.table.numel, FP32_ONLY,
                   fp32_rule_hint(args.op))
    _run_one_shard(shard if with_momentum else replace(shard, state=()), lr_wd, args, device, sgd_step_planned)


def sgd_step_planned(plan: StepPlan, lr_wd: torch.Tensor, args: SGDArgs) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, args.op)
        check_fp32_state(args.op, plan.master_dtype, plan.state_dtypes)
        if (args.momentum != 0) != (len(plan.shards[0].state) == 1):
            raise ValueError("sgd_step: a plan for momentum != 0 holds one momentum buffer per shard, else none")
        d = plan.device_tensors()
        kernels.sgd_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd,
                         args.grad_scale, _KERNEL_CLIP, float(args.momentum), bool(args.nesterov), args.found_inf)


def lion_step(shard: ShardOperands, lr_wd: LrWd, args: LionArgs) -> None:
    device = _checked_device(shard, args, {"exp_avg": shard.state[0]})
    _run_one_shard(shard, lr_wd, args, device, lion_step_planned)


def lion_step_planned(plan: StepPlan, lr_wd: torch.Tensor, args: LionArgs) -> None:
    if plan.num_chunks:
        plan.check_groups(lr_wd, args.op)
        check_fp32_state(args.op, plan.master_dtype, plan.state_dtypes)
        d = plan.device_tensors()
        kernels.lion_step(d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan), lr_wd,
                          args.grad_scale, _KERNEL_CLIP, float(args.beta1), float(args.beta2), args.found_inf)


__all__ = ["kernels", "cuda_device", "grad_stats", "grad_stats_planned", "adamw_step_planned", "sgd_step_planned",
           "lion_step_planned", "advance_step", "adamw_step", "sgd_step", "lion_step"]
