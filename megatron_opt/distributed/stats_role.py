"""Stats roles: which gradient elements this rank counts in the world's gradient statistics.

The optimizer sums the non-finite count, the squared norm and the zero count of the elements it
owns over a process group, and decides the step (skip or apply) from that sum, so every element must
be counted exactly once, and every rank that took part in the gradient must take part in the
decision. Which copy counts depends on how the data is replicated, which only ``distributed/``
knows; it resolves a role per published shard once, and the optimizer just reads it. Model
parallelism adds its roles here (tensor-parallel duplicates, the tied last-stage copy, expert-TP).

Which groups a step sums over is decided here too, from the roles: ``step_stats_groups`` for one
optimizer, ``chain_stats_groups`` for a ChainedOptimizer. megatron_opt's older keywords (from before
DistributedDataParallel knew the model-parallel groups: ``model_parallel_group``,
``tensor_parallel_group``, ``grad_stats_group``) are translated here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from .. import collectives
from .parallel_groups import ModelParallelGroups


@dataclass(frozen=True)
class StatsRole:
    """One shard's part in the gradient statistics."""

    groups: tuple[Optional[torch.distributed.ProcessGroup], ...]  # summed over each in turn; () on one rank
    counts: bool  # False: another rank holds these same reduced elements and counts them
    # Which model-parallel copy of a replicated param this rank holds (0: the one that counts).
    tensor_parallel_rank: int = 0
    expert_tensor_parallel_rank: Optional[int] = None  # None: unknown, the dense rank decides (old call shape)
    # True: ``groups`` already reach every model-parallel peer (the world), so nothing may add them again.
    spans_model_parallel: bool = False

    def counts_in_norm(self, param: torch.nn.Parameter, tensor_parallel_rank: Optional[int] = None) -> bool:
        """Whether ``param``'s elements add to the norm on this rank (``param_counts_in_norm`` on its
        attributes); ``tensor_parallel_rank`` overrides the rank the shard was published with."""
        given = tensor_parallel_rank is not None
        return param_counts_in_norm(
            shared=bool(getattr(param, "shared", False)),
            tensor_model_parallel=bool(getattr(param, "tensor_model_parallel", False)),
            expert_parallel=getattr(param, "allreduce", True) is False,
            tensor_parallel_rank=tensor_parallel_rank if given else self.tensor_parallel_rank,
            expert_tensor_parallel_rank=None if given else self.expert_tensor_parallel_rank,
        )


def param_counts_in_norm(*, shared: bool, tensor_model_parallel: bool, expert_parallel: bool,
                         tensor_parallel_rank: int, expert_tensor_parallel_rank: Optional[int] = None) -> bool:
    """Whether a param's elements on this rank add to the world's gradient statistics (megatron-core
    main's ``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``).

    The last stage's tied copy (``shared``) never counts: the first stage holds the same all-reduced
    grad. A ``tensor_model_parallel`` param holds a different slice on every TP rank, so it counts on
    each; a replicated one holds the same grad on every TP rank, so only TP rank 0 counts. Expert
    params (``allreduce=False``) are replicated over the *expert* TP group, not the dense one, so they
    are deduplicated by the expert TP rank: 0.16.1 used the dense TP rank and undercounted whenever
    TP != expert-TP (Megatron-LM #5916, #6470). ``expert_tensor_parallel_rank=None`` keeps the old
    call shape (the dense rank), which is exact only while expert TP equals dense TP.
    """
    if shared:
        return False
    if tensor_model_parallel:
        return True
    if expert_parallel and expert_tensor_parallel_rank is not None:
        return expert_tensor_parallel_rank == 0
    return tensor_parallel_rank == 0


def shard_counts(*, sharded: bool, group_rank: int, instance_rank: int) -> bool:
    """Whether this rank counts the elements of a shard it holds: with partial sharding only instance
    0 (every instance holds the whole model once); unsharded (all-reduced, every rank of the group
    holds the same sum) only rank 0 of the group."""
    return instance_rank == 0 and (sharded or group_rank == 0)


def element_counts(*, shared: bool, tensor_model_parallel: bool, expert_parallel: bool, tensor_parallel_rank: int,
                   expert_tensor_parallel_rank: int, sharded: bool, group_rank: int, instance_rank: int) -> bool:
    """The whole counting rule for one owned element: its shard counts here and its param is no
    duplicate of another model-parallel rank's. Summed over the world, each logical element of the
    model is then counted exactly once (property-tested in tests/unit/test_model_parallel_layout.py)."""
    return shard_counts(sharded=sharded, group_rank=group_rank, instance_rank=instance_rank) and param_counts_in_norm(
        shared=shared, tensor_model_parallel=tensor_model_parallel, expert_parallel=expert_parallel,
        tensor_parallel_rank=tensor_parallel_rank, expert_tensor_parallel_rank=expert_tensor_parallel_rank)


def resolve_stats_role(group: Optional[torch.distributed.ProcessGroup], sharded: bool,
                       data_parallel_group: Optional[torch.distributed.ProcessGroup],
                       instance_rank: int, instance_count: int,
                       model_parallel: Optional[ModelParallelGroups] = None) -> StatsRole:
    """The role of a shard reduced over ``group`` (sharded: reduce-scattered, each rank owns a part;
    else all-reduced, every rank holds it all).

    Without sharding only rank 0 of the group counts (the others hold the same sum). With partial
    sharding (``instance_count`` > 1) ``group`` is one optimizer instance, which holds the whole model
    once: only instance 0 counts, and the sum, like every step decision, runs over the whole
    data-parallel group so that a failure outside the gradients (a missing backward on one rank)
    reaches every rank, not only that rank's instance.

    With model parallelism the sum runs over ``model_parallel.grad_stats`` (the world by default):
    each rank then holds different params or different copies, the per-param rule
    (``param_counts_in_norm``, with this rank's TP and expert-TP ranks) keeps one copy of each, and a
    failure on one tensor- or pipeline-parallel peer reaches every rank.
    """
    counts = shard_counts(sharded=sharded, group_rank=collectives.rank(group), instance_rank=instance_rank)
    if model_parallel is not None and model_parallel.is_model_parallel:
        return StatsRole(groups=(model_parallel.grad_stats,), counts=counts,
                         tensor_parallel_rank=model_parallel.tensor_parallel_rank,
                         expert_tensor_parallel_rank=model_parallel.expert_tensor_parallel_rank,
                         spans_model_parallel=True)
    summed_over = data_parallel_group if instance_count > 1 else group
    return StatsRole(groups=(summed_over,) if collectives.world_size(summed_over) > 1 else (), counts=counts)


ProcessGroup = torch.distributed.ProcessGroup


def step_stats_groups(roles: Sequence[StatsRole],
                      model_parallel_group: Optional[ProcessGroup] = None) -> list[Optional[ProcessGroup]]:
    """The groups one optimizer's statistics, and every step decision, are summed over, in turn ([] on
    one rank; [None] is the default group): those of its shards' roles, then the older
    ``model_parallel_group`` keyword's where the roles do not already reach every model-parallel peer."""
    groups = next((list(role.groups) for role in roles if role.groups), [])
    if model_parallel_group is not None and not any(role.spans_model_parallel for role in roles):
        groups.append(model_parallel_group)
    return groups


def chain_stats_groups(grad_stats_group: Optional[ProcessGroup] = None) -> list[Optional[ProcessGroup]]:
    """A ChainedOptimizer's: one group covering every rank that holds any child's shards (dense and
    expert children hold different params): ``grad_stats_group`` if given, else the world."""
    return [grad_stats_group]


def stats_span_model_parallel(roles: Sequence[StatsRole], model_parallel_group: Optional[ProcessGroup] = None) -> bool:
    """Whether the statistics reach model-parallel peers (ranks holding other params)."""
    return model_parallel_group is not None or any(role.spans_model_parallel for role in roles)


def with_tensor_parallel_rank(role: StatsRole, tensor_parallel_group: Optional[ProcessGroup]) -> StatsRole:
    """The older ``tensor_parallel_group`` keyword: that group's rank decides which copies of replicated
    params count, expert params included (the role as published when it is None)."""
    if tensor_parallel_group is None:
        return role
    return replace(role, tensor_parallel_rank=collectives.rank(tensor_parallel_group), expert_tensor_parallel_rank=None)


__all__ = ["StatsRole", "element_counts", "param_counts_in_norm", "resolve_stats_role", "shard_counts",
           "step_stats_groups", "chain_stats_groups", "stats_span_model_parallel", "with_tensor_parallel_rank"]
