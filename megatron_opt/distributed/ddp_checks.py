"""What DistributedDataParallel checks when it is built, and once per step after.

At construction: the groups contain this rank, the params can live in buffers, and every data-parallel
replica wraps the same model with the same config (``agree_on_wrapping``: one collective, so a bad
param or a different model on one rank raises on every rank instead of hanging later); with partial
sharding, the instance groups (``resolve_instance_groups``). Once per step (``WrappedParams``): the
module still holds the params that were wrapped, in their buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import collectives
from ..collectives import global_ranks
from ..config import DistributedDataParallelConfig
from ..errors import StepOrderError, UnsupportedConfigError
from .ddp_call import DDPCall, check_instance_groups, instance_groups
from .layout import partial_sharding
from .parallel_groups import ModelParallelGroups

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

NamedParams = list[tuple[str, torch.nn.Parameter]]
ProcessGroup = torch.distributed.ProcessGroup


def check_membership(group: Optional[ProcessGroup], what: str) -> None:
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_rank(group) < 0:
        raise ValueError(f"DistributedDataParallel: this rank ({torch.distributed.get_rank()}) is not a member of "
                         f"the {what} it was given; pass the group that contains this rank.")


def check_params(named: NamedParams) -> None:
    if not named:
        raise ValueError("DistributedDataParallel: the module has no parameter with requires_grad=True.")
    empty = [n for n, p in named if p.numel() == 0]
    if empty:
        raise ValueError(f"DistributedDataParallel: param '{empty[0]}' has no elements, so it cannot live in a "
                         f"gradient buffer; freeze it (requires_grad=False) or remove it from the module.")
    wrapped = [n for n, p in named if getattr(p, "_megatron_opt_wrapped", False)]
    if wrapped:
        raise ValueError(f"DistributedDataParallel: param '{wrapped[0]}' is already wrapped by another "
                         f"DistributedDataParallel; wrap each module once (two wrappers would each re-point "
                         f"the param into their own buffer).")
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise ValueError(f"DistributedDataParallel: all trainable params must be on one device, got {devices}.")
    for name, p in named:
        if p.dtype not in SUPPORTED_PARAM_DTYPES:
            raise ValueError(
                f"param '{name}' has dtype {p.dtype}; megatron_opt buffers hold float32, bfloat16 or "
                f"float16 params. Cast the module (e.g. module.to(torch.bfloat16)) or freeze the param "
                f"(requires_grad=False)."
            )


def experts_share_dp_group(named: NamedParams, data_parallel_group: Optional[ProcessGroup],
                           expert_data_parallel_group: Optional[ProcessGroup]) -> bool:
    """True when there are no expert-parallel params, or their data-parallel group spans the same
    ranks as the dense one (then partial sharding splits both the same way)."""
    if all(getattr(p, "allreduce", True) for _, p in named):
        return True
    return sorted(global_ranks(expert_data_parallel_group)) == sorted(global_ranks(data_parallel_group))


@dataclasses.dataclass(frozen=True)
class WrappingFacts:
    """What every data-parallel replica must agree on when it wraps its model."""

    named: NamedParams
    ddp_config: DistributedDataParallelConfig
    dp_size: int
    model_parallel_groups: ModelParallelGroups
    data_parallel_group: Optional[ProcessGroup]
    expert_data_parallel_group: Optional[ProcessGroup]

    def fingerprint(self) -> list:
        items: list = [(f"trainable param {i}", (n, tuple(p.shape), str(p.dtype)))
                       for i, (n, p) in enumerate(self.named)]
        items.append(("number of trainable params", len(self.named)))
        items += [(f"ddp_config.{f.name}", getattr(self.ddp_config, f.name))
                  for f in dataclasses.fields(self.ddp_config)]
        items.append(("data-parallel size", self.dp_size))
        items.append(("model-parallel sizes", self.model_parallel_groups.sizes()))
        if self.ddp_config.num_distributed_optimizer_instances > 1:
            items.append(("expert params share the data-parallel group", self.experts_share_dp_group()))
        return items

    def experts_share_dp_group(self) -> bool:
        return experts_share_dp_group(self.named, self.data_parallel_group, self.expert_data_parallel_group)


def agree_on_wrapping(facts: WrappingFacts) -> None:
    """One collective: a bad param on one rank, or ranks that wrap different models or configs, raise
    on every rank here instead of hanging or training different params later. With model parallelism
    the replicas compare fingerprints and then every rank of the model learns the outcome."""
    local_error = None
    try:
        check_params(facts.named)
    except ValueError as exc:
        local_error = str(exc)

    def agree_over_replicas() -> None:
        collectives.agree(
            "DistributedDataParallel", local_error, facts.data_parallel_group, fingerprint=facts.fingerprint(),
            error_type=ValueError,
            fix="Every data-parallel rank must wrap the same model (same param names, order, shapes, dtypes and "
                "requires_grad) with the same DistributedDataParallelConfig.")

    if facts.model_parallel_groups.is_model_parallel:
        collectives.raise_together(agree_over_replicas, facts.model_parallel_groups.grad_stats,
                                   "DistributedDataParallel", ValueError)
    else:
        agree_over_replicas()


def resolve_instance_groups(call: DDPCall, facts: WrappingFacts) -> tuple[Any, Any]:
    """(intra-instance, inter-instance) groups: (the data-parallel group, None) with one instance. The
    ranks agreed on the config, the DP size and whether expert params can be partially sharded, so
    this raises on every rank or on none."""
    k = facts.ddp_config.num_distributed_optimizer_instances
    if k == 1:
        return facts.data_parallel_group, None
    partial_sharding(facts.dp_size, k)  # InvalidConfigError unless k divides DP (the same on every rank)
    if not facts.experts_share_dp_group():
        raise UnsupportedConfigError(
            f"DistributedDataParallelConfig.num_distributed_optimizer_instances={k} with expert-parallel params "
            f"(allreduce=False) whose expert_data_parallel_group differs from the data-parallel group: partial "
            f"sharding of a separate expert data-parallel group is not implemented. Use "
            f"num_distributed_optimizer_instances=1, or expert_data_parallel_group = data_parallel_group.")
    intra, inter = call.intra_instance_group, call.inter_instance_group
    if intra is None:
        intra, inter = instance_groups(facts.data_parallel_group, k)
    check_instance_groups(facts.data_parallel_group, intra, inter, k)
    return intra, inter


class WrappedParams:
    """The storage and dtype of every wrapped param, recorded after they were moved into the buffers."""

    def __init__(self, named: NamedParams) -> None:
        self._storage = {id(p): (p.data_ptr(), p.dtype) for _, p in named}
        self._built_distributed = torch.distributed.is_initialized()

    def check_unchanged(self, module: torch.nn.Module) -> None:
        """Raise naming the param if the module changed under the wrapper: a param's storage is no
        longer the buffer view (``.data`` reassigned, ``module.to(dtype)``, ``load_state_dict(assign=True)``),
        its dtype changed, ``requires_grad`` was flipped, or the process group appeared after wrapping."""
        if (not self._built_distributed and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1):
            raise StepOrderError("DistributedDataParallel was built before init_process_group(), so its buffers are "
                                 "not sharded or reduced over the data-parallel ranks; wrap the model after "
                                 "torch.distributed.init_process_group().")
        fix = ("Make such changes before wrapping (cast, load and freeze first), or copy values in place "
               "(param.data.copy_(...), load_state_dict without assign=True).")
        trainable = 0
        for name, p in module.named_parameters():
            expected = self._storage.get(id(p))
            if expected is None:
                if p.requires_grad:
                    raise ValueError(f"param '{name}' is not the param that was wrapped: it was replaced (e.g. "
                                     f"load_state_dict(assign=True), a new nn.Parameter) or became trainable after "
                                     f"wrapping, so it is not in megatron_opt's buffers and would never be "
                                     f"updated. {fix}")
                continue
            trainable += 1
            if not p.requires_grad:
                raise ValueError(f"param '{name}' had requires_grad set to False after wrapping; it is still in the "
                                 f"buffers and the optimizer would keep updating it. {fix}")
            if (p.data_ptr(), p.dtype) != expected:
                raise ValueError(f"param '{name}' no longer lives in megatron_opt's buffer (its storage or dtype "
                                 f"changed after wrapping: now {p.dtype}), so training would not change it. {fix}")
        if trainable != len(self._storage):
            raise ValueError(f"{len(self._storage) - trainable} wrapped param(s) are no longer in the module. {fix}")


__all__ = ["SUPPORTED_PARAM_DTYPES", "WrappingFacts", "WrappedParams", "agree_on_wrapping", "check_membership",
           "check_params", "experts_share_dp_group", "resolve_instance_groups"]
