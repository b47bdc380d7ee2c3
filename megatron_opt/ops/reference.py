"""Torch implementation of pass 1 and the step counter: the behavioural spec the CUDA kernels must
match. (Pass 2's reference is each update rule's own, ``UpdateArgs.reference`` in
``optimizer/rules/<rule>.py``, under the same rules.)

Every function works on one rank's flat shard of one bucket, described by a PieceTable, and
keeps every per-step scalar on the tensors' device (no host synchronisation), except that
``found_inf`` given to a pass-2 op is read on the host by the torch backends; the optimizer passes
``found_inf=None`` there because it has already made the skip decision after its one sync per step.

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

from .common import count_zeros_in_norm, sum_of_squares, zero_gaps
from .op_args import ShardOperands, StatsArgs

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
