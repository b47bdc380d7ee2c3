"""What the config tests share between tests/unit (ours alone) and tests/mcore (against megatron-core):
the config fields Megatron-LM's launch code sets by name, and a dataclass field's default."""
from __future__ import annotations

import dataclasses
from typing import Any

# Megatron-LM sets these by name: they must exist with Megatron's spelling.
DDP_FIELDS_SET_BY_NAME = (
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "use_distributed_optimizer",
    "bucket_size",
    "average_in_collective",
    "check_for_nan_in_grad",
    "pad_buckets_for_high_nccl_busbw",
)
OPTIMIZER_FIELDS_SET_BY_NAME = (
    "lr",
    "min_lr",
    "weight_decay",
    "fp16",
    "bf16",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
    "use_distributed_optimizer",
)


def field_default(f: dataclasses.Field) -> Any:
    """The field's declared default (its factory called), or dataclasses.MISSING."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


__all__ = ["DDP_FIELDS_SET_BY_NAME", "OPTIMIZER_FIELDS_SET_BY_NAME", "field_default"]
