"""Param groups with megatron-core's ``config_overrides`` semantics.

An override is a rule (does it match this param, by name and tensor?) and a dict of group fields.
Every rule matching a param is merged into one dict (two rules setting one field differently is an
error); params with equal merged dicts and the same expert-parallel flag share a group. Groups are
ordered as megatron-core orders them: the group without overrides first, then by the sorted
override items, dense before expert.

``config_overrides=None`` means megatron-core's standard overrides: no weight decay on biases and
1-D params (qk-layernorm params keep it with ``apply_wd_to_qk_layernorm``), and ``decoupled_lr`` /
``decoupled_min_lr`` as the max / min lr of params marked ``is_embedding_or_output_parameter``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ...config import OptimizerConfig
from ...errors import UnsupportedConfigError

ParamCond = Callable[[str, torch.nn.Parameter], bool]

# Group fields an override may set: OptimizerParamScheduler reads the first five, the rest are labels.
SUPPORTED_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd", "wd_mult", "lr_mult", "is_decoupled_lr")
# megatron-core lets these appear in an override only with the config's own value.
CONSISTENCY_KEYS = ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload")


def group_weight_decay(weight_decay: float, group: Mapping[str, Any]) -> float:
    """The weight decay a param group applies: the base value (the config's, or the scheduler's at
    this step) times the group's ``wd_mult`` (1 when absent), as megatron-core computes it."""
    return weight_decay * group.get("wd_mult", 1.0)


@dataclass(frozen=True)
class Override:
    matches: Callable[[torch.nn.Parameter, str], bool]
    fields: Mapping[str, Any]
    label: str


def _is_qk_layernorm(name: str) -> bool:
    return "q_layernorm." in name or "k_layernorm." in name


def standard_overrides(config: OptimizerConfig) -> list[Override]:
    """megatron-core's get_standard_config_overrides, as rules."""
    if config.apply_wd_to_qk_layernorm:
        no_wd = Override(lambda p, n: (p.ndim == 1 or n.endswith(".bias")) and not _is_qk_layernorm(n),
                         {"wd_mult": 0.0}, "biases and 1-D params except qk-layernorm")
    else:
        no_wd = Override(lambda p, n: p.ndim == 1 or n.endswith(".bias"), {"wd_mult": 0.0}, "biases and 1-D params")
    rules = [no_wd]
    if config.decoupled_lr is not None:
        fields = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            fields["min_lr"] = config.decoupled_min_lr
        rules.append(Override(lambda p, n: bool(getattr(p, "is_embedding_or_output_parameter", False)), fields,
                              "decoupled lr (is_embedding_or_output_parameter)"))
    return rules


def legacy_overrides(config: OptimizerConfig, no_weight_decay_cond: Optional[ParamCond],
                     scale_lr_cond: Optional[ParamCond], lr_mult: float) -> list[Override]:
    """megatron_opt's keywords, as rules: ``no_weight_decay_cond(name, param)`` replaces the standard
    weight-decay rule; ``scale_lr_cond`` gives its params ``lr_mult`` and max / min lr scaled by it."""
    rules = standard_overrides(config)
    if no_weight_decay_cond is not None:
        rules[0] = Override(lambda p, n: bool(no_weight_decay_cond(n, p)), {"wd_mult": 0.0}, "no_weight_decay_cond")
    if scale_lr_cond is not None and lr_mult != 1.0:
        min_lr = config.min_lr if config.min_lr is not None else 0.0
        rules.append(Override(lambda p, n: bool(scale_lr_cond(n, p)),
                              {"lr_mult": lr_mult, "max_lr": config.lr * lr_mult, "min_lr": min_lr * lr_mult},
                              "scale_lr_cond"))
    return rules


def megatron_core_overrides(config: OptimizerConfig,
                            config_overrides: Optional[Mapping[Any, Mapping]]) -> list[Override]:
    """megatron-core's ``config_overrides`` ({ParamKey: ParamGroupOverride}), checked and as rules."""
    if config_overrides is None:
        return standard_overrides(config)
    rules = []
    for key, fields in config_overrides.items():
        if not callable(getattr(key, "matches", None)):
            raise TypeError(f"config_overrides: key {key!r} has no matches(param, name); use megatron-core's "
                            f"ParamKey (megatron.core.optimizer.ParamKey).")
        fields = dict(fields)
        for name in list(fields):
            if name in CONSISTENCY_KEYS:
                if fields[name] != getattr(config, name):
                    raise ValueError(f"config_overrides: {name!r} should not be overridden in a config override "
                                     f"(got {fields[name]!r}, the config has {getattr(config, name)!r}).")
                del fields[name]
            elif name not in SUPPORTED_KEYS:
                raise UnsupportedConfigError(
                    f"config_overrides: the override field {name!r} (for {key!r}) is not supported by megatron_opt; "
                    f"an override may set {', '.join(SUPPORTED_KEYS)} (OptimizerParamScheduler reads max_lr, min_lr, "
                    f"start_wd, end_wd and wd_mult per group).")
        rules.append(Override(key.matches, fields, repr(key)))
    return rules


def _merge(matching: list[Override], name: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for rule in matching:
        for key, value in rule.fields.items():
            if key in merged and merged[key] != value:
                raise ValueError(f"param '{name}': conflicting overrides for {key!r}: {merged[key]!r} and {value!r} "
                                 f"(from {rule.label}); make the rules that match it agree.")
            merged[key] = value
    return merged


def build_param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], config: OptimizerConfig,
                       rules: Sequence[Override]) -> list[dict]:
    """torch-style groups (with Megatron-LM's fields) for ``named_params`` under ``rules``."""
    grouped: dict[tuple, list] = {}
    for name, param in named_params:
        merged = _merge([r for r in rules if r.matches(param, name)], name)
        key = (tuple(sorted(merged.items())) if merged else None, not getattr(param, "allreduce", True))
        grouped.setdefault(key, []).append(param)
    min_lr = config.min_lr if config.min_lr is not None else 0.0
    groups = []
    for overrides, is_expert in sorted(grouped, key=lambda k: (k[0] is not None, k[0] or (), k[1])):
        fields = dict(overrides or ())
        group = {"params": grouped[(overrides, is_expert)], "is_expert_parallel": is_expert,
                 # Megatron-LM logs the lr of the first group that keeps the default schedule.
                 "default_config": not any("lr" in k for k in fields),
                 "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
                 "max_lr": config.lr, "min_lr": min_lr, **fields}
        group["lr"] = group["max_lr"]
        group["weight_decay"] = group_weight_decay(config.weight_decay, group)
        groups.append(group)
    return groups


__all__ = ["Override", "standard_overrides", "legacy_overrides", "megatron_core_overrides", "build_param_groups",
           "group_weight_decay", "SUPPORTED_KEYS"]
