"""Fast CPU pass 1: the semantics of ops.reference, with fewer passes over the gradient. (A rule's
fast CPU pass 2, e.g. AdamW's on torch._fused_adamw_, is its ``UpdateArgs.cpu``.)

On CPU a host read costs nothing (there is no device queue to drain), so pass 1 derives the
non-finite check from the float64 sum of squares (finite exactly when every element is finite: a
square of any fp32/bf16/fp16 value fits in float64 many times over) and counts exactly only when
that sum is not finite.

Gaps as in the reference, whatever they hold: pass 1 counts and sums piece elements only (the gaps
are read first, a small gather; only when one is nonzero does it work on a copy with zeroed gaps).
"""
from __future__ import annotations

import math

import torch

from . import reference
from .common import count_zeros_in_norm, sum_of_squares, zero_gaps
from .op_args import ShardOperands, StatsArgs

advance_step = reference.advance_step


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
