"""get_megatron_optimizer: param groups (wd_mult, lr_mult), the loss scaler, dense/expert optimizers."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..config import OptimizerConfig
from ..errors import InvalidConfigError
from ..distributed.shard_view import GradSource
from .chained import ChainedOptimizer
from .distrib_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler

ParamCond = Callable[[str, torch.nn.Parameter], bool]


def _default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return name.endswith(".bias") or param.ndim == 1


def _named_trainable(chunk: GradSource) -> list[tuple[str, torch.nn.Parameter]]:
    """The chunk's trainable params by name, in buffer order (the same on every rank)."""
    return [(shard.names[i], shard.params[i]) for shard in chunk.local_shards() for i in sorted(shard.params)]


def get_param_groups(
    model_chunks: Sequence[GradSource],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> list[dict]:
    """Groups keyed by (wd_mult, lr_mult, is_expert_parallel), in a fixed order on every rank.

    Biases and 1-D params get wd_mult 0. Params selected by ``scale_lr_cond`` get ``lr_mult`` and
    per-group max_lr / min_lr, which the scheduler honours (Megatron-LM's convention).
    """
    no_wd = no_weight_decay_cond or _default_no_weight_decay
    keyed: dict[tuple, list] = {}
    for chunk in model_chunks:
        for name, p in _named_trainable(chunk):
            key = (
                0.0 if no_wd(name, p) else 1.0,
                lr_mult if (scale_lr_cond is not None and scale_lr_cond(name, p)) else 1.0,
                not getattr(p, "allreduce", True),
            )
            keyed.setdefault(key, []).append(p)
    min_lr = config.min_lr if config.min_lr is not None else 0.0
    groups = []
    for (wd_mult, group_lr_mult, is_expert) in sorted(keyed):
        groups.append({
            "params": keyed[(wd_mult, group_lr_mult, is_expert)],
            "wd_mult": wd_mult,
            "lr_mult": group_lr_mult,
            "is_expert_parallel": is_expert,
            "is_decoupled_lr": False,
            "default_config": group_lr_mult == 1.0,
            "max_lr": config.lr * group_lr_mult,
            "min_lr": min_lr * group_lr_mult,
            "lr": config.lr * group_lr_mult,
            "weight_decay": config.weight_decay * wd_mult,
        })
    return groups


def build_grad_scaler(config: OptimizerConfig, device: torch.device) -> Optional[MegatronGradScaler]:
    """Constant when loss_scale is set; dynamic for fp16; None for bf16 / fp32 (as Megatron-LM)."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
            device=device,
        )
    return None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Union[GradSource, Sequence[GradSource]],
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
    model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    grad_stats_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Union[DistributedOptimizer, ChainedOptimizer]:
    """A DistributedOptimizer over the dense buffers; a ChainedOptimizer (dense + expert) when
    expert-parallel params (``param.allreduce == False``) exist."""
    single = isinstance(model_chunks, (GradSource, torch.nn.Module))
    chunks = [model_chunks] if single else list(model_chunks)
    for chunk in chunks:
        if not isinstance(chunk, GradSource):
            raise TypeError(f"get_megatron_optimizer needs megatron_opt.DistributedDataParallel chunks, got "
                            f"{type(chunk).__name__}; wrap the model first.")
        if chunk.ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise InvalidConfigError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but the model was "
                f"wrapped with DistributedDataParallelConfig.use_distributed_optimizer="
                f"{chunk.ddp_config.use_distributed_optimizer}; set both the same."
            )
    groups = get_param_groups(chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult)
    device = chunks[0].grad_scale_factor.device
    scaler = build_grad_scaler(config, device)
    dense_groups = [g for g in groups if not g["is_expert_parallel"]]
    expert_groups = [g for g in groups if g["is_expert_parallel"]]
    common = dict(model_parallel_group=model_parallel_group, tensor_parallel_group=tensor_parallel_group)
    dense = DistributedOptimizer(config, chunks, dense_groups, scaler, expert_parallel=False, **common)
    if not expert_groups:
        return dense
    expert = DistributedOptimizer(config, chunks, expert_groups, scaler, expert_parallel=True, **common)
    return ChainedOptimizer([dense, expert], grad_stats_group=grad_stats_group)
