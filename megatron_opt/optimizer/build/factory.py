"""get_megatron_optimizer: param groups (wd_mult, lr_mult), the loss scaler, dense/expert optimizers."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ... import collectives
from ...config import OptimizerConfig
from ...errors import InvalidConfigError, UnsupportedConfigError
from ...config_conversion import as_optimizer_config, is_ours
from ...distributed.shard_view import GradSource
from ..chained import ChainedOptimizer
from ..distrib_optimizer import DistributedOptimizer
from ..grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .param_groups import ParamCond, build_param_groups, legacy_overrides, megatron_core_overrides
from ..rules.base import Needs
from ..rules.registry import update_rule_from_config



def _named_trainable(chunk: GradSource, wrapper_names: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """The chunk's trainable params by name: the buffers' own names (the wrapped module's, which
    megatron_opt's conditions see), or with ``wrapper_names`` as the chunk's ``named_parameters()``
    gives them (through the wrapper, as megatron-core's ParamKeys see them)."""
    managed = {id(shard.params[i]): (shard.names[i], shard.params[i])
               for shard in chunk.local_shards() for i in shard.params}
    if wrapper_names and isinstance(chunk, torch.nn.Module):
        named = [(n, p) for n, p in chunk.named_parameters() if id(p) in managed]
        if len(named) == len(managed):
            return named
    return list(managed.values())


def get_param_groups(
    model_chunks: Sequence[GradSource],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
    config_overrides: Optional[Mapping[Any, Mapping]] = None,
) -> list[dict]:
    """Param groups with megatron-core's semantics (see optimizer/build/param_groups.py), the same on every rank.

    ``config_overrides`` ({megatron-core ParamKey: ParamGroupOverride}) works as in megatron-core;
    without it, megatron-core's standard overrides apply (no weight decay on biases and 1-D params,
    ``decoupled_lr`` for embedding and output params), with megatron_opt's keywords on top:
    ``no_weight_decay_cond(name, param)`` replaces the weight-decay rule, ``scale_lr_cond`` selects
    params for ``lr_mult`` (and max / min lr scaled by it). The two styles cannot be mixed.
    """
    if config_overrides is not None and (no_weight_decay_cond is not None or scale_lr_cond is not None):
        raise ValueError("get_param_groups: pass either config_overrides (megatron-core's) or no_weight_decay_cond / "
                         "scale_lr_cond (megatron_opt's), not both; express the conditions as ParamKey overrides.")
    if config_overrides is not None:
        rules = megatron_core_overrides(config, config_overrides)
    else:
        rules = legacy_overrides(config, no_weight_decay_cond, scale_lr_cond, lr_mult)
    named = [item for chunk in model_chunks for item in _named_trainable(chunk, config_overrides is not None)]
    return build_param_groups(named, config, rules)


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
    config: Any,
    model_chunks: Union[GradSource, Sequence[GradSource]],
    config_overrides: Optional[Mapping[Any, Mapping]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: Optional[str] = None,
    *,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
    model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    grad_stats_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Union[DistributedOptimizer, ChainedOptimizer]:
    """The optimizer over ``model_chunks``' grad buffers, with megatron-core's call shape.

    ``config`` is megatron_opt's or megatron-core's OptimizerConfig (converted field by field).
    ``config_overrides`` has megatron-core's semantics (see get_param_groups); ``use_gloo_process_groups``
    changes nothing (megatron_opt reduces over the data-parallel group it was given, whatever its
    backend); ``pg_collection``'s model-parallel sizes must match the chunks' (the groups themselves
    come from the chunks, wrapped by DistributedDataParallel); ``dump_param_to_param_group_map``
    saves {param name: group index} with torch.distributed.checkpoint, as megatron-core does.

    Returns a DistributedOptimizer, or a ChainedOptimizer of dense and expert children when
    expert-parallel params (``param.allreduce == False``) exist. Called as Megatron-LM calls it (a
    megatron-core OptimizerConfig, or chunks built with megatron-core's DDP call shape), it returns a
    ChainedOptimizer in every case, as megatron-core does.

    With ``overlap_param_gather_with_optimizer_step`` (megatron-core's semantics) it returns a
    ChainedOptimizer whose first child owns the first chunk's dense params and the second the other
    chunks'; the step all-gathers the first chunk's params asynchronously as soon as that child's
    update is applied on every rank, while the other children update theirs, and the first chunk's
    own ``start_param_sync()`` then dispatches nothing (``force_dispatch=True`` still does).
    """
    megatron_core_call = not is_ours(config)
    config = as_optimizer_config(config)
    rule = update_rule_from_config(config)  # the config checked against its rule before anything is built
    single = isinstance(model_chunks, (GradSource, torch.nn.Module))
    chunks = [model_chunks] if single else list(model_chunks)
    for chunk in chunks:
        if not isinstance(chunk, GradSource):
            raise TypeError(f"get_megatron_optimizer needs megatron_opt.DistributedDataParallel chunks, got "
                            f"{type(chunk).__name__}; wrap the model first.")
        if chunk.param_gather.use_distributed_optimizer != config.use_distributed_optimizer:
            raise InvalidConfigError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but the model was "
                f"wrapped with DistributedDataParallelConfig.use_distributed_optimizer="
                f"{chunk.param_gather.use_distributed_optimizer}; set both the same."
            )
        megatron_core_call = megatron_core_call or getattr(chunk, "config", None) is not None
    _check_pg_collection(pg_collection, chunks)

    def groups_of(some_chunks: list) -> list[dict]:
        return get_param_groups(some_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult, config_overrides)

    groups = groups_of(chunks)
    expert_groups = [g for g in groups if g["is_expert_parallel"]]
    # megatron-core's split for overlap_param_gather_with_optimizer_step: the first chunk's dense
    # params get their own optimizer, stepped first, so their all-gather overlaps the rest of the step.
    overlap_with_step = config.overlap_param_gather_with_optimizer_step
    splits = [chunks[:1], chunks[1:]] if overlap_with_step and len(chunks) > 1 else [chunks]
    dense_per_split = [[g for g in (groups if len(splits) == 1 else groups_of(split)) if not g["is_expert_parallel"]]
                       for split in splits]
    for i, chunk in enumerate(chunks):
        # megatron-core's protocol: the chunk learns that the step dispatches its all-gather (its
        # ParamGather then decides what a plain start_param_sync() does).
        if hasattr(chunk, "overlap_param_gather_with_optimizer_step"):
            chunk.overlap_param_gather_with_optimizer_step = bool(overlap_with_step and i == 0)
    if dump_param_to_param_group_map is not None:
        dumped = groups if len(splits) == 1 else [g for dense in dense_per_split for g in dense] + expert_groups
        _dump_param_groups(chunks, dumped, dump_param_to_param_group_map)
    device = chunks[0].grad_scale_factor.device
    scaler = build_grad_scaler(config, device)
    common = dict(model_parallel_group=model_parallel_group, tensor_parallel_group=tensor_parallel_group)
    split = rule.param_split()
    if split is not None:  # the whole-tensor family (Muon, AdaptiveMuon, SOAP), megatron-core's Lion: AdamW the rest
        if rule.needs is Needs.WHOLE_TENSORS:
            _check_muon_layout(config, chunks, tensor_parallel_group)
        return _paired_optimizer(config, split, splits, dense_per_split, chunks, expert_groups, scaler, common,
                                 grad_stats_group)
    children = [DistributedOptimizer(config, split, dense, scaler, expert_parallel=False, **common)
                for split, dense in zip(splits, dense_per_split)]
    if expert_groups:
        children.append(DistributedOptimizer(config, chunks, expert_groups, scaler, expert_parallel=True, **common))
    if len(children) == 1 and not megatron_core_call and not overlap_with_step:
        return children[0]
    return ChainedOptimizer(children, grad_stats_group=grad_stats_group)


def _paired_optimizer(config: OptimizerConfig, takes: Callable[[torch.Tensor], bool], splits: list[list],
                      dense_per_split: list[list[dict]], chunks: list, expert_groups: list[dict],
                      scaler: Optional[MegatronGradScaler], common: dict,
                      grad_stats_group: Optional[torch.distributed.ProcessGroup]) -> ChainedOptimizer:
    """A rule for the params its ``takes`` selects (``UpdateRule.param_split``: the whole-tensor family, Muon,
    AdaptiveMuon and SOAP; megatron-core's Lion), megatron-core's split: the rule for 2-D params not marked
    is_embedding_or_output_parameter, AdamW with the adam_* settings for the rest, and (grouping by (optimizer,
    is_expert) as megatron-core does) the expert-parallel params apart: [dense rule, dense AdamW] per split of the
    chunks, then [expert rule, expert AdamW], every leaf under the chain's one driver (one norm, one clip, one
    decision, one scaler). A whole-tensor leaf exchanges its matrices over its shards' data-parallel group: the
    dense DP group (one optimizer instance of it with partial sharding) or the expert DP group. With
    overlap_param_gather_with_optimizer_step the first split (the first chunk's dense params) is stepped and
    all-gathered first: its two children together."""
    adam_config = dataclasses.replace(config, optimizer="adam")

    def pair(some_chunks: list, groups: list[dict], expert: bool, always_rule: bool) -> list[DistributedOptimizer]:
        def part(keep: bool) -> list[dict]:
            parts = [dict(g, params=[p for p in g["params"] if takes(p) == keep]) for g in groups]
            return [g for g in parts if g["params"]]

        out = []
        rule_groups, adam_groups = part(True), part(False)
        if rule_groups or always_rule:
            out.append(DistributedOptimizer(config, some_chunks, rule_groups, scaler, expert_parallel=expert,
                                            selects=takes, **common))
        if adam_groups:
            out.append(DistributedOptimizer(adam_config, some_chunks, adam_groups, scaler, expert_parallel=expert,
                                            selects=lambda p: not takes(p), **common))
        return out

    per_split = [pair(split, dense, False, always_rule=i == 0) for i, (split, dense) in enumerate(zip(splits,
                                                                                                     dense_per_split))]
    children = [c for cs in per_split for c in cs]
    if expert_groups:
        children += pair(chunks, expert_groups, True, always_rule=False)
    early = len(per_split[0]) if config.overlap_param_gather_with_optimizer_step else None
    return ChainedOptimizer(children, grad_stats_group=grad_stats_group, early_children=early)


def _check_muon_layout(config: OptimizerConfig, chunks: Sequence[GradSource],
                       tensor_parallel_group: Optional[torch.distributed.ProcessGroup]) -> None:
    """Muon runs at data, tensor (muon_tp_mode, with or without sequence parallelism), pipeline
    parallelism (virtual stages included) and expert parallelism (its own Muon and AdamW leaves,
    _muon_optimizer); refuse the rest by name."""
    missing = []
    for chunk in chunks:
        wrapped = getattr(chunk, "model_parallel_groups", None)
        sizes = wrapped.sizes() if wrapped is not None else {}
        missing += [f"{dim} parallelism (size {n})" for dim, n in sizes.items()
                    if n > 1 and dim not in ("tensor", "pipeline", "expert", "expert tensor")]
    wrapped_tp = max((c.model_parallel_groups.sizes()["tensor"] for c in chunks
                      if getattr(c, "model_parallel_groups", None) is not None), default=1)
    if (config.muon_tp_mode != "blockwise" and wrapped_tp == 1 and tensor_parallel_group is not None
            and collectives.world_size(tensor_parallel_group) > 1):
        raise UnsupportedConfigError(
            f"muon_tp_mode={config.muon_tp_mode!r} orthogonalises each TP-split matrix across the tensor-parallel "
            f"group, which it takes from the model chunks, but they were wrapped without one (the "
            f"tensor_parallel_group keyword gives the TP rank only); wrap the model with megatron-core's "
            f"parallel_state or a pg_collection, or use muon_tp_mode='blockwise'.")
    if missing:
        raise UnsupportedConfigError(
            f"optimizer={config.optimizer!r} is implemented for data, tensor, pipeline and expert parallelism so "
            f"far; not yet with: {', '.join(sorted(set(missing)))} (issue #30).")


def _check_pg_collection(pg_collection: Any, chunks: Sequence[GradSource]) -> None:
    """A pg_collection's model-parallel sizes must be those the chunks were wrapped with (their
    gradient statistics already count each model-parallel copy once with those groups)."""
    if pg_collection is None:
        return
    for field, dimension in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        group = getattr(pg_collection, field, None)
        if isinstance(group, (list, tuple)):  # megatron-core allows one pipeline group per chunk
            group = group[0] if group else None
        given = collectives.world_size(group) if group is not None else 1
        for chunk in chunks:
            wrapped = getattr(chunk, "model_parallel_groups", None)
            size = wrapped.sizes()[dimension] if wrapped is not None else 1
            if given != size:
                raise InvalidConfigError(
                    f"get_megatron_optimizer: pg_collection.{field} has {given} rank(s) but the model chunks were "
                    f"wrapped with a {dimension}-parallel size of {size}; pass the pg_collection the model was "
                    f"wrapped with (or none).")


def _dump_param_groups(chunks: Sequence[GradSource], groups: list[dict], path: str) -> None:
    """megatron-core's dump_param_to_param_group_map: {param name: group index}, saved with DCP."""
    import torch.distributed.checkpoint as dcp

    names = {id(p): n for chunk in chunks for n, p in _named_trainable(chunk, wrapper_names=True)}
    mapping = {names[id(p)]: index for index, g in enumerate(groups) for p in g["params"]}
    dcp.save(mapping, checkpoint_id=path)
