"""The step's fused operations, behind one typed front per op.

The fronts below own each op's signature. They pack the arguments into the records of
``ops/op_args.py`` (``ShardOperands``, ``LrWd``, ``StatsArgs``, ``AdamWArgs``, ``SGDArgs``,
``LionArgs``) and call the backend's function of the same name, ``op(shard, args)`` for pass 1 and
``op(shard, lr_wd, args)`` for pass 2. Three backends share the semantics of ``ops.reference`` (the
spec): ``"cuda-ext"`` (the compiled ``megatron_opt._C``, wrapped by ``ops.cuda``), ``"cpu"`` (torch's
fused CPU kernels, checked against the reference in tests) and ``"reference"``. Every front takes
``backend``: ``"auto"`` picks by the tensor's device (CUDA tensors go to the extension when it was
built, else to the reference; CPU tensors go to ``cpu``). The environment is only an override, for
debugging: MEGATRON_OPT_OPS=reference|cpu forces that backend; MEGATRON_OPT_DISABLE_CUDA_EXT=1
skips loading the extension.
"""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Literal, Optional, Sequence

import torch

from . import cpu, reference
from .op_args import AdamWArgs, LionArgs, LrWd, SGDArgs, ShardOperands, StatsArgs, UpdateArgs
from .piece_table import PieceTable, full_table
from .step_plan import DeviceHyperparams, StepPlan, lr_wd_table
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


def _impl(t: torch.Tensor, backend: str) -> ModuleType:
    name = resolve_backend(t, backend)
    return {"cuda-ext": _cuda_impl, "cpu": cpu, "reference": reference}[name]  # type: ignore[return-value]


def backend_for(t: torch.Tensor) -> str:
    """'cuda-ext', 'cpu' or 'reference': where an op on ``t`` runs with backend='auto'."""
    return resolve_backend(t, "auto")


# ---------------------------------------------------------------------------------------- pass 1
def grad_stats(grad: torch.Tensor, table: PieceTable, inv_scale: torch.Tensor, stats: torch.Tensor,
               count_zeros: bool = True, *, backend: Backend = "auto") -> None:
    """stats += [non-finite count, sum of (grad*inv_scale)^2 over in-norm pieces, zero count]."""
    _impl(grad, backend).grad_stats(ShardOperands(table, grad), StatsArgs(inv_scale, stats, count_zeros))


def advance_step(step: torch.Tensor, found_inf: Optional[torch.Tensor] = None, *, backend: Backend = "auto") -> None:
    """step += 1 on the device, unless ``found_inf`` is given and nonzero."""
    _impl(step, backend).advance_step(step, found_inf)


# ---------------------------------------------------------------------------------------- pass 2
# ``grad_scale`` of the update ops is the one gradient multiplier: the caller has folded every factor
# into it (unscale, 1/loss scale, the clip coefficient) as one fp32 device scalar.
def _update(shard: ShardOperands, lr: Sequence[float], weight_decay: Sequence[float], args: UpdateArgs,
            backend: str) -> None:
    getattr(_impl(shard.grad, backend), args.op)(shard, LrWd(lr, weight_decay), args)


def adamw_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               param_out: Optional[torch.Tensor], table: PieceTable, *, lr: Sequence[float],
               weight_decay: Sequence[float], grad_scale: torch.Tensor, step: torch.Tensor, beta1: float,
               beta2: float, eps: float, found_inf: Optional[torch.Tensor] = None,
               stochastic_rounding: bool = False, backend: Backend = "auto") -> None:
    """AdamW on one shard; moments and master may be 16-bit (see ops/precision.py)."""
    _update(ShardOperands(table, grad, master, (exp_avg, exp_avg_sq), param_out), lr, weight_decay,
            AdamWArgs(grad_scale=grad_scale, found_inf=found_inf, step=step, beta1=beta1, beta2=beta2, eps=eps,
                      stochastic_rounding=stochastic_rounding), backend)


def sgd_step(grad: torch.Tensor, master: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             param_out: Optional[torch.Tensor], table: PieceTable, *, lr: Sequence[float],
             weight_decay: Sequence[float], grad_scale: torch.Tensor, momentum: float, nesterov: bool = False,
             found_inf: Optional[torch.Tensor] = None, backend: Backend = "auto") -> None:
    """SGD on one shard; ``momentum_buffer`` may be None when momentum is 0."""
    state = () if momentum_buffer is None else (momentum_buffer,)
    _update(ShardOperands(table, grad, master, state, param_out), lr, weight_decay,
            SGDArgs(grad_scale=grad_scale, found_inf=found_inf, momentum=momentum, nesterov=nesterov), backend)


def lion_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, param_out: Optional[torch.Tensor],
              table: PieceTable, *, lr: Sequence[float], weight_decay: Sequence[float], grad_scale: torch.Tensor,
              beta1: float, beta2: float, found_inf: Optional[torch.Tensor] = None,
              backend: Backend = "auto") -> None:
    """Lion on one shard."""
    _update(ShardOperands(table, grad, master, (exp_avg,), param_out), lr, weight_decay,
            LionArgs(grad_scale=grad_scale, found_inf=found_inf, beta1=beta1, beta2=beta2), backend)


# ---------------------------------------------------------------------------------------- planned
# One call per pass over every shard of a StepPlan: one launch on the CUDA extension; the torch
# backends walk the plan's shards (ShardOperands) through their single-shard ops (same results).
def _plan_impl(plan: StepPlan, backend: str) -> Optional[ModuleType]:
    return _impl(plan.shards[0].grad, backend) if plan.shards else None


def grad_stats_planned(plan: StepPlan, inv_scale: torch.Tensor, stats: torch.Tensor, count_zeros: bool = True, *,
                       backend: Backend = "auto") -> None:
    """stats += pass 1 over every shard of ``plan`` (see ``grad_stats``)."""
    impl = _plan_impl(plan, backend)
    if impl is None:
        return
    args = StatsArgs(inv_scale, stats, count_zeros)
    if impl is _cuda_impl:
        impl.grad_stats_planned(plan, args)
        return
    for s in plan.shards:
        impl.grad_stats(s, args)


def _update_planned(plan: StepPlan, lr_wd: torch.Tensor, args: UpdateArgs, backend: str) -> None:
    """Pass 2 (``args.op``) over every shard of ``plan``: one ``<op>_planned`` launch on the CUDA
    extension; on a torch backend the single-shard op per shard, with the lr table read on the host."""
    impl = _plan_impl(plan, backend)
    if impl is None:
        return
    if impl is _cuda_impl:
        getattr(impl, f"{args.op}_planned")(plan, lr_wd, args)
        return
    plan.check_groups(lr_wd, args.op)
    host_lr_wd = LrWd.from_table(lr_wd)
    step_op = getattr(impl, args.op)
    for s in plan.shards:
        step_op(s, host_lr_wd, args)


def adamw_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                       beta1: float, beta2: float, eps: float, found_inf: Optional[torch.Tensor] = None,
                       stochastic_rounding: bool = False, backend: Backend = "auto") -> None:
    """AdamW over every shard of ``plan``; shard state is (exp_avg, exp_avg_sq); lr_wd is [groups, 2].
    Moments and masters may be 16-bit (see ops/precision.py)."""
    _update_planned(plan, lr_wd, AdamWArgs(grad_scale=grad_scale, found_inf=found_inf, step=step, beta1=beta1,
                                           beta2=beta2, eps=eps, stochastic_rounding=stochastic_rounding), backend)


def sgd_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, momentum: float,
                     nesterov: bool = False, found_inf: Optional[torch.Tensor] = None,
                     backend: Backend = "auto") -> None:
    """SGD over every shard of ``plan``; shard state is (momentum_buffer,) when momentum != 0, else ()."""
    _update_planned(plan, lr_wd, SGDArgs(grad_scale=grad_scale, found_inf=found_inf, momentum=momentum,
                                         nesterov=nesterov), backend)


def lion_step_planned(plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, beta1: float, beta2: float,
                      found_inf: Optional[torch.Tensor] = None, backend: Backend = "auto") -> None:
    """Lion over every shard of ``plan``; shard state is (exp_avg,)."""
    _update_planned(plan, lr_wd, LionArgs(grad_scale=grad_scale, found_inf=found_inf, beta1=beta1, beta2=beta2),
                    backend)


__all__ = [
    "Backend",
    "BACKENDS",
    "PieceTable",
    "full_table",
    "resolve_backend",
    "backend_for",
    "grad_stats",
    "StepPlan",
    "ShardOperands",
    "DeviceHyperparams",
    "lr_wd_table",
    "grad_stats_planned",
    "adamw_step_planned",
    "sgd_step_planned",
    "lion_step_planned",
    "advance_step",
    "adamw_step",
    "sgd_step",
    "lion_step",
    "HAS_CUDA_EXT",
    "MASTER_DTYPES",
    "STATE_DTYPES",
    "CUDA_EXT_ERROR",
    "NUM_STATS",
    "STAT_NONFINITE",
    "STAT_SUMSQ",
    "STAT_ZEROS",
]
