"""The boundary between data parallelism and the optimizer: published shard views and a protocol.

``distributed/`` owns buffers, buckets and their layout; the optimizer sees none of that. It gets:

* ``LocalShard``: one frozen view per bucket of this rank's owned range (flat grad and param views,
  the param pieces inside it with their names, the process group, the one resolved unscale factor
  of its gradients and its role in the gradient statistics), from ``GradSource.local_shards()``;
* ``GradSource``: the few calls the optimizer makes on a model chunk during a step, and
  ``ParamGather``, the few facts of the chunk's config it acts on (not the config itself).

The step's collective policy has one owner per decision, and the optimizer reaches both through
this module: whether and how a chunk's param all-gather is dispatched (``ParamGather``,
``gathers_in_graph``, defined here), and which groups the step's statistics are summed over
(``step_stats_groups`` / ``chain_stats_groups``, defined in stats_role.py from the shards' stats roles).

``assemble_full_tensors`` turns per-shard flat tensors (masters, grads) back into whole params by
name, a collective over each shard's group.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from .. import collectives
from .layout import ShardPiece
from .stats_role import (StatsRole, chain_stats_groups, stats_span_model_parallel, step_stats_groups,
                         with_tensor_parallel_rank)


@dataclass(frozen=True)
class LocalShard:
    """This rank's owned range of one bucket.

    ``pieces`` are the parts of params inside the range, in shard order; ``ShardPiece.param_index``
    keys ``params`` and ``names``, which list every param of the bucket (also those this rank owns
    no piece of), so a collective over the bucket's params can be issued identically on every rank.
    """

    grad: torch.Tensor  # flat view of the bucket's gradient buffer over the owned range
    param: torch.Tensor  # flat view of the bucket's param buffer (model dtype) over the owned range
    pieces: tuple[ShardPiece, ...]
    params: Mapping[int, torch.nn.Parameter]
    names: Mapping[int, str]
    group: Optional[torch.distributed.ProcessGroup]
    sharded: bool  # True: reduce-scattered, other ranks own the rest; False: all-reduced, this rank has it all
    is_expert_parallel: bool
    buffer_index: int
    bucket_index: int
    rank: int  # this rank's index among the bucket's shard owners, i.e. in ``group`` (0 when not sharded)
    shard_count: int  # shards per bucket: the size of ``group`` (DP / num_distributed_optimizer_instances)
    # The logical gradient is ``grad * unscale_factor``: a device scalar that DDP keeps current (the
    # step's 1/DP or 1/N, Megatron's scale_gradients, and the undo of a 16-bit pre-scale, resolved
    # once). The optimizer multiplies it by 1/loss_scale and knows nothing else about normalisation.
    unscale_factor: torch.Tensor
    stats_role: StatsRole  # which of these elements this rank counts in the gradient statistics, and where
    grad_prescale: float = 1.0  # what the gradients were multiplied by before their reduction (16-bit: 1/DP)
    # Partial sharding (num_distributed_optimizer_instances = k > 1). ``group`` is then one optimizer
    # instance (DP / k ranks), which holds the whole model once: statistics summed over ``group`` count
    # every element once. After the gradient sync the ranks of ``inter_instance_group`` (one per
    # instance, all holding this same shard) hold bitwise the same reduced gradient.
    data_parallel_group: Optional[torch.distributed.ProcessGroup] = None  # every rank summed into the gradient
    inter_instance_group: Optional[torch.distributed.ProcessGroup] = None  # None with one instance
    instance_count: int = 1  # k: optimizer instances holding a copy of this shard
    instance_rank: int = 0  # this rank's instance (its rank in inter_instance_group)
    # Tensor parallelism: the ranks holding copies of this bucket's replicated params (those without
    # ``tensor_model_parallel``), which must stay bitwise equal; the expert TP group for expert
    # buckets. None when there is one TP rank.
    tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None

    @property
    def numel(self) -> int:
        return self.grad.numel()

    @staticmethod
    def make(params: Mapping[int, torch.nn.Parameter], names: Mapping[int, str], **fields) -> "LocalShard":
        return LocalShard(params=MappingProxyType(dict(params)), names=MappingProxyType(dict(names)), **fields)


@dataclass(frozen=True)
class ParamGather:
    """Whether, how and by whom a chunk's param all-gather is dispatched: the one place that decides it.

    DistributedDataParallel builds it from its config; the optimizer reads it instead of the config.
    ``start_param_sync`` dispatches when ``dispatches`` says so; the optimizer's step always passes
    ``force_dispatch=True`` (it is the dispatcher the step-owned all-gather waits for).
    """

    use_distributed_optimizer: bool  # params are sharded: after an update their shards are all-gathered
    overlap_param_gather: bool  # the all-gather is asynchronous, waited by the forward pre-hooks
    # Megatron-LM's overlap_param_gather_with_optimizer_step on this chunk: the optimizer's step
    # dispatches the all-gather, so a training loop's or schedule's plain start_param_sync() does not.
    owned_by_step: bool = False

    def dispatches(self, force_dispatch: bool, force_sync: bool) -> bool:
        """Whether a start_param_sync() call dispatches the all-gather (megatron-core's rule)."""
        return not self.owned_by_step or force_dispatch or force_sync

    def is_async(self, force_sync: bool) -> bool:
        """Whether a dispatched all-gather runs asynchronously (to be waited by the forward pre-hooks)."""
        return self.overlap_param_gather and not force_sync


def gathers_in_graph(gathers: Sequence[ParamGather]) -> bool:
    """Whether the CUDA-graph step captures the param all-gathers: only when all are synchronous
    (asynchronous ones are waited by forward pre-hooks, outside the graph, so they are dispatched after it)."""
    return not any(g.overlap_param_gather for g in gathers)


@runtime_checkable
class GradSource(Protocol):
    """What the optimizer needs from one data-parallel model chunk (DistributedDataParallel).

    * ``local_shards(expert_parallel)``: the published shards, built once, in bucket order.
    * ``finish_grad_sync()``: launch what is left of the gradient reduction and wait for it; the
      logical gradient of a shard is then ``shard.grad * shard.unscale_factor``.
    * ``step_id``: advanced by ``zero_grad_buffer()``, so the optimizer can tell a new step's gradients.
    * ``grads_received``: gradients accumulated since ``zero_grad_buffer()`` (0: no backward ran).
    * ``start_param_sync(force_sync=..., force_dispatch=..., expert_parallel=...)`` /
      ``finish_param_sync()``: all-gather the updated param shards (async with overlap_param_gather);
      the optimizer always passes ``force_dispatch=True``.
    * ``param_gather``: the chunk's ``ParamGather`` (use_distributed_optimizer, overlap_param_gather,
      whether the step owns the all-gather): all the optimizer knows of the chunk's config.
    """

    @property
    def param_gather(self) -> ParamGather: ...

    @property
    def step_id(self) -> int: ...

    @property
    def grads_received(self) -> int: ...

    def local_shards(self, expert_parallel: Optional[bool] = None) -> list[LocalShard]: ...

    def finish_grad_sync(self) -> None: ...

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False,
                         expert_parallel: Optional[bool] = None) -> None: ...

    def finish_param_sync(self) -> None: ...


def assemble_full_tensors(
    shards: Sequence[LocalShard],
    flat_of: Callable[[LocalShard], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Whole params by name, in their shapes, from one flat tensor per shard (a collective).

    Every rank must call it with the same shards (those of the same model chunks): for each bucket,
    the params are zero-filled, this rank's pieces are written, and one SUM all-reduce over the
    bucket's group fills in the pieces other ranks own (pieces are disjoint, so the sum is exact).
    """
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        flat = flat_of(shard)
        order = sorted(shard.params)
        full = {i: torch.zeros(shard.params[i].numel(), dtype=dtype, device=flat.device) for i in order}
        for pc in shard.pieces:
            full[pc.param_index][pc.param_range.start : pc.param_range.end] = \
                flat[pc.shard_range.start : pc.shard_range.end].to(dtype)
        if shard.sharded and order:
            packed = torch.cat([full[i] for i in order])
            collectives.all_reduce(packed, shard.group)
            full = dict(zip(order, packed.split([full[i].numel() for i in order])))
        for i in order:
            out[shard.names[i]] = full[i].view(shard.params[i].shape).clone()
    return out


__all__ = ["LocalShard", "GradSource", "ParamGather", "ShardPiece", "StatsRole", "assemble_full_tensors",
           "chain_stats_groups", "gathers_in_graph", "stats_span_model_parallel", "step_stats_groups",
           "with_tensor_parallel_rank"]
