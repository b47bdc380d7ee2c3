"""The CUDA backend (wrapping the compiled ``megatron_opt._C``): pass 1, the step counter, and the
one generic pass-2 launch of a rule's registered kernel, from its op record's ``KernelCall``.

Same semantics as the torch backends. Importing this module raises ImportError when the extension was
not built (``megatron_opt.ops`` then falls back to the reference). ``kernels`` is the compiled module
every launch goes through. Every pass is one launch over a :class:`~megatron_opt.ops.step_plan.StepPlan`
(every shard it covers); each call first checks its operands (``ops/operand_checks.py``), starting
with ``cuda_device``: the device the op runs on.

Nothing here synchronises with the host: every per-step scalar (inv_scale, grad_scale, step,
found_inf) and the per-param-group (lr, weight decay) table stay on the device. Unlike the torch
backends, pass 2 reads ``found_inf`` on the device: when it is nonzero the kernel writes nothing.

Shapes: every flat tensor (grad, master, state, param_out) is 1-D, contiguous, on the same CUDA
device, with at least ``table.numel`` elements; the table's coordinates index them directly.

Pass 2's kernels are registered by name in csrc (``MEGATRON_OPT_REGISTER_*`` in ``csrc/rules/<rule>.cu``)
and launched through the one binding ``kernels.pass2(op, ...)``, with the record's ``KernelCall``: the
rule's constants as a list of doubles in the order its kernel's ``Args`` reads them. A record without a
kernel for the plan runs its reference here, shard by shard, on the CUDA tensors.
"""
from __future__ import annotations

from typing import Optional

import torch  # must precede the extension import (it loads libc10 / libtorch)

from .. import _C as kernels  # noqa: E402  (raises ImportError when the extension was not built)
from .op_args import KernelCall, LrWdTable, StatsArgs, UpdateArgs
from .operand_checks import FLOAT_DTYPES, check_flat, check_scalar, check_stats
from .step_plan import DTYPE_CODES, MASTER_CODES, StepPlan


def cuda_device(op: str, grad: torch.Tensor) -> torch.device:
    """The CUDA device ``op`` runs on: the grad's (TypeError / ValueError for anything but a CUDA
    tensor). The first check of every op; the wrapper tests replace it to send CPU tensors on to the
    compiled module's own checks."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{op}: grad must be a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_cuda:
        raise ValueError(f"{op}: the CUDA implementation needs CUDA tensors, grad is on {grad.device}")
    return grad.device


def _param_code(plan: StepPlan) -> int:
    return -1 if plan.param_dtype is None else DTYPE_CODES[plan.param_dtype]


# ------------------------------------------------------------------------------------------------
# Pass 1 and the step counter
# ------------------------------------------------------------------------------------------------
def grad_stats(plan: StepPlan, args: StatsArgs) -> None:
    """Pass 1 over every shard of ``plan``: one launch plus a one-block reduction."""
    op = "grad_stats"
    device = cuda_device(op, plan.shards[0].grad)

    def grads() -> None:
        for s in plan.shards:
            check_flat(f"{op}: grad", s.grad, device, s.table.numel, FLOAT_DTYPES)

    plan.check_once(op, grads)  # the plan's tensors never change: checked once
    check_scalar(f"{op}: inv_scale", args.inv_scale, device, torch.float32)
    check_stats(op, args.stats, device)
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
# Pass 2
# ------------------------------------------------------------------------------------------------
def update(plan: StepPlan, lr_wd: LrWdTable, args: UpdateArgs) -> None:
    """Pass 2 of ``args``'s rule over every shard of ``plan``: the common checks, the rule's own
    (``args.check``), then one launch of its kernel, or, without a kernel for this plan, its reference per
    shard on the CUDA tensors (it reads ``found_inf`` on the host, so it syncs and cannot be captured in a
    CUDA graph)."""
    cuda_device(args.op, plan.shards[0].grad)
    plan.check_groups(lr_wd.table, args.op)
    args.check(plan)
    if not plan.num_chunks:
        return
    call = args.kernel_call(plan)
    if call is not None:
        launch_update(plan, lr_wd.table, args.op, args.grad_scale, args.found_inf, call)
        return
    if plan.device is not None and plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{args.op}: no kernel for state dtypes {list(plan.state_dtypes)}; the reference "
                           "fallback syncs with the host and cannot be captured in a CUDA graph")
    for s in plan.shards:
        args.reference(s, lr_wd.host)


def launch_update(plan: StepPlan, lr_wd: torch.Tensor, op: str, grad_scale: torch.Tensor,
                  found_inf: Optional[torch.Tensor], call: KernelCall) -> None:
    """One launch of the kernel registered as ``op`` over every chunk of ``plan``, with ``call``'s constants
    (in the order its kernel reads them), update counter and rounding."""
    d = plan.device_tensors()
    s0, s1 = plan.state_codes()
    kernels.pass2(op, d["ptrs"], d["chunks"], DTYPE_CODES[plan.grad_dtype], _param_code(plan),
                  MASTER_CODES[plan.master_dtype], s0, s1, lr_wd, grad_scale, found_inf, call.step,
                  bool(call.stochastic), [float(c) for c in call.constants])


__all__ = ["kernels", "cuda_device", "grad_stats", "advance_step", "update", "launch_update"]
