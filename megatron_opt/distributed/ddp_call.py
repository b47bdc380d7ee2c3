"""The two ways to construct DistributedDataParallel, resolved into one set of arguments.

megatron_opt's shape is ``(module, ddp_config=None, data_parallel_group=None,
expert_data_parallel_group=None)``; megatron-core's is ``(config, ddp_config, module,
disable_bucketing=False, pg_collection=None)``. A call is megatron-core's when it names ``config``
or ``pg_collection`` or ``disable_bucketing``, or when its first positional argument is not a
torch module (a TransformerConfig never is); otherwise it is ours. Mixing the two is an error.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import DistributedDataParallelConfig
from ..errors import UnsupportedConfigError
from ..megatron.configs import as_ddp_config, check_transformer_config, starts_gradient_scale_at_one

OURS = ("module", "ddp_config", "data_parallel_group", "expert_data_parallel_group")
MEGATRON_CORE = ("config", "ddp_config", "module", "disable_bucketing", "pg_collection")


@dataclass
class DDPCall:
    module: torch.nn.Module
    ddp_config: DistributedDataParallelConfig
    data_parallel_group: Optional[torch.distributed.ProcessGroup]
    expert_data_parallel_group: Optional[torch.distributed.ProcessGroup]
    transformer_config: Any = None
    disable_bucketing: bool = False
    grad_scale_starts_at_one: bool = False


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
    if {"config", "pg_collection", "disable_bucketing"} & kwargs.keys():
        return True
    if args:
        return not isinstance(args[0], torch.nn.Module)
    return False


def _megatron_core_groups(pg_collection: Any) -> tuple[Any, Any]:
    """(data-parallel group with context parallel, expert data-parallel group), as megatron-core's DDP
    picks them: from pg_collection, else from parallel_state when it is initialised, else the world."""
    if pg_collection is not None:
        dp = getattr(pg_collection, "dp_cp", None)
        if dp is None:
            raise ValueError("DistributedDataParallel: pg_collection has no 'dp_cp' group; megatron-core's "
                             "ProcessGroupCollection.use_mpu_process_groups() builds a complete one.")
        return dp, getattr(pg_collection, "expt_dp", None) or dp
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        for what, size in (("tensor", parallel_state.get_tensor_model_parallel_world_size()),
                           ("pipeline", parallel_state.get_pipeline_model_parallel_world_size()),
                           ("context", parallel_state.get_context_parallel_world_size()),
                           ("expert", parallel_state.get_expert_model_parallel_world_size())):
            if size != 1:
                raise UnsupportedConfigError(
                    f"megatron-core's parallel_state has {what}-model-parallel size {size}; megatron_opt's "
                    f"DistributedDataParallel implements data parallelism only. Initialise model parallelism "
                    f"with size 1.")
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return dp, parallel_state.get_expert_data_parallel_group()
    return None, None


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
        dp, expert_dp = _megatron_core_groups(bound.get("pg_collection"))
        return DDPCall(module, ddp_config, dp, expert_dp, transformer_config=config,
                       disable_bucketing=bool(bound.get("disable_bucketing", False)),
                       grad_scale_starts_at_one=starts_gradient_scale_at_one(config, ddp_config))
    bound = _bind(OURS, args, kwargs, "megatron_opt")
    if "module" not in bound:
        raise TypeError("DistributedDataParallel needs the module to wrap: DistributedDataParallel(module, ddp_config).")
    module = bound["module"]
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}.")
    ddp_config = bound.get("ddp_config")
    return DDPCall(module, as_ddp_config(ddp_config) if ddp_config is not None else DistributedDataParallelConfig(),
                   bound.get("data_parallel_group"), bound.get("expert_data_parallel_group"))


__all__ = ["DDPCall", "parse_ddp_call", "is_megatron_core_call"]
