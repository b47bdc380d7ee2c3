"""The kernel tests' calls of the rules' ops, each onto the one ops front (``ops.grad_stats`` /
``ops.update`` over a StepPlan): with one shard's tensors (a one-shard plan: the single-shard case) or
with a plan (``*_planned``). Built from public API only.

The plan and the lr table of a call are kept with the piece table (``PieceTable.memo``) per set of
tensors, so that a test can warm a call up and then capture it in a CUDA graph, as the optimizer
builds its plans once."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import megatron_opt.ops as ops
from megatron_opt.ops.piece_table import PieceTable
from megatron_opt.optimizer.rules import SGD, AdamW, AdamWStep, Lion, LionStep, SGDStep

_CACHE = 8


def _plan(shard: ops.ShardOperands, update: bool = True) -> ops.StepPlan:
    arrays = (shard.grad, shard.master, *shard.state, shard.param_out)
    key = ("plan", update, tuple(None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
                                 for t in arrays))
    return shard.table.memo("one_shard", key, lambda: ops.StepPlan((shard,), update=update), max_entries=_CACHE)


def _lr_wd(table: PieceTable, lr: Sequence[float], weight_decay: Sequence[float],
           device: torch.device) -> ops.LrWdTable:
    key = ("lr_wd", str(device), tuple(float(x) for x in lr), tuple(float(x) for x in weight_decay))
    return table.memo("one_shard", key, lambda: ops.lr_wd_table(lr, weight_decay, device), max_entries=_CACHE)


def grad_stats(grad: torch.Tensor, table: PieceTable, inv_scale: torch.Tensor, stats: torch.Tensor,
               count_zeros: bool = True, *, backend: ops.Backend = "auto") -> None:
    ops.grad_stats(_plan(ops.ShardOperands(table, grad), update=False), inv_scale, stats, count_zeros, backend=backend)


def _update(shard: ops.ShardOperands, lr: Sequence[float], weight_decay: Sequence[float], args: ops.UpdateArgs,
            backend: ops.Backend) -> None:
    lr_wd = _lr_wd(shard.table, lr, weight_decay, shard.grad.device)
    ops.update(_plan(shard), args, lr_wd=lr_wd, backend=backend)


def adamw_step(grad, master, exp_avg, exp_avg_sq, param_out: Optional[torch.Tensor], table: PieceTable, *,
               lr: Sequence[float], weight_decay: Sequence[float], grad_scale: torch.Tensor, step: torch.Tensor,
               beta1: float, beta2: float, eps: float, found_inf: Optional[torch.Tensor] = None,
               stochastic_rounding: bool = False, backend: ops.Backend = "auto") -> None:
    _update(ops.ShardOperands(table, grad, master, (exp_avg, exp_avg_sq), param_out), lr, weight_decay,
            AdamWStep(rule=AdamW(beta1=beta1, beta2=beta2, eps=eps, stochastic_rounding=stochastic_rounding),
                      grad_scale=grad_scale, found_inf=found_inf, step=step), backend)


def sgd_step(grad, master, momentum_buffer: Optional[torch.Tensor], param_out: Optional[torch.Tensor],
             table: PieceTable, *, lr: Sequence[float], weight_decay: Sequence[float], grad_scale: torch.Tensor,
             momentum: float, nesterov: bool = False, found_inf: Optional[torch.Tensor] = None,
             backend: ops.Backend = "auto") -> None:
    state = () if momentum_buffer is None else (momentum_buffer,)
    _update(ops.ShardOperands(table, grad, master, state, param_out), lr, weight_decay,
            SGDStep(rule=SGD(momentum=momentum, nesterov=nesterov), grad_scale=grad_scale, found_inf=found_inf),
            backend)


def lion_step(grad, master, exp_avg, param_out: Optional[torch.Tensor], table: PieceTable, *,
              lr: Sequence[float], weight_decay: Sequence[float], grad_scale: torch.Tensor, beta1: float,
              beta2: float, found_inf: Optional[torch.Tensor] = None, backend: ops.Backend = "auto") -> None:
    _update(ops.ShardOperands(table, grad, master, (exp_avg,), param_out), lr, weight_decay,
            LionStep(rule=Lion(beta1=beta1, beta2=beta2), grad_scale=grad_scale, found_inf=found_inf), backend)


def adamw_step_planned(plan: ops.StepPlan, *, lr_wd: ops.LrWdTable, grad_scale: torch.Tensor, step: torch.Tensor,
                       beta1: float, beta2: float, eps: float, found_inf: Optional[torch.Tensor] = None,
                       stochastic_rounding: bool = False, backend: ops.Backend = "auto") -> None:
    ops.update(plan, AdamWStep(rule=AdamW(beta1=beta1, beta2=beta2, eps=eps, stochastic_rounding=stochastic_rounding),
                               grad_scale=grad_scale, found_inf=found_inf, step=step), lr_wd=lr_wd, backend=backend)


def sgd_step_planned(plan: ops.StepPlan, *, lr_wd: ops.LrWdTable, grad_scale: torch.Tensor, momentum: float,
                     nesterov: bool = False, found_inf: Optional[torch.Tensor] = None,
                     backend: ops.Backend = "auto") -> None:
    record = SGDStep(rule=SGD(momentum=momentum, nesterov=nesterov), grad_scale=grad_scale, found_inf=found_inf)
    ops.update(plan, record, lr_wd=lr_wd, backend=backend)


def lion_step_planned(plan: ops.StepPlan, *, lr_wd: ops.LrWdTable, grad_scale: torch.Tensor, beta1: float,
                      beta2: float, found_inf: Optional[torch.Tensor] = None, backend: ops.Backend = "auto") -> None:
    ops.update(plan, LionStep(rule=Lion(beta1=beta1, beta2=beta2), grad_scale=grad_scale, found_inf=found_inf),
               lr_wd=lr_wd, backend=backend)
