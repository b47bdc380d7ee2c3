"""Fast CPU pass 1: the semantics of ops.reference, with fewer passes over the gradient. (A rule's
fast CPU pass 2, e.g. AdamW's on torch._fused_adamw_, is its ``UpdateArgs.cpu``.)

One fp32 read of the pieces: the sum of squares in fp32 blocks added in float64
(``common.blocked_sum_of_squares``, within ~1e-7 of a float64 sum). On CPU a host read costs nothing
(there is no device queue to drain), so the non-finite check comes from that sum: it is finite when
every element is finite, unless fp32 squares overflowed; only then (rare) are the pieces counted
exactly and, if all are finite, summed again in float64.

Gaps as in the reference, whatever they hold: pass 1 counts and sums piece elements only (the gaps
are read first, a small gather; only when one is nonzero does it work on a copy with zeroed gaps).
"""
from __future__ import annotations

import math

import torch

from . import reference
from .common import blocked_sum_of_squares, count_zeros_in_norm, sum_of_squares, zero_gaps
from .op_args import ShardOperands, StatsArgs

advance_step = reference.advance_step


def grad_stats(shard: ShardOperands, args: StatsArgs) -> None:
    grad, table = shard.grad, shard.table
    span = table.span()
    if span is None:
        return
    if int(torch.count_nonzero(grad.index_select(0, table.gap_index(grad.device)))):
        grad = zero_gaps(grad, table)  # rare: garbage in the gaps (normally exactly zero) must not count
    norm_runs = table.norm_runs()
    excluded_runs = [(s, e) for s, e, k in table.runs(table.in_norm) if not k]
    in_norm = blocked_sum_of_squares(grad, norm_runs)
    excluded = blocked_sum_of_squares(grad, excluded_runs)
    nonfinite = 0
    if not math.isfinite(float(in_norm + excluded)):  # rare: count exactly, over the pieces only
        nonfinite = int(sum(torch.isfinite(grad[s:e]).logical_not_().sum() for s, e in zip(table.starts, table.ends)))
        if nonfinite == 0:  # finite values whose fp32 squares overflowed
            in_norm = sum_of_squares(grad, norm_runs)
    zeros = float(count_zeros_in_norm(grad, table)) if args.count_zeros else 0.0
    sumsq = in_norm * args.inv_scale.double().square().reshape(())
    args.stats.add_(torch.stack([torch.tensor(float(nonfinite), dtype=torch.float64), sumsq,
                            torch.tensor(zeros, dtype=torch.float64)]))
