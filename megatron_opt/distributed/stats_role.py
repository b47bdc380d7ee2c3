"""Stats roles: which gradient elements this rank counts in the world's gradient statistics.

The optimizer sums the non-finite count, the squared norm and the zero count of the elements it
owns over a process group, and decides the step (skip or apply) from that sum, so every element must
be counted exactly once, and every rank that took part in the gradient must take part in the
decision. Which copy counts depends on how the data is replicated, which only ``distributed/``
knows; it resolves a role per published shard once, and the optimizer just reads it. Model
parallelism adds its roles here (tensor-parallel duplicates, the tied last-stage copy, expert-TP).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import collectives


@dataclass(frozen=True)
class StatsRole:
    """One shard's part in the gradient statistics."""

    groups: tuple[Optional[torch.distributed.ProcessGroup], ...]  # summed over each in turn; () on one rank
    counts: bool  # False: another rank holds these same reduced elements and counts them

    @staticmethod
    def counts_in_norm(param: torch.nn.Parameter, tensor_parallel_rank: int = 0) -> bool:
        """Whether ``param``'s elements add to the norm: shared params count once (elsewhere), and
        params that tensor parallelism duplicates count on TP rank 0 only."""
        if getattr(param, "shared", False):
            return False
        return bool(getattr(param, "tensor_model_parallel", False)) or tensor_parallel_rank == 0


def resolve_stats_role(group: Optional[torch.distributed.ProcessGroup], sharded: bool,
                       data_parallel_group: Optional[torch.distributed.ProcessGroup],
                       instance_rank: int, instance_count: int) -> StatsRole:
    """The role of a shard reduced over ``group`` (sharded: reduce-scattered, each rank owns a part;
    else all-reduced, every rank holds it all).

    Without sharding only rank 0 of the group counts (the others hold the same sum). With partial
    sharding (``instance_count`` > 1) ``group`` is one optimizer instance, which holds the whole model
    once: only instance 0 counts, and the sum, like every step decision, runs over the whole
    data-parallel group so that a failure outside the gradients (a missing backward on one rank)
    reaches every rank, not only that rank's instance.
    """
    summed_over = data_parallel_group if instance_count > 1 else group
    counts = instance_rank == 0 and (sharded or collectives.rank(group) == 0)
    return StatsRole(groups=(summed_over,) if collectives.world_size(summed_over) > 1 else (), counts=counts)


__all__ = ["StatsRole", "resolve_stats_role"]
