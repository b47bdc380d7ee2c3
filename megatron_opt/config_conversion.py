"""megatron-core's config objects, converted field by field into megatron_opt's (config.py).

Both constructors (DistributedDataParallel, DistributedOptimizer) accept either kind, so this lives
beside config.py, below distributed/ and optimizer/; megatron_opt.megatron is only the adapter.
megatron-core is never imported here: a config is recognised by its fields (a dataclass that is not
ours), so the conversion works whichever megatron-core version made it. Every field is either
copied into the field of the same name, or checked against its megatron-core default: a value we
do not implement raises UnsupportedConfigError naming the field, so nothing is silently ignored.
The only fields let through at any value are those listed in ``_INERT``, each with the reason it
cannot change what megatron_opt computes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from .config import DistributedDataParallelConfig, OptimizerConfig
from .errors import UnsupportedConfigError

# Fields megatron_opt lacks whose value cannot matter: each is read only by a feature that is
# itself rejected (so it can never be on here), or is a kernel-fusion detail with no numerical effect.
_INERT: dict[str, str] = {
    # DistributedDataParallelConfig
    "gradient_reduce_div_fusion": "a kernel fusion of the pre-reduction division; same result",
    "suggested_communication_unit_size": "Megatron FSDP only (use_megatron_fsdp is rejected)",
    "preserve_fp32_weights": "Megatron FSDP only (use_megatron_fsdp is rejected)",
    "keep_fp8_transpose_cache": "fp8 params only (fp8_param_gather is rejected)",
    "fsdp_double_buffer": "Megatron FSDP only (use_megatron_fsdp is rejected)",
    "outer_dp_sharding_strategy": "Megatron FSDP only (use_megatron_fsdp is rejected)",
    "disable_symmetric_registration": "NCCL symmetric-memory registration; no numerical effect",
    "fsdp_manual_registration": "Megatron FSDP only (use_megatron_fsdp is rejected)",
    # OptimizerConfig
    "fp8_recipe": "fp8 params only, which megatron_opt rejects",
    "muon_momentum": "optimizer='muon' only, which megatron_opt rejects",
    "muon_split_qkv": "optimizer='muon' only, which megatron_opt rejects",
    "muon_use_nesterov": "optimizer='muon' only, which megatron_opt rejects",
    "muon_scale_mode": "optimizer='muon' only, which megatron_opt rejects",
    "muon_fp32_matmul_prec": "optimizer='muon' only, which megatron_opt rejects",
    "muon_num_ns_steps": "optimizer='muon' only, which megatron_opt rejects",
    "muon_tp_mode": "optimizer='muon' only, which megatron_opt rejects",
    "muon_extra_scale_factor": "optimizer='muon' only, which megatron_opt rejects",
    "use_torch_optimizer_for_cpu_offload": "optimizer_cpu_offload only, which megatron_opt rejects",
    "overlap_cpu_optimizer_d2h_h2d": "optimizer_cpu_offload only, which megatron_opt rejects",
    "pin_cpu_grads": "optimizer_cpu_offload only, which megatron_opt rejects",
    "pin_cpu_params": "optimizer_cpu_offload only, which megatron_opt rejects",
}

# TransformerConfig fields the data-parallel wrapper and the optimizer depend on, with the only
# value megatron_opt runs (model parallelism is not implemented: the norm and the buffers would
# be wrong, not merely slow).
# Model-parallel sizes are accepted; DistributedDataParallel checks them against its groups.
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


def _convert(obj: Any, ours: type, what: str) -> Any:
    if isinstance(obj, ours):
        return obj
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"{what} must be megatron_opt.{ours.__name__} or megatron-core's {ours.__name__}, "
                        f"got {type(obj).__name__}.")
    our_fields = {f.name for f in dataclasses.fields(ours)}
    values: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in our_fields:
            values[field.name] = value
            continue
        if field.name in _INERT:
            continue
        default = _default_of(field)
        if default is dataclasses.MISSING or not _same(value, default):
            raise UnsupportedConfigError(
                f"{type(obj).__module__}.{type(obj).__name__}.{field.name}={value!r} is not supported by "
                f"megatron_opt (it has no such setting); leave it at megatron-core's default {default!r}.")
    return ours(**values)  # our __post_init__ checks ranges and rejects unsupported values of shared fields


def as_ddp_config(config: Any) -> DistributedDataParallelConfig:
    """Ours unchanged; megatron-core's DistributedDataParallelConfig converted field by field (a copy:
    megatron-core's DDP rewrites ``bucket_size`` in place, ours never touches the caller's object)."""
    return _convert(config, DistributedDataParallelConfig, "ddp_config")


def as_optimizer_config(config: Any) -> OptimizerConfig:
    """Ours unchanged; megatron-core's OptimizerConfig (or AdamOptimizerConfig / SGDOptimizerConfig)
    converted field by field."""
    return _convert(config, OptimizerConfig, "config")


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
