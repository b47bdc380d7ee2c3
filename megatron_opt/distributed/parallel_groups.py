"""ModelParallelGroups: the model-parallel process groups a data-parallel wrapper needs to know.

Data parallelism reduces gradients over the data-parallel group (with context parallelism: the
data x context group, megatron-core's ``dp_cp``; for expert params the expert data-parallel group).
Everything else about model parallelism matters to the optimizer only through the gradient
statistics and the failure agreements:

* the tensor-parallel rank decides whether a replicated param's copy is counted (TP rank 0 only);
  for expert params the *expert* tensor-parallel rank decides;
* the pipeline rank decides bucketing (megatron-core buckets only on the first stage);
* the statistics, and every decision that could otherwise leave a rank waiting in a collective,
  are summed over ``grad_stats``: every rank of the model (the world by default), so each logical
  element is counted once and a NaN on one tensor- or pipeline-parallel peer stops every rank.

The groups come from megatron-core (``pg_collection``, else its ``parallel_state``) in megatron-core's
call shape, or are given by the caller in megatron_opt's (``model_parallel_groups=``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import collectives

ProcessGroup = torch.distributed.ProcessGroup
DIMENSIONS = ("tensor", "pipeline", "context", "expert", "expert tensor")


@dataclass(frozen=True)
class ModelParallelGroups:
    """This rank's model-parallel groups (None: size 1, except ``grad_stats`` where None is the world)."""

    tensor: Optional[ProcessGroup] = None
    pipeline: Optional[ProcessGroup] = None
    context: Optional[ProcessGroup] = None
    expert: Optional[ProcessGroup] = None
    expert_tensor: Optional[ProcessGroup] = None  # None: the same as ``tensor`` (megatron-core's default)
    # The ranks whose statistics are summed into one decision (None: the default group, the world).
    grad_stats: Optional[ProcessGroup] = None

    def _group(self, dimension: str) -> Optional[ProcessGroup]:
        if dimension == "expert tensor":  # megatron-core's default: the dense tensor-parallel group
            return self.expert_tensor if self.expert_tensor is not None else self.tensor
        return {"tensor": self.tensor, "pipeline": self.pipeline, "context": self.context,
                "expert": self.expert}[dimension]

    def size(self, dimension: str) -> int:
        """The size of one dimension's group ('tensor', 'pipeline', 'context', 'expert', 'expert tensor')."""
        group = self._group(dimension)
        return collectives.world_size(group) if group is not None else 1

    def rank(self, dimension: str) -> int:
        """This rank's index in one dimension's group (0 without one)."""
        group = self._group(dimension)
        return collectives.rank(group) if group is not None else 0

    tensor_parallel_size = property(lambda self: self.size("tensor"))
    tensor_parallel_rank = property(lambda self: self.rank("tensor"))
    expert_tensor_parallel_rank = property(lambda self: self.rank("expert tensor"))
    pipeline_parallel_size = property(lambda self: self.size("pipeline"))
    pipeline_parallel_rank = property(lambda self: self.rank("pipeline"))
    context_parallel_size = property(lambda self: self.size("context"))
    expert_parallel_size = property(lambda self: self.size("expert"))

    @property
    def is_model_parallel(self) -> bool:
        """True when any model-parallel group spans more than one rank."""
        return any(self.size(d) > 1 for d in DIMENSIONS)

    def sizes(self) -> dict[str, int]:
        """{dimension: size}, for error messages and fingerprints."""
        return {d: self.size(d) for d in DIMENSIONS}


def from_pg_collection(pg_collection: Any) -> ModelParallelGroups:
    """megatron-core's ProcessGroupCollection (fields it lacks count as size 1)."""
    def get(name: str) -> Optional[ProcessGroup]:
        group = getattr(pg_collection, name, None)
        # megatron-core allows a list of pipeline groups (one per model chunk); they share the rank.
        return group[0] if isinstance(group, (list, tuple)) and group else group

    return ModelParallelGroups(tensor=get("tp"), pipeline=get("pp"), context=get("cp"), expert=get("ep"),
                               expert_tensor=get("expt_tp"))


def from_parallel_state() -> Optional[ModelParallelGroups]:
    """megatron-core's parallel_state groups when it is imported and initialised, else None."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None

    def get(name: str) -> Optional[ProcessGroup]:
        getter = getattr(parallel_state, name, None)  # older megatron-core lacks the expert-TP group
        return getter(check_initialized=False) if getter is not None else None

    return ModelParallelGroups(
        tensor=get("get_tensor_model_parallel_group"),
        pipeline=get("get_pipeline_model_parallel_group"),
        context=get("get_context_parallel_group"),
        expert=get("get_expert_model_parallel_group"),
        expert_tensor=get("get_expert_tensor_parallel_group"),
    )


__all__ = ["ModelParallelGroups", "from_pg_collection", "from_parallel_state"]
