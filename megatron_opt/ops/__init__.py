"""The step's fused operations, behind one front: one call per pass over every shard of a ``StepPlan``.

* ``grad_stats(plan, inv_scale, stats)``: pass 1, the gradient statistics;
* ``update(plan, record, lr_wd=...)``: pass 2, the update of an update rule, whose op record ``record``
  (an ``UpdateArgs`` subclass, e.g. ``optimizer.rules.adamw.AdamWStep``) holds the rule, its math and
  what its kernel takes (``ops/op_args.py``); ``lr_wd`` is an ``LrWdTable`` (the device table and its
  host values);
* ``advance_step(step, found_inf)``: the update counter.

A one-shard plan is the single-shard case. Three backends share the semantics of the reference (the
spec): ``"cuda-ext"`` (the compiled ``megatron_opt._C``, wrapped by ``ops.cuda``: one launch per
pass), ``"cpu"`` (torch's fused CPU kernels, checked against the reference in tests) and
``"reference"``; the torch backends walk the plan shard by shard. Every front takes ``backend``:
``"auto"`` picks by the tensor's device (CUDA tensors go to the extension when it was built, else to
the reference; CPU tensors go to ``cpu``). The environment is only an override, for debugging:
MEGATRON_OPT_OPS=reference|cpu forces that backend; MEGATRON_OPT_DISABLE_CUDA_EXT=1 skips loading
the extension.
"""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Literal, Optional

import torch

from . import cpu, reference
from .op_args import KernelCall, LrWd, LrWdTable, ShardOperands, StatsArgs, UpdateArgs
from .piece_table import PieceTable, full_table
from .step_plan import DeviceHyperparams, StepPlan, host_lr_wd, lr_wd_table
from .reference import NUM_STATS, STAT_NONFINITE, STAT_SUMSQ, STAT_ZEROS
from .precision import MASTER_DTYPES, STATE_DTYPES

Backend = Literal["auto", "cuda-ext", "cpu", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "cuda-ext", "cpu", "reference")


def _load_cuda_impl() -> tuple[Optional[ModuleType], Optional[str]]:
    """(ops.cuda, None) when the compiled extension imports, else (None, why not, in plain words)."""
    if os.environ.get("MEGATRON_OPT_DISABLE_CUDA_EXT") == "1":
        return None, "disabled by MEGATRON_OPT_DISABLE_CUDA_EXT=1"
    if importlib.util.find_spec("megatron_opt._C") is None:  # checked first: importing it would fail obscurely
        if torch.version.cuda is None:
            return None, "this torch has no CUDA (a CPU build), so csrc/ was not compiled"
        return None, ("csrc/ was not compiled when the package was installed (no nvcc then, or "
                      "MEGATRON_OPT_SKIP_CUDA_BUILD=1); reinstall with `pip install -e . --no-build-isolation`")
    try:
        from . import cuda
    except ImportError as exc:
        return None, f"the compiled extension does not import: {exc}"
    return cuda, None


_cuda_impl, CUDA_EXT_ERROR = _load_cuda_impl()

HAS_CUDA_EXT = _cuda_impl is not None


def resolve_backend(t: torch.Tensor, backend: str = "auto") -> str:
    """The backend an op on ``t`` runs on: MEGATRON_OPT_OPS if set, else ``backend`` ('auto' by device)."""
    override = os.environ.get("MEGATRON_OPT_OPS")
    chosen = override or backend
    if chosen not in BACKENDS:
        source = "MEGATRON_OPT_OPS" if override else "backend"
        raise ValueError(f"{source}={chosen!r} is not an ops backend; use one of {BACKENDS}.")
    if chosen == "auto":
        if t.is_cuda:
            return "cuda-ext" if HAS_CUDA_EXT else "reference"
        return "cpu" if t.device.type == "cpu" else "reference"
    if chosen == "cuda-ext" and not HAS_CUDA_EXT:
        raise RuntimeError(f"ops backend 'cuda-ext' was asked for but the extension is not built ({CUDA_EXT_ERROR}).")
    return chosen


def backend_for(t: torch.Tensor) -> str:
    """'cuda-ext', 'cpu' or 'reference': where an op on ``t`` runs with backend='auto'."""
    return resolve_backend(t, "auto")


# ---------------------------------------------------------------------------------------- the front
def grad_stats(plan: StepPlan, inv_scale: torch.Tensor, stats: torch.Tensor, count_zeros: bool = True, *,
               backend: Backend = "auto") -> None:
    """Pass 1 over every shard of ``plan``: stats += [non-finite count, sum of (grad*inv_scale)^2 over
    the in-norm pieces, zero count of the in-norm pieces]."""
    if not plan.shards:
        return
    args = StatsArgs(inv_scale, stats, count_zeros)
    name = resolve_backend(plan.shards[0].grad, backend)
    if name == "cuda-ext":
        _cuda_impl.grad_stats(plan, args)
        return
    impl = cpu if name == "cpu" else reference
    for s in plan.shards:
        impl.grad_stats(s, args)


def update(plan: StepPlan, args: UpdateArgs, *, lr_wd: "LrWdTable | torch.Tensor", backend: Backend = "auto") -> None:
    """Pass 2 of ``args``'s rule over every shard of ``plan`` (whose shard state is the rule's state
    tensors, in order); ``lr_wd``: this step's (lr, weight decay) per param group, an ``LrWdTable`` (a bare
    [groups, 2] float64 device table is read back to the host once). One launch of the rule's kernel on the
    CUDA extension; on a torch backend the record's op per shard, with the table's host values (those
    ``DeviceHyperparams`` staged, so no device read). The record is read, never called back into the front."""
    if not plan.shards:
        return
    name = resolve_backend(plan.shards[0].grad, backend)
    table = LrWdTable.of(lr_wd)
    if name == "cuda-ext":
        _cuda_impl.update(plan, table, args)
        return
    plan.check_groups(table.table, args.op)
    step_op = args.cpu if name == "cpu" else args.reference
    for s in plan.shards:
        step_op(s, table.host)


def advance_step(step: torch.Tensor, found_inf: Optional[torch.Tensor] = None, *, backend: Backend = "auto") -> None:
    """step += 1 on the device, unless ``found_inf`` is given and nonzero."""
    impl = {"cuda-ext": _cuda_impl, "cpu": cpu, "reference": reference}[resolve_backend(step, backend)]
    impl.advance_step(step, found_inf)


__all__ = [
    "Backend",
    "BACKENDS",
    "PieceTable",
    "full_table",
    "resolve_backend",
    "backend_for",
    "grad_stats",
    "update",
    "advance_step",
    "StepPlan",
    "ShardOperands",
    "LrWd",
    "LrWdTable",
    "KernelCall",
    "StatsArgs",
    "UpdateArgs",
    "DeviceHyperparams",
    "lr_wd_table",
    "host_lr_wd",
    "HAS_CUDA_EXT",
    "MASTER_DTYPES",
    "STATE_DTYPES",
    "CUDA_EXT_ERROR",
    "NUM_STATS",
    "STAT_NONFINITE",
    "STAT_SUMSQ",
    "STAT_ZEROS",
]
