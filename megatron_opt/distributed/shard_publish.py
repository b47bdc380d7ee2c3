"""What DistributedDataParallel publishes to the optimizer: one frozen ``LocalShard`` per bucket.

Each shard carries its views into the buffers, its pieces, its groups, the one resolved unscale
factor of its gradients (normalisation.py keeps it current) and its stats role (stats_role.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import collectives
from .buffers import Bucket, ParamAndGradBuffer
from .normalisation import GradNormalisation
from .parallel_groups import ModelParallelGroups
from .shard_view import LocalShard
from .stats_role import resolve_stats_role


def publish_shards(buffers: list[ParamAndGradBuffer], normalisation: GradNormalisation,
                   model_parallel_groups: ModelParallelGroups) -> list[LocalShard]:
    """This rank's shard of every bucket, in buffer and bucket order."""
    return [publish_shard(bi, buf, bucket, normalisation, model_parallel_groups)
            for bi, buf in enumerate(buffers) for bucket in buf.buckets]


def publish_shard(buffer_index: int, buf: ParamAndGradBuffer, bucket: Bucket, normalisation: GradNormalisation,
                  model_parallel_groups: ModelParallelGroups) -> LocalShard:
    members = {buf.param_index[id(p)]: p for p in bucket.params}
    sharded = buf.reduce_scatter and buf.shard_count > 1
    instance_count = collectives.world_size(buf.inter_group) if buf.inter_group is not None else 1
    instance_rank = collectives.rank(buf.inter_group) if buf.inter_group is not None else 0
    return LocalShard.make(
        params=members, names={i: buf.names[i] for i in members},
        grad=bucket.grad_shard, param=bucket.param_shard,
        pieces=tuple(buf.layout.shard_pieces(bucket.index, buf.rank)),
        group=buf.group, sharded=sharded,
        is_expert_parallel=buf.is_expert_parallel, buffer_index=buffer_index, bucket_index=bucket.index,
        rank=buf.rank, shard_count=buf.shard_count,
        unscale_factor=normalisation.unscale_factor(buf.grad_prescale),
        stats_role=resolve_stats_role(buf.group, sharded, buf.data_parallel_group, instance_rank, instance_count,
                                      model_parallel_groups),
        grad_prescale=buf.grad_prescale,
        data_parallel_group=buf.data_parallel_group, inter_instance_group=buf.inter_group,
        instance_count=instance_count, instance_rank=instance_rank,
        tensor_parallel_group=tensor_parallel_group(model_parallel_groups, buf.is_expert_parallel),
    )


def tensor_parallel_group(groups: ModelParallelGroups, expert: bool) -> Optional[torch.distributed.ProcessGroup]:
    """The ranks holding copies of a bucket's replicated params (the expert TP group for expert
    buckets); None when there is one."""
    group = groups.expert_tensor if expert and groups.expert_tensor is not None else groups.tensor
    return group if group is not None and collectives.world_size(group) > 1 else None


__all__ = ["publish_shards", "publish_shard", "tensor_parallel_group"]
