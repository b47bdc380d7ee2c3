"""The global gradient statistics of one step, packed: one all-reduce per stats group.

Every rank contributes the stats of the gradient elements it owns (shards are disjoint, so sums
over ranks are exact) in one float64 vector; a single SUM all-reduce per process group combines
them. found_inf travels as a count of non-finite elements: summing counts is the same global OR
as a MAX of flags, and lets found_inf, the squared norm and the zero count share one collective.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import collectives
from ...ops import NUM_STATS, STAT_NONFINITE, STAT_SUMSQ, STAT_ZEROS

STAT_MISSING_BACKWARD = NUM_STATS  # ranks that reached step() with no gradient since zero_grad_buffer()
STAT_LATE_GRADIENT = NUM_STATS + 1  # ranks where a gradient reached a hook after its bucket was launched
STATS_SIZE = NUM_STATS + 2


def new_stats(device: torch.device) -> torch.Tensor:
    return torch.zeros(STATS_SIZE, dtype=torch.float64, device=device)


def reduce_stats(stats: torch.Tensor, groups: Sequence[Optional[torch.distributed.ProcessGroup]]) -> None:
    """SUM over each group in turn (DP, then model-parallel): equal to one SUM over their product."""
    for group in groups:
        collectives.all_reduce(stats, group)


def grad_norm_of(stats: torch.Tensor) -> torch.Tensor:
    """sqrt of the summed squares, as a 1-element tensor (a device op: torch's CPU float64 sqrt is
    not always correctly rounded, so ``math.sqrt`` on the host could differ from it in the last bit)."""
    return stats[STAT_SUMSQ].reshape(1).sqrt()


__all__ = ["STAT_NONFINITE", "STAT_SUMSQ", "STAT_ZEROS", "STAT_MISSING_BACKWARD", "STAT_LATE_GRADIENT", "STATS_SIZE",
           "new_stats", "reduce_stats", "grad_norm_of"]
