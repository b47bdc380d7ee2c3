"""megatron-core's config objects, converted field by field into megatron_opt's (config.py).

Both constructors (DistributedDataParallel, DistributedOptimizer) accept either kind, so this lives
beside config.py, below distributed/ and optimizer/; megatron_opt.megatron is only the adapter.
megatron-core is never imported here: a config is recognised by its fields (a dataclass that is not
ours), so the conversion works whichever megatron-core version made it. Every field is either
copied into the field of the same name, or checked against its megatron-core default: a value we
do not implement raises UnsupportedConfigError naming the field, so nothing is silently ignored.
Which fields megatron_opt lacks are let through at any value (inert) and which only at their default
is decided in one table, core_config_fields.py, each with its reason.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from . import core_config_fields
from .config import DistributedDataParallelConfig, OptimizerConfig
from .errors import UnsupportedConfigError

# TransformerConfig fields the data-parallel wrapper and the optimizer depend on, with the only value
# megatron_opt runs (fp8 params are not implemented). Model-parallel sizes are accepted;
# DistributedDataParallel checks them against its groups.
_TRANSFORMER_REQUIRED: dict[str, Any] = {
    "fp8_param": False,
}


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors: compare by identity
        return a is b


def _convert(obj: Any, ours: type, what: str, kind: str) -> Any:
    if isinstance(obj, ours):
        return obj
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"{what} must be megatron_opt.{ours.__name__} or megatron-core's {ours.__name__}, "
                        f"got {type(obj).__name__}.")
    our_fields = {f.name for f in dataclasses.fields(ours)}
    values: dict[str, Any] = {}
    sharded_by: Optional[str] = None  # a ShardsOptimizer field set to True
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in our_fields:
            values[field.name] = value  # (over an older name's value)
            continue
        rule = core_config_fields.treatment(kind, field.name)
        if isinstance(rule, core_config_fields.Renamed):
            values.setdefault(rule.ours, value)  # the current name, when the config has both, wins below
            continue
        if isinstance(rule, core_config_fields.Inert):
            continue
        if isinstance(rule, core_config_fields.ShardsOptimizer) and value in (True, False):
            if value and getattr(obj, "optimizer", None) not in rule.optimizers:
                raise UnsupportedConfigError(
                    f"{type(obj).__module__}.{type(obj).__name__}.{field.name}=True with optimizer="
                    f"{getattr(obj, 'optimizer', None)!r} is not supported by megatron_opt ({rule.reason}).")
            sharded_by = field.name if value else sharded_by
            continue
        default = _default_of(field)
        if default is dataclasses.MISSING or not _same(value, default):
            why = rule.reason if rule is not None else "megatron_opt has no such setting"
            raise UnsupportedConfigError(
                f"{type(obj).__module__}.{type(obj).__name__}.{field.name}={value!r} is not supported by "
                f"megatron_opt ({why}); leave it at megatron-core's default {default!r}.")
    if sharded_by is not None:  # megatron-core's own sharding switch: ours is use_distributed_optimizer
        values["use_distributed_optimizer"] = True
    return ours(**values)  # our __post_init__ checks ranges and rejects unsupported values of shared fields


def as_ddp_config(config: Any) -> DistributedDataParallelConfig:
    """Ours unchanged; megatron-core's DistributedDataParallelConfig converted field by field (a copy:
    megatron-core's DDP rewrites ``bucket_size`` in place, ours never touches the caller's object)."""
    return _convert(config, DistributedDataParallelConfig, "ddp_config", "ddp")


def as_optimizer_config(config: Any) -> OptimizerConfig:
    """Ours unchanged; megatron-core's OptimizerConfig (or AdamOptimizerConfig / SGDOptimizerConfig)
    converted field by field. megatron-core's optimizer='lion' (0.19, Megatron-LM main: its emerging-optimizer path)
    is emerging-optimizers' Lion on the 2-D weights that are not embedding or output, with betas (adam_beta1,
    adam_beta2) (it reads lion_beta1 / lion_beta2 only for muon_scalar_optimizer='lion'), and AdamW on the rest:
    ours with those betas and ``lion_scope='matrices'`` (tests/mcore/test_megatron_core_lion.py)."""
    ours = _convert(config, OptimizerConfig, "config", "optimizer")
    if not isinstance(config, OptimizerConfig) and ours.optimizer == "lion":
        ours = dataclasses.replace(ours, lion_beta1=ours.adam_beta1, lion_beta2=ours.adam_beta2,
                                   rule_constants={**ours.rule_constants, "lion_scope": "matrices"})
    return ours


def is_ours(config: Any) -> bool:
    return isinstance(config, (DistributedDataParallelConfig, OptimizerConfig))


def check_transformer_config(config: Any) -> None:
    """Reject a TransformerConfig asking for fp8 params (not implemented)."""
    for name, required in _TRANSFORMER_REQUIRED.items():
        value = getattr(config, name, required)
        if not _same(value, required):
            raise UnsupportedConfigError(
                f"TransformerConfig.{name}={value!r} is not supported by megatron_opt's DistributedDataParallel "
                f"(fp8 params are not implemented); set it to {required!r}.")


def starts_gradient_scale_at_one(config: Optional[Any], ddp_config: DistributedDataParallelConfig) -> bool:
    """megatron-core's rule for the gradient scaling factor a step starts with.

    Per-token loss: 1.0, because finalize_model_grads later divides by the global token count.
    Otherwise 1/DP (with average_in_collective the collective divides; the product is the same).
    """
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    if per_token and ddp_config.average_in_collective:
        raise UnsupportedConfigError(
            "TransformerConfig.calculate_per_token_loss=True with DistributedDataParallelConfig."
            "average_in_collective=True: the gradients are divided by the global token count, so they must "
            "not also be averaged over ranks (megatron-core refuses this too); set average_in_collective=False.")
    return per_token


__all__ = ["as_ddp_config", "as_optimizer_config", "check_transformer_config", "starts_gradient_scale_at_one",
           "is_ours"]
