"""Precision-aware optimizer state: how a master weight is stored and how fp32 results are rounded
into 16-bit state (the spec; csrc/precision.cuh does the same per element).

Masters come in three storages, told apart by the master tensor's dtype:
  * float32: the master itself;
  * float16: an fp16 master (Megatron-LM's ``main_params_dtype=torch.float16``), widened to fp32 for
    the update and rounded to nearest even on store;
  * int16: Megatron-LM's ``store_param_remainders`` for bf16 params. The fp32 master's bit pattern
    u is split into the bf16 param (its high half, rounded: plus one when the low half, read as a
    signed int16, is negative) and that signed low half, the remainder. Joining undoes it exactly:
    high = param bits - (remainder < 0), u = high << 16 | (remainder & 0xffff). The param is the
    master rounded to nearest (ties away from zero instead of to even); 2 bytes replace 4.

16-bit moments are rounded to nearest even, or stochastically (bf16 only): 16 pseudo-random bits
are added to the low half of the fp32 bits before truncation, so the rounding is unbiased. The bits
come from a counter-based hash of (element index in the shard, update step, state slot), identical
on every backend and replayable.
"""
from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # grads, params and moments (the kernels' float codes)
MASTER_DTYPES = (torch.float32, torch.float16, torch.int16)
STATE_DTYPES = FLOAT_DTYPES
# The (exp_avg, exp_avg_sq) dtype pairs the CUDA AdamW kernel is compiled for (csrc/pass2.cuh:
# supported_state_pair and run_pass2_master; tests/unit/test_kernel_instantiations.py checks they
# match). Any other pair of STATE_DTYPES runs the torch reference on CUDA tensors instead.
KERNEL_MOMENT_PAIRS: tuple[tuple[torch.dtype, torch.dtype], ...] = (
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32))


def dtype_names(dtypes) -> str:
    """"float32, bfloat16" for a sequence of dtypes, or "(float32, float32), ..." for one of pairs."""
    def name(d) -> str:
        return f"({dtype_names(d)})" if isinstance(d, tuple) else str(d).replace("torch.", "")
    return ", ".join(name(d) for d in dtypes)

_M32 = 0xFFFFFFFF


def is_remainder(master: torch.Tensor) -> bool:
    return master.dtype == torch.int16


def join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master from a bf16 param and its int16 remainder (a new tensor).

    In 32-bit two's complement, (param bits << 16) + sign-extended remainder is exactly
    (param bits - (remainder < 0)) << 16 | (remainder & 0xffff).
    """
    bits = (param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def split_remainder(master: torch.Tensor, param_out: torch.Tensor, remainder_out: torch.Tensor) -> None:
    """Write the bf16 param and the int16 remainder of fp32 ``master`` (inverse of join_remainder):
    the remainder is the low half read as a signed int16, the param the high half of bits - remainder."""
    bits = master.contiguous().view(torch.int32)
    low = bits.to(torch.int16)  # the low 16 bits, as a signed value
    remainder_out.copy_(low)
    param_out.view(torch.int16).copy_(((bits - low.to(torch.int32)) >> 16).to(torch.int16))


def load_master(master: torch.Tensor, param: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 values of a master range: the tensor itself when fp32 (updates land in place), else a copy."""
    if master.dtype == torch.float32:
        return master
    if is_remainder(master):
        if param is None or param.dtype != torch.bfloat16:
            raise ValueError("a remainder master (int16) needs its bf16 param as param_out")
        return join_remainder(param, master)
    return master.float()


def store_master(values: torch.Tensor, master: torch.Tensor, param_out: Optional[torch.Tensor]) -> None:
    """Store fp32 ``values`` into the master (and the model param): in place for fp32 (nothing to
    do when ``values`` is the master), rounded for fp16, split for remainders."""
    if is_remainder(master):
        split_remainder(values, param_out, master)
        return
    if master.dtype != torch.float32:
        master.copy_(values)
        values = master  # the param is the stored master rounded (as a later sync from the master gives)
    if param_out is not None:
        param_out.copy_(values)


def hash16(index: torch.Tensor, step: int, slot: int) -> torch.Tensor:
    """16 pseudo-random bits per element (int64 in [0, 65536)) from (index, step, slot): lowbias32."""
    x = (index * 0x9E3779B1 + (step * 0x85EBCA77) + slot * 0xC2B2AE3D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    return x & 0xFFFF


def round_bf16_stochastic(values: torch.Tensor, index: torch.Tensor, step: int, slot: int) -> torch.Tensor:
    """bf16 of fp32 ``values``, rounded stochastically (unbiased) with hash16's bits."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _M32
    finite = torch.isfinite(values)
    noisy = ((bits + hash16(index, step, slot)) >> 16) & 0xFFFF
    truncated = torch.where(noisy >= 2**15, noisy - 2**16, noisy).to(torch.int16).view(torch.bfloat16)
    return torch.where(finite, truncated, values.to(torch.bfloat16))


def store_state(values: torch.Tensor, state: torch.Tensor, *, stochastic: bool = False,
                index: Optional[torch.Tensor] = None, step: int = 0, slot: int = 0) -> None:
    """Store fp32 ``values`` into a state range: nothing for fp32 (updated in place), nearest-even
    rounding for 16-bit, or stochastic rounding for bf16 when asked."""
    if state.dtype == torch.float32:
        if values.data_ptr() != state.data_ptr():
            state.copy_(values)
        return
    if stochastic and state.dtype == torch.bfloat16:
        state.copy_(round_bf16_stochastic(values, index, step, slot))
    else:
        state.copy_(values)


__all__ = ["FLOAT_DTYPES", "MASTER_DTYPES", "STATE_DTYPES", "KERNEL_MOMENT_PAIRS", "dtype_names", "is_remainder",
           "join_remainder", "split_remainder", "load_master", "store_master", "hash16", "round_bf16_stochastic",
           "store_state"]
