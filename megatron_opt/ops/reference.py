"""Torch implementation of the step's two passes: the behavioural spec the CUDA kernels must match.

Every function works on one rank's flat shard of one bucket, described by a PieceTable, and
keeps every per-step scalar on the tensors' device (no host synchronisation), except that
``found_inf`` given to a pass-2 op is read on the host here; the optimizer passes ``found_inf=None``
because it has already made the skip decision after its one sync per step.

Gaps (bucket padding between pieces) are never part of a result, whatever they hold (garbage,
inf and NaN included): pass 1 counts and sums piece elements only, and pass 2 writes piece elements
only, leaving every gap element of master, state and param_out bitwise unchanged; the values in the
grad's gaps never reach a piece element. (For speed the torch ops below sweep whole runs of pieces,
gaps included: pass 1 reads a copy of the grad with zeroed gaps, and pass 2 puts the gap elements
back afterwards, ``common.gaps_kept``.)

Stats layout (float64, accumulated so several shards can share one tensor):
    stats[0] += number of non-finite grad elements in the pieces
    stats[1] += sum over in-norm pieces of (grad * inv_scale) ** 2
    stats[2] += number of grad elements equal to zero (+0.0 or -0.0) in the in-norm pieces
"""
from __future__ import annotations

from typing import Optional

import torch

from . import precision
from .common import count_zeros_in_norm, gaps_kept, sum_of_squares, update_span, zero_gaps
from .op_args import AdamWArgs, LionArgs, LrWd, SGDArgs, ShardOperands, StatsArgs

STAT_NONFINITE, STAT_SUMSQ, STAT_ZEROS = 0, 1, 2
NUM_STATS = 3


def grad_stats(shard: ShardOperands, args: StatsArgs) -> None:
    """Pass 1: reads the grads once, writes nothing but ``args.stats``."""
    table = shard.table
    span = table.span()
    if span is None:
        return
    grad = zero_gaps(shard.grad, table)  # whatever the grad's gaps hold, they now add nothing but counted zeros
    flat = grad[span[0] : span[1]]
    nonfinite = torch.isfinite(flat).logical_not_().sum()
    sumsq = sum_of_squares(grad, table.norm_runs()) * args.inv_scale.double().square().reshape(())
    zeros = count_zeros_in_norm(grad, table) if args.count_zeros else torch.zeros((), dtype=torch.float64,
                                                                                   device=grad.device)
    args.stats.add_(torch.stack([nonfinite.double(), sumsq, zeros]))


def advance_step(step: torch.Tensor, found_inf: Optional[torch.Tensor] = None) -> None:
    """step += 1, unless the device flag says the step is skipped."""
    if found_inf is None:
        step.add_(1)
    else:
        step.add_((found_inf.reshape(step.shape) == 0).to(step.dtype))


def adamw_step(shard: ShardOperands, lr_wd: LrWd, args: AdamWArgs) -> None:
    """Pass 2, AdamW (decoupled weight decay, torch.optim.AdamW's formula) on the master shard.

    ``lr_wd`` is indexed by the table's group ids. ``args.step`` is the 1-based index of this update
    (already advanced). ``param_out`` (model dtype) receives the rounded master; it is None when the
    master aliases an fp32 param.

    Precision-aware state (ops/precision.py): the moments may be fp32, bf16 or fp16 and the master
    fp32, fp16 or an int16 remainder of the bf16 ``param_out``. Every element is widened to fp32,
    updated with the same fp32 arithmetic, and rounded once on store (to nearest even, or
    stochastically for bf16 moments with ``stochastic_rounding``).
    """
    span = update_span(shard, args)
    if span is None:
        return
    a, b = span
    master, param_out, exp_avg, exp_avg_sq = shard.master, shard.param_out, shard.state[0], shard.state[1]
    lr, weight_decay, beta1, beta2, step = lr_wd.lr, lr_wd.weight_decay, args.beta1, args.beta2, args.step
    stochastic_rounding = args.stochastic_rounding
    with gaps_kept(shard.table, master, exp_avg, exp_avg_sq, param_out):
        g = shard.grad[a:b].float() * args.grad_scale  # a new tensor: never scale the persistent grad buffer
        m, v = exp_avg[a:b].float(), exp_avg_sq[a:b].float()  # .float() of fp32 is the tensor itself
        w = precision.load_master(master[a:b], None if param_out is None else param_out[a:b])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = step.double().reshape(())
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = (1 - beta2**t).sqrt()
        update = m / (v.sqrt() / bias_correction2_sqrt.float()).add_(args.eps)
        for s, e, gid in shard.table.group_runs():
            w_run = w[s - a : e - a]
            decay = lr[gid] * weight_decay[gid]
            if decay != 0:
                w_run.mul_(1 - decay)
            w_run.sub_(update[s - a : e - a] * (lr[gid] / bias_correction1).float())
        if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
            index = torch.arange(a, b, device=g.device) if stochastic_rounding else None
            step_i = int(step.reshape(())) if stochastic_rounding else 0
            precision.store_state(m, exp_avg[a:b], stochastic=stochastic_rounding, index=index, step=step_i, slot=0)
            precision.store_state(v, exp_avg_sq[a:b], stochastic=stochastic_rounding, index=index, step=step_i, slot=1)
        precision.store_master(w, master[a:b], None if param_out is None else param_out[a:b])


def sgd_step(shard: ShardOperands, lr_wd: LrWd, args: SGDArgs) -> None:
    """Pass 2, torch.optim.SGD's formula (L2 weight decay, dampening 0); the shard's state is
    (momentum_buffer,), or () without momentum (a buffer there is then ignored).

    A zero-initialised momentum buffer reproduces torch's first step (buf = g).
    """
    span = update_span(shard, args)
    if span is None:
        return
    a, b = span
    momentum, table, param_out = args.momentum, shard.table, shard.param_out
    momentum_buffer = shard.state[0] if shard.state else None
    if momentum != 0 and momentum_buffer is None:
        raise ValueError("sgd_step: momentum != 0 needs a momentum buffer")
    lr, weight_decay = lr_wd.lr, lr_wd.weight_decay
    with gaps_kept(table, shard.master, momentum_buffer if momentum != 0 else None, param_out):
        g = shard.grad[a:b].float() * args.grad_scale
        w = shard.master[a:b]
        for s, e, gid in table.group_runs():
            sl = slice(s - a, e - a)
            if weight_decay[gid] != 0:
                g[sl].add_(w[sl], alpha=weight_decay[gid])
        if momentum != 0:
            buf = momentum_buffer[a:b]
            buf.mul_(momentum).add_(g)
            direction = g.add(buf, alpha=momentum) if args.nesterov else buf
        else:
            direction = g
        for s, e, gid in table.group_runs():
            sl = slice(s - a, e - a)
            w[sl].sub_(direction[sl], alpha=lr[gid])
        if param_out is not None:
            param_out[a:b].copy_(w)


def lion_step(shard: ShardOperands, lr_wd: LrWd, args: LionArgs) -> None:
    """Pass 2, Lion (Chen et al. 2023, decoupled weight decay) on the fp32 master shard:

        c = beta1 * m + (1 - beta1) * g;  w = w * (1 - lr * wd) - lr * sign(c);  m = beta2 * m + (1 - beta2) * g

    Gap elements of master, exp_avg and param_out are left bitwise unchanged.
    """
    span = update_span(shard, args)
    if span is None:
        return
    a, b = span
    lr, weight_decay, param_out = lr_wd.lr, lr_wd.weight_decay, shard.param_out
    with gaps_kept(shard.table, shard.master, shard.state[0], param_out):
        g = shard.grad[a:b].float() * args.grad_scale
        m, w = shard.state[0][a:b], shard.master[a:b]
        direction = m.lerp(g, 1 - args.beta1).sign_()
        for s, e, gid in shard.table.group_runs():
            w_run = w[s - a : e - a]
            decay = lr[gid] * weight_decay[gid]
            if decay != 0:
                w_run.mul_(1 - decay)
            w_run.sub_(direction[s - a : e - a], alpha=lr[gid])
        m.lerp_(g, 1 - args.beta2)
        if param_out is not None:
            param_out[a:b].copy_(w)
