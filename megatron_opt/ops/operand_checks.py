"""The ops' argument checks, in one place: a flat shard, a device scalar, the operands of one update,
the shards of one step plan, and outputs that must not overlap.

The CUDA kernels read raw pointers, so a wrong dtype, length or layout is a silent memory error
there; these checks turn it into a TypeError / ValueError naming the op and the operand. The step
plan checks its shards once when it is built; before its first CUDA launch on a plan, an update op
checks each shard with the operands' own names (``exp_avg``, ``momentum_buffer``) in the message.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .piece_table import PieceTable
from .precision import FLOAT_DTYPES, MASTER_DTYPES, STATE_DTYPES, dtype_names

FP32_ONLY = (torch.float32,)
_FP32_RULE_HINT = ("; precision-aware state (16-bit moments, float16 or int16-remainder masters) is "
                   "implemented for AdamW only, {rule} takes float32 master and state")


def fp32_rule_hint(rule: str) -> str:
    """Why an operand of ``rule`` (a rule without precision-aware state) must be float32 (appended to a
    dtype error)."""
    return _FP32_RULE_HINT.format(rule=rule)


def check_flat(where: str, t: torch.Tensor, device: torch.device, numel: int,
               dtypes: Optional[Sequence[torch.dtype]] = None, hint: str = "") -> None:
    """``t`` is a contiguous 1-D tensor on ``device`` with at least ``numel`` elements (a piece
    table's shard size), of one of ``dtypes`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, expected {device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{where} has dtype {t.dtype}, expected one of: {dtype_names(dtypes)}{hint}")
    if t.dim() != 1:
        raise ValueError(f"{where} must be a flat 1-D shard, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{where} must be contiguous")
    if t.numel() < numel:
        raise ValueError(f"{where} has {t.numel()} elements but the piece table covers {numel}")


def check_scalar(where: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """``t`` is a one-element ``dtype`` tensor on ``device`` (a per-step scalar the kernels read there)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a one-element {dtype} tensor on {device}, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, expected {device} (keep per-step scalars on the device)")
    if t.dtype != dtype:
        raise TypeError(f"{where} has dtype {t.dtype}, expected {dtype}")
    if t.numel() != 1:
        raise ValueError(f"{where} must have exactly one element, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{where} must be contiguous")


def check_stats(op: str, stats: torch.Tensor, device: torch.device) -> None:
    """Pass 1's accumulator: a contiguous float64 tensor of 3 elements on ``device``."""
    if not isinstance(stats, torch.Tensor) or stats.device != device or stats.dtype != torch.float64:
        raise TypeError(f"{op}: stats must be a float64 tensor of 3 elements on {device}")
    if stats.numel() != 3 or not stats.is_contiguous():
        raise ValueError(f"{op}: stats must be a contiguous float64 tensor with 3 elements, got shape "
                         f"{tuple(stats.shape)}")


def check_remainder_param(where: str, master_dtype: torch.dtype, param_dtype: Optional[torch.dtype]) -> None:
    """An int16 master is the low half of an fp32 master whose high half is the bf16 param."""
    if master_dtype == torch.int16 and param_dtype != torch.bfloat16:
        got = "no param_out" if param_dtype is None else f"param_out of dtype {param_dtype}"
        raise TypeError(f"{where}: an int16 master is the remainder of a bfloat16 param and needs that param as "
                        f"param_out (bfloat16), got {got}")


def check_no_overlap(where: str, named: dict[str, Optional[torch.Tensor]]) -> None:
    """Outputs must not overlap each other or the grad, except master aliasing param_out exactly
    (fp32 params: every element is then read and written by the same thread)."""
    items = [(n, t) for n, t in named.items() if t is not None and t.numel() > 0]
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            (na, a), (nb, b) = items[i], items[j]
            a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
            b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
            if a0 < b1 and b0 < a1:
                if {na, nb} == {"master", "param_out"} and (a0, a1, a.dtype) == (b0, b1, b.dtype):
                    continue
                raise ValueError(f"{where}: {na} and {nb} overlap in memory")


def check_update_operands(op: str, device: torch.device, table: PieceTable, grad: torch.Tensor,
                          master: torch.Tensor, state: dict[str, torch.Tensor], param_out: Optional[torch.Tensor],
                          scalars: dict[str, Optional[torch.Tensor]], precision_aware: bool = False,
                          rule: str = "this rule") -> None:
    """The checks every pass-2 op shares, on one shard: flat operands, the float32 device scalars
    (``scalars``, None entries skipped), no overlapping outputs. ``precision_aware`` (AdamW): 16-bit
    moments and float16 / int16-remainder masters are allowed, else (``rule``: SGD, Lion) master and
    state must be float32."""
    n = table.numel
    check_flat(f"{op}: grad", grad, device, n, FLOAT_DTYPES)
    hint = "" if precision_aware else fp32_rule_hint(rule)
    check_flat(f"{op}: master", master, device, n, MASTER_DTYPES if precision_aware else FP32_ONLY, hint)
    for name, t in state.items():
        check_flat(f"{op}: {name}", t, device, n, STATE_DTYPES if precision_aware else FP32_ONLY, hint)
    if param_out is not None:
        check_flat(f"{op}: param_out", param_out, device, n, FLOAT_DTYPES)
    check_remainder_param(op, master.dtype, None if param_out is None else param_out.dtype)
    for name, t in scalars.items():
        if t is not None:
            check_scalar(f"{op}: {name}", t, device, torch.float32)
    check_no_overlap(op, {"grad": grad, "master": master, **state, "param_out": param_out})


def check_plan_shards(shards: Sequence, needs_update: bool) -> None:
    """The shards of one step plan (``ShardOperands``): flat operands on one device, one grad dtype,
    one param_out dtype, and for an update one master storage and one list of state dtypes."""
    first = shards[0]
    device, gdt = first.grad.device, first.grad.dtype
    pdt = None if first.param_out is None else first.param_out.dtype
    for k, s in enumerate(shards):
        where = f"StepPlan shard {k}"
        named = {"grad": s.grad, "master": s.master, "param_out": s.param_out,
                 **{f"state{i}": t for i, t in enumerate(s.state)}}
        for name, t in named.items():
            if t is not None:
                check_flat(f"{where}: {name}", t, device, s.table.numel)
        if s.grad.dtype != gdt or s.grad.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{where}: grad dtype {s.grad.dtype}; a plan needs one grad dtype out of "
                            f"{dtype_names(FLOAT_DTYPES)} (shard 0 has {gdt}): build one plan per buffer")
        if (None if s.param_out is None else s.param_out.dtype) != pdt:
            raise TypeError(f"{where}: param_out dtype differs from shard 0's ({pdt}): one plan per buffer")
        if pdt is not None and pdt not in FLOAT_DTYPES:
            raise TypeError(f"{where}: param_out dtype {pdt} is not {dtype_names(FLOAT_DTYPES)}")
        if needs_update:
            if s.master is None or s.master.dtype not in MASTER_DTYPES:
                got = "none" if s.master is None else f"master has dtype {s.master.dtype}"
                raise TypeError(f"{where}: {got}; a master must be a float32, float16 or int16 (remainder) tensor")
            if s.master.dtype != first.master.dtype:
                raise TypeError(f"{where}: master dtype {s.master.dtype} differs from shard 0's "
                                f"{first.master.dtype}: one plan per master storage")
            check_remainder_param(where, s.master.dtype, pdt)
            if [t.dtype for t in s.state] != [t.dtype for t in first.state]:
                raise ValueError(f"{where}: state dtypes {[t.dtype for t in s.state]} differ from "
                                 f"shard 0's {[t.dtype for t in first.state]}")
        check_no_overlap(where, named)


__all__ = ["FP32_ONLY", "fp32_rule_hint", "check_flat", "check_scalar", "check_stats", "check_remainder_param",
           "check_no_overlap", "check_update_operands", "check_plan_shards"]
