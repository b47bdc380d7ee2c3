"""Fast CPU versions of the step passes: the semantics of ops.reference, on torch's fused CPU kernels.

On CPU a host read costs nothing (there is no device queue to drain), so pass 1 derives the
non-finite check from the float64 sum of squares (finite exactly when every element is finite: a
square of any fp32/bf16/fp16 value fits in float64 many times over) and counts exactly only when
that sum is not finite. Pass 2 runs torch._fused_adamw_ (one fused loop per param group) on a scaled
copy of the gradient, instead of the reference's sequence of separate ops.

Gaps as in the reference, whatever they hold: pass 1 counts and sums piece elements only (the gaps
are read first, a small gather; only when one is nonzero does it work on a copy with zeroed gaps),
and pass 2 writes piece elements only (the fused loops sweep whole runs, gaps included, and
``common.gaps_kept`` puts the gap elements of master, state and param_out back afterwards).
"""
from __future__ import annotations

import math

import torch

from . import precision, reference
from .common import count_zeros_in_norm, gaps_kept, sum_of_squares, update_span, zero_gaps
from .op_args import AdamWArgs, LrWd, ShardOperands, StatsArgs

advance_step = reference.advance_step
sgd_step = reference.sgd_step
lion_step = reference.lion_step  # torch has no fused Lion; the reference is already one pass of vector ops


def grad_stats(shard: ShardOperands, args: StatsArgs) -> None:
    grad, table = shard.grad, shard.table
    span = table.span()
    if span is None:
        return
    if int(torch.count_nonzero(grad.index_select(0, table.gap_index(grad.device)))):
        grad = zero_gaps(grad, table)  # rare: garbage in the gaps (normally exactly zero) must not count
    in_norm = sum_of_squares(grad, table.norm_runs())
    excluded = sum_of_squares(grad, [(s, e) for s, e, k in table.runs(table.in_norm) if not k])
    if math.isfinite(float(in_norm + excluded)):
        nonfinite = 0
    else:  # rare: count exactly, over the pieces only
        nonfinite = int(sum(torch.isfinite(grad[s:e]).logical_not_().sum() for s, e in zip(table.starts, table.ends)))
    zeros = float(count_zeros_in_norm(grad, table)) if args.count_zeros else 0.0
    sumsq = in_norm * args.inv_scale.double().square().reshape(())
    args.stats.add_(torch.stack([torch.tensor(float(nonfinite), dtype=torch.float64), sumsq,
                            torch.tensor(zeros, dtype=torch.float64)]))


def adamw_step(shard: ShardOperands, lr_wd: LrWd, args: AdamWArgs) -> None:
    span = update_span(shard, args)
    if span is None:
        return
    a, b = span
    g = shard.grad[a:b].float() * args.grad_scale  # a new tensor: the grad buffer is never written
    step_f = args.step.to(torch.float32).reshape(())
    by_group: dict[int, list] = {}
    for s, e, gid in shard.table.group_runs():
        by_group.setdefault(gid, []).append((s - a, e - a))
    master, param_out, exp_avg, exp_avg_sq = shard.master, shard.param_out, shard.state[0], shard.state[1]
    po = None if param_out is None else param_out[a:b]
    stochastic_rounding = args.stochastic_rounding
    with gaps_kept(shard.table, master, exp_avg, exp_avg_sq, param_out):
        # 16-bit state (ops/precision.py): torch's fused loop needs fp32 params and state, so it runs
        # on widened copies (views when already fp32), which are rounded back once afterwards.
        w, m, v = precision.load_master(master[a:b], po), exp_avg[a:b].float(), exp_avg_sq[a:b].float()
        for gid, runs in by_group.items():
            torch._fused_adamw_(
                [w[s:e] for s, e in runs], [g[s:e] for s, e in runs], [m[s:e] for s, e in runs],
                [v[s:e] for s, e in runs], [], [step_f] * len(runs), lr=float(lr_wd.lr[gid]), beta1=args.beta1,
                beta2=args.beta2, weight_decay=float(lr_wd.weight_decay[gid]), eps=args.eps, amsgrad=False,
                maximize=False,
            )
        if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
            index = torch.arange(a, b) if stochastic_rounding else None
            step_i = int(args.step.reshape(())) if stochastic_rounding else 0
            precision.store_state(m, exp_avg[a:b], stochastic=stochastic_rounding, index=index, step=step_i, slot=0)
            precision.store_state(v, exp_avg_sq[a:b], stochastic=stochastic_rounding, index=index, step=step_i, slot=1)
        precision.store_master(w, master[a:b], po)
