"""The two ways to construct DistributedDataParallel, resolved into one set of arguments.

megatron_opt's shape is ``(module, ddp_config=None, data_parallel_group=None,
expert_data_parallel_group=None, instance_groups=None)``; megatron-core's is ``(config, ddp_config, module,
disable_bucketing=False, pg_collection=None, full_param_layout=None)``. A call is megatron-core's when it
names ``config``, ``pg_collection``, ``disable_bucketing`` or ``full_param_layout``, or when its first
positional argument is not a torch module (a TransformerConfig never is); otherwise it is ours. Mixing
the two is an error.

``full_param_layout`` (Megatron-LM main's ``get_model`` passes the layout megatron-core's own
DistributedOptimizer would use) is accepted and not used: megatron_opt's buffers, buckets and shards
follow its own layout (distributed/layout.py), which its optimizer and checkpoints are built on; the
training result does not depend on where a param sits in a buffer.

With partial sharding (``num_distributed_optimizer_instances = k > 1``) a megatron-core call also
takes the intra-instance and inter-instance groups from megatron-core (``pg_collection.intra_dp_cp``
and ``inter_dist_opt``, or parallel_state's partial data-parallel and inter-instance groups);
our call shape takes them as ``instance_groups=(intra, inter)`` (e.g. another chunk's
``intra_instance_group`` / ``inter_instance_group``, so that the chunks of one model share them);
otherwise ``instance_groups`` creates them for this wrapper. ``check_instance_groups`` checks either kind.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import collectives
from ..collectives import global_ranks
from ..config import DistributedDataParallelConfig
from ..config_conversion import as_ddp_config, check_transformer_config, starts_gradient_scale_at_one
from ..errors import InvalidConfigError, UnsupportedConfigError
from .layout import partial_sharding
from .parallel_groups import ModelParallelGroups, from_parallel_state, from_pg_collection

OURS = ("module", "ddp_config", "data_parallel_group", "expert_data_parallel_group", "instance_groups",
        "model_parallel_groups")
MEGATRON_CORE = ("config", "ddp_config", "module", "disable_bucketing", "pg_collection", "full_param_layout")


@dataclass
class DDPCall:
    module: torch.nn.Module
    ddp_config: DistributedDataParallelConfig
    data_parallel_group: Optional[torch.distributed.ProcessGroup]
    expert_data_parallel_group: Optional[torch.distributed.ProcessGroup]
    transformer_config: Any = None
    disable_bucketing: bool = False
    grad_scale_starts_at_one: bool = False
    # Partial sharding (num_distributed_optimizer_instances > 1): the groups megatron-core gave, or None.
    intra_instance_group: Optional[torch.distributed.ProcessGroup] = None
    inter_instance_group: Optional[torch.distributed.ProcessGroup] = None
    model_parallel: ModelParallelGroups = ModelParallelGroups()


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict, shape: str) -> dict[str, Any]:
    if len(args) > len(names):
        raise TypeError(f"DistributedDataParallel({shape}) takes at most {len(names)} arguments "
                        f"({', '.join(names)}), got {len(args)} positional.")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"DistributedDataParallel({shape}) got an unexpected keyword argument {key!r}; its "
                            f"arguments are ({', '.join(names)}). The other call shape is "
                            f"{'megatron-core' if shape == 'megatron_opt' else 'megatron_opt'}'s: "
                            f"({', '.join(MEGATRON_CORE if shape == 'megatron_opt' else OURS)}).")
        if key in bound:
            raise TypeError(f"DistributedDataParallel got {key!r} both by position and by keyword.")
        bound[key] = value
    return bound


def is_megatron_core_call(args: tuple, kwargs: dict) -> bool:
    if {"config", "pg_collection", "disable_bucketing", "full_param_layout"} & kwargs.keys():
        return True
    if args:
        return not isinstance(args[0], torch.nn.Module)
    return False


def _megatron_core_groups(pg_collection: Any, num_instances: int) -> tuple[Any, Any, Any, Any, ModelParallelGroups]:
    """(data-parallel group with context parallel, expert data-parallel group, intra-instance group,
    inter-instance group, model-parallel groups), as megatron-core's DDP picks them: from
    pg_collection, else from parallel_state when it is initialised, else the world (the instance
    groups: None, created later)."""
    if pg_collection is not None:
        dp = getattr(pg_collection, "dp_cp", None)
        if dp is None:
            raise ValueError("DistributedDataParallel: pg_collection has no 'dp_cp' group; megatron-core's "
                             "ProcessGroupCollection.use_mpu_process_groups() builds a complete one.")
        model_parallel = from_pg_collection(pg_collection)
        expert_dp = getattr(pg_collection, "expt_dp", None)
        if expert_dp is None:
            if model_parallel.expert_parallel_size > 1:
                raise ValueError(
                    f"DistributedDataParallel: pg_collection has an expert-parallel group of "
                    f"{model_parallel.expert_parallel_size} ranks but no 'expt_dp' group; expert params are reduced "
                    f"over the expert data-parallel group, never the dense one. Give pg_collection.expt_dp "
                    f"(ProcessGroupCollection.use_mpu_process_groups() does).")
            expert_dp = dp
        intra = inter = None
        if num_instances > 1:
            intra = getattr(pg_collection, "intra_dp_cp", None)
            inter = getattr(pg_collection, "inter_dist_opt", None)
            if (intra is None) != (inter is None):
                have, lack = ("intra_dp_cp", "inter_dist_opt") if inter is None else ("inter_dist_opt", "intra_dp_cp")
                raise ValueError(f"DistributedDataParallel: num_distributed_optimizer_instances={num_instances} and "
                                 f"pg_collection has '{have}' but no '{lack}'; give both (megatron-core's "
                                 f"ProcessGroupCollection.use_mpu_process_groups() does) or neither (megatron_opt "
                                 f"then creates them).")
        return dp, expert_dp, intra, inter, model_parallel
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    model_parallel = from_parallel_state()
    if model_parallel is not None:
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        intra = inter = None
        if num_instances > 1:
            # Sizes are checked against num_distributed_optimizer_instances by check_instance_groups: a
            # parallel_state initialised with another instance count gives groups of other sizes.
            intra = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            inter = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False)
            if inter is None:
                raise ValueError(
                    f"DistributedDataParallel: num_distributed_optimizer_instances={num_instances} but megatron-core's "
                    f"parallel_state has no inter-instance group: initialise it with initialize_model_parallel("
                    f"num_distributed_optimizer_instances={num_instances}).")
        return dp, parallel_state.get_expert_data_parallel_group(), intra, inter, model_parallel
    return None, None, None, None, ModelParallelGroups()


def _check_sizes_match(config: Any, model_parallel: ModelParallelGroups) -> None:
    """The TransformerConfig's parallel sizes must be those of the groups the gradients use: a model
    built for TP=2 wrapped over TP=1 groups would count and reduce its shards wrongly."""
    sizes = model_parallel.sizes()
    for field, dimension in (("tensor_model_parallel_size", "tensor"), ("pipeline_model_parallel_size", "pipeline"),
                             ("context_parallel_size", "context"), ("expert_model_parallel_size", "expert")):
        wanted = getattr(config, field, 1) or 1
        if wanted != sizes[dimension]:
            raise UnsupportedConfigError(
                f"TransformerConfig.{field}={wanted} but the {dimension}-parallel group this rank is in has "
                f"{sizes[dimension]} rank(s). Initialise megatron-core's parallel_state (initialize_model_parallel) "
                f"or pass a pg_collection with the sizes the model was built for.")


def parse_ddp_call(args: tuple, kwargs: dict) -> DDPCall:
    if is_megatron_core_call(args, kwargs):
        bound = _bind(MEGATRON_CORE, args, kwargs, "megatron-core")
        missing = [n for n in ("config", "ddp_config", "module") if n not in bound]
        if missing:
            raise TypeError(f"DistributedDataParallel(config, ddp_config, module, ...) (megatron-core's call shape) "
                            f"is missing {', '.join(missing)}.")
        module, config = bound["module"], bound["config"]
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}.")
        check_transformer_config(config)
        ddp_config = as_ddp_config(bound["ddp_config"])
        dp, expert_dp, intra, inter, model_parallel = _megatron_core_groups(
            bound.get("pg_collection"), ddp_config.num_distributed_optimizer_instances)
        _check_sizes_match(config, model_parallel)
        return DDPCall(module, ddp_config, dp, expert_dp, transformer_config=config,
                       disable_bucketing=bool(bound.get("disable_bucketing", False)),
                       grad_scale_starts_at_one=starts_gradient_scale_at_one(config, ddp_config),
                       intra_instance_group=intra, inter_instance_group=inter, model_parallel=model_parallel)
    bound = _bind(OURS, args, kwargs, "megatron_opt")
    if "module" not in bound:
        raise TypeError("DistributedDataParallel needs the module to wrap: "
                        "DistributedDataParallel(module, ddp_config).")
    module = bound["module"]
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}.")
    ddp_config = bound.get("ddp_config")
    given = bound.get("instance_groups")
    if given is not None and (not isinstance(given, (tuple, list)) or len(given) != 2):
        raise TypeError("DistributedDataParallel: instance_groups must be a pair (intra-instance group, "
                        "inter-instance group), e.g. (chunk.intra_instance_group, chunk.inter_instance_group) of "
                        "another chunk of the same model.")
    intra, inter = given if given is not None else (None, None)
    model_parallel = bound.get("model_parallel_groups") or ModelParallelGroups()
    if not isinstance(model_parallel, ModelParallelGroups):
        raise TypeError(f"DistributedDataParallel: model_parallel_groups must be a megatron_opt.ModelParallelGroups, "
                        f"got {type(model_parallel).__name__}.")
    expert_dp = bound.get("expert_data_parallel_group")
    if model_parallel.expert_parallel_size > 1 and expert_dp is None:
        raise ValueError(f"DistributedDataParallel: model_parallel_groups has an expert-parallel group of "
                         f"{model_parallel.expert_parallel_size} ranks, so expert params need their own "
                         f"expert_data_parallel_group (the dense data-parallel group would reduce them with the "
                         f"wrong ranks); pass expert_data_parallel_group.")
    return DDPCall(module, as_ddp_config(ddp_config) if ddp_config is not None else DistributedDataParallelConfig(),
                   bound.get("data_parallel_group"), expert_dp,
                   intra_instance_group=intra, inter_instance_group=inter, model_parallel=model_parallel)


# ----------------------------------------------------------------------------- partial sharding groups


def instance_groups(dp_group: Optional[torch.distributed.ProcessGroup], num_instances: int) -> tuple[Any, Any]:
    """(intra-instance group, inter-instance group) of this rank, newly created. Nothing is cached here
    (no process-wide state): chunks of one model share groups by passing ``instance_groups``.

    The data-parallel ranks, sorted, are split as megatron-core splits them (``layout.PartialSharding``):
    instance i is the i-th block of DP / k consecutive ranks, and the ranks at the same position of
    each block form an inter-instance group. When the data-parallel group is the whole world, every
    rank creates every group in the same order (torch.distributed.new_group's rule); when it is a
    subgroup, each rank creates only its own two groups with ``use_local_synchronization`` (only
    the members take part), so ranks of other data-parallel groups need not be here at the same time.
    """
    ranks = sorted(global_ranks(dp_group))
    split = partial_sharding(len(ranks), num_instances)
    me = torch.distributed.get_rank()
    whole_world = len(ranks) == torch.distributed.get_world_size()
    backend = torch.distributed.get_backend(dp_group)
    members = ([("intra", [ranks[r] for r in split.instance_ranks(i)]) for i in range(num_instances)]
               + [("inter", [ranks[r] for r in split.replica_ranks(j)]) for j in range(split.shard_count)])
    mine: dict[str, Any] = {}
    for kind, group_ranks in members:
        if me not in group_ranks and not whole_world:
            continue
        group = torch.distributed.new_group(group_ranks, backend=backend, use_local_synchronization=not whole_world)
        if me in group_ranks:
            mine[kind] = group
    return mine["intra"], mine["inter"]


def check_instance_groups(dp_group: Optional[torch.distributed.ProcessGroup], intra: Any, inter: Any,
                          num_instances: int) -> None:
    """Check that ``intra`` / ``inter`` split the data-parallel group into ``num_instances`` instances:
    one agreement over the data-parallel group (every rank learns every rank's groups), and every rank
    raises the same InvalidConfigError (naming the problem) if not. The intra groups must partition
    the data-parallel ranks into instances of DP / k ranks; each inter group must hold one rank of
    every instance, all at the same position (rank) in their instance, since that position is the
    shard they own."""
    dp_ranks = global_ranks(dp_group)
    split = partial_sharding(len(dp_ranks), num_instances)
    s, k = split.shard_count, num_instances
    me = torch.distributed.get_rank()
    error, held = None, None
    if intra is None or inter is None:
        error = "no intra-instance or inter-instance group"
    else:
        held = (tuple(global_ranks(intra)), tuple(global_ranks(inter)))
        if me not in held[0] or me not in held[1]:
            error = "this rank is not a member of its intra-instance or inter-instance group"
    what = "DistributedDataParallel: the partial-sharding groups are wrong"
    fix = (f"With num_distributed_optimizer_instances={k} at data-parallel size {len(dp_ranks)}, each instance "
           f"(intra group) is {s} data-parallel ranks and each inter-instance group is the {k} ranks holding the same "
           f"shard, one per instance. Initialise megatron-core's parallel_state (or build pg_collection) with "
           f"num_distributed_optimizer_instances={k}, or pass no groups and let megatron_opt create them.")
    everyone = collectives.agree(what, error, dp_group, payload=held, error_type=InvalidConfigError, failure_note=fix)
    problem = _split_problem(dict(zip(dp_ranks, everyone)), dp_ranks, s, k)
    if problem:
        raise InvalidConfigError(f"{what}: {problem}. {fix}")


def _split_problem(held: dict[int, tuple], dp_ranks: list[int], s: int, k: int) -> Optional[str]:
    """The first reason the groups each rank holds ({rank: (intra ranks, inter ranks)}) do not split
    ``dp_ranks`` into k instances of s ranks, or None."""
    intra_of = {rank: a for rank, (a, _) in held.items()}
    inter_of = {rank: b for rank, (_, b) in held.items()}
    for rank in dp_ranks:
        a, b = intra_of[rank], inter_of[rank]
        if len(a) != s or len(b) != k:
            return (f"rank {rank}'s intra-instance group has {len(a)} ranks and its inter-instance group {len(b)} "
                    f"(expected {s} and {k})")
        if not set(a) <= set(dp_ranks) or not set(b) <= set(dp_ranks):
            return (f"rank {rank}'s instance groups {list(a)} / {list(b)} reach outside the data-parallel group "
                    f"{dp_ranks}")
        if any(intra_of[m] != a for m in a) or any(inter_of[m] != b for m in b):
            return f"rank {rank}'s instance groups {list(a)} / {list(b)} differ from their members' own"
        if len({intra_of[m].index(m) for m in b}) != 1 or len({intra_of[m] for m in b}) != k:
            return (f"the inter-instance group {list(b)} does not hold one rank of every instance at the same "
                    f"position (shard)")
    return None


__all__ = ["DDPCall", "parse_ddp_call", "is_megatron_core_call", "instance_groups", "check_instance_groups",
           "global_ranks"]
