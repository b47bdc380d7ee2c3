"""Dispatch for the step's fused operations.

CUDA tensors go to the compiled extension (megatron_opt._C, wrapped by ``ops.cuda``) when it was
built; everything else, and CUDA without the extension, goes to ``ops.reference``. Both sides have
the same signatures and semantics. CPU tensors go to ``ops.cpu`` (torch's fused CPU kernels, checked
against the reference in tests). MEGATRON_OPT_DISABLE_CUDA_EXT=1 turns the extension off;
MEGATRON_OPT_OPS=reference sends everything to the reference.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from . import cpu, reference
from .reference import NUM_STATS, STAT_NONFINITE, STAT_SUMSQ, STAT_ZEROS
from .piece_table import PieceTable, full_table

_cuda_impl: Optional[ModuleType] = None
CUDA_EXT_ERROR: Optional[str] = None
if os.environ.get("MEGATRON_OPT_DISABLE_CUDA_EXT") != "1":
    try:
        from . import cuda as _cuda_impl  # noqa: F811  (imports megatron_opt._C)
    except ImportError as exc:  # pure-Python install: no extension was built
        CUDA_EXT_ERROR = str(exc)
        _cuda_impl = None

HAS_CUDA_EXT = _cuda_impl is not None


_FORCE_REFERENCE = os.environ.get("MEGATRON_OPT_OPS") == "reference"


def _impl(t: torch.Tensor) -> ModuleType:
    if _FORCE_REFERENCE:
        return reference
    if t.is_cuda:
        return _cuda_impl if _cuda_impl is not None else reference  # type: ignore[return-value]
    return cpu if t.device.type == "cpu" else reference


def grad_stats(grad, table, inv_scale, stats, count_zeros=True) -> None:
    _impl(grad).grad_stats(grad, table, inv_scale, stats, count_zeros)


def copy_grads_to_main(grad, main_grad, table, inv_scale, found_inf) -> None:
    _impl(grad).copy_grads_to_main(grad, main_grad, table, inv_scale, found_inf)


def advance_step(step, found_inf=None) -> None:
    _impl(step).advance_step(step, found_inf)


def adamw_step(grad, master, exp_avg, exp_avg_sq, param_out, table, **kw) -> None:
    _impl(grad).adamw_step(grad, master, exp_avg, exp_avg_sq, param_out, table, **kw)


def sgd_step(grad, master, momentum_buffer, param_out, table, **kw) -> None:
    _impl(grad).sgd_step(grad, master, momentum_buffer, param_out, table, **kw)


def backend_for(t: torch.Tensor) -> str:
    """'cuda-ext', 'cpu' or 'reference': which implementation a tensor's ops run on."""
    impl = _impl(t)
    return "cuda-ext" if impl is _cuda_impl and impl is not None else "cpu" if impl is cpu else "reference"


__all__ = [
    "PieceTable",
    "full_table",
    "grad_stats",
    "copy_grads_to_main",
    "advance_step",
    "adamw_step",
    "sgd_step",
    "backend_for",
    "HAS_CUDA_EXT",
    "CUDA_EXT_ERROR",
    "NUM_STATS",
    "STAT_NONFINITE",
    "STAT_SUMSQ",
    "STAT_ZEROS",
]
