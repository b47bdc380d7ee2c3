"""The global gradient statistics of one step: one packed all-reduce, one host read.

Every rank contributes the stats of the gradient elements it owns (shards are disjoint, so sums
over ranks are exact) in one float64 vector; a single SUM all-reduce per process group combines
them. found_inf travels as a count of non-finite elements: summing counts is the same global OR
as a MAX of flags, and lets found_inf, the squared norm and the zero count share one collective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import collectives
from ..ops import NUM_STATS, STAT_NONFINITE, STAT_SUMSQ, STAT_ZEROS

STAT_MISSING_BACKWARD = NUM_STATS  # ranks that reached step() with no gradient since zero_grad_buffer()
STATS_SIZE = NUM_STATS + 1


def new_stats(device: torch.device) -> torch.Tensor:
    return torch.zeros(STATS_SIZE, dtype=torch.float64, device=device)


def reduce_stats(stats: torch.Tensor, groups: Sequence[Optional[torch.distributed.ProcessGroup]]) -> None:
    """SUM over each group in turn (DP, then model-parallel): equal to one SUM over their product."""
    for group in groups:
        collectives.all_reduce(stats, group)


def grad_norm_of(stats: torch.Tensor) -> torch.Tensor:
    """sqrt of the summed squares, as a 1-element tensor. The host-decided and the device-decided
    step both take the norm with this op: torch's CPU float64 sqrt is not always correctly rounded,
    so ``math.sqrt`` on the host could differ from it in the last bit."""
    return stats[STAT_SUMSQ].reshape(1).sqrt()


@dataclass(frozen=True)
class GradStats:
    nonfinite: int
    grad_norm: float  # unscaled global L2 norm, before clipping
    num_zeros: int
    missing_backward: int

    @property
    def found_inf(self) -> bool:
        # A finite-element overflow of the squared sum also counts: it cannot be clipped meaningfully.
        return self.nonfinite > 0 or not math.isfinite(self.grad_norm)

    @classmethod
    def from_tensor(cls, stats: torch.Tensor) -> "GradStats":
        values = torch.cat([stats, grad_norm_of(stats)]).tolist()  # the step's one host synchronisation
        return cls(
            nonfinite=int(values[STAT_NONFINITE]) if math.isfinite(values[STAT_NONFINITE]) else 1,
            grad_norm=values[-1],
            num_zeros=int(values[STAT_ZEROS]),
            missing_backward=int(values[STAT_MISSING_BACKWARD]),
        )
