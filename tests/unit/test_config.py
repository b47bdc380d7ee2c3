"""Configs: Megatron-LM field names and defaults, and loud rejection of what megatron_opt does not implement
(our defaults against megatron-core's: tests/mcore/test_megatron_core_configs.py)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_opt.config import (
    DistributedDataParallelConfig,
    OptimizerConfig,
    ConfigError,
    InvalidConfigError,
    UnsupportedConfigError,
    config_fields,
)
from megatron_opt.ops.precision import KERNEL_MOMENT_PAIRS, STATE_DTYPES
from megatron_opt.optimizer.rules.registry import update_rule_from_config
from tests.support.megatron_config_spec import DDP_FIELDS_SET_BY_NAME, OPTIMIZER_FIELDS_SET_BY_NAME, field_default

LR = 1e-3

# (field, a non-default value). The field list is the spec: megatron_opt does not implement these.
DDP_UNSUPPORTED = [
    ("num_distributed_optimizer_instances", 2),
    ("check_for_large_grads", True),
    ("fp8_param_gather", True),
    ("reuse_grad_buf_for_mxfp8_param_ag", True),
    ("use_megatron_fsdp", True),
    ("use_custom_fsdp", True),
    ("nccl_ub", True),
    ("reduce_scatter_with_fp32_accumulation", True),
    ("delay_wgrad_compute", True),
]
OPT_UNSUPPORTED = [
    ("main_grads_dtype", torch.bfloat16),
    ("decoupled_weight_decay", False),
    ("optimizer_cpu_offload", True),
]


def test_megatron_field_names_present():
    # Megatron launch code sets these by name; they must exist with Megatron's spelling (and in
    # megatron-core's configs: tests/mcore/test_megatron_core_configs.py).
    ddp = set(config_fields(DistributedDataParallelConfig))
    opt = set(config_fields(OptimizerConfig))
    for name in DDP_FIELDS_SET_BY_NAME:
        assert name in ddp
    for name in OPTIMIZER_FIELDS_SET_BY_NAME:
        assert name in opt
    # private class constants are not dataclass fields
    assert not any(n.startswith("_") for n in ddp | opt)


def test_specific_defaults():
    c = OptimizerConfig(lr=LR)
    assert c.optimizer == "adam"
    assert c.initial_loss_scale == 2**32
    assert c.min_loss_scale == 1.0
    assert c.loss_scale_window == 1000
    assert c.hysteresis == 2
    assert c.clip_grad == 1.0
    assert c.weight_decay == 0.01
    assert (c.adam_beta1, c.adam_beta2, c.adam_eps) == (0.9, 0.999, 1e-8)
    assert c.grad_norm_skip_threshold is None
    d = DistributedDataParallelConfig()
    assert d.bucket_size is None
    assert not d.use_distributed_optimizer and not d.overlap_grad_reduce


# --------------------------------------------------------------------------------------------------
# Unsupported fields
# --------------------------------------------------------------------------------------------------


def _check_message(err: UnsupportedConfigError, name: str, default) -> None:
    msg = str(err)
    assert name in msg
    assert "default" in msg
    assert repr(default) in msg


@pytest.mark.parametrize("name, value", DDP_UNSUPPORTED)
def test_ddp_unsupported_field_raises(name, value):
    default = field_default({f.name: f for f in dataclasses.fields(DistributedDataParallelConfig)}[name])
    assert value != default
    with pytest.raises(UnsupportedConfigError) as ei:
        DistributedDataParallelConfig(**{name: value})
    _check_message(ei.value, name, default)
    # the default itself is accepted when set explicitly
    DistributedDataParallelConfig(**{name: default})


@pytest.mark.parametrize("name, value", OPT_UNSUPPORTED)
def test_optimizer_unsupported_field_raises(name, value):
    default = field_default({f.name: f for f in dataclasses.fields(OptimizerConfig)}[name])
    assert value != default
    with pytest.raises(UnsupportedConfigError) as ei:
        OptimizerConfig(lr=LR, **{name: value})
    _check_message(ei.value, name, default)
    OptimizerConfig(lr=LR, **{name: default})


def test_unsupported_error_is_value_error():
    assert issubclass(UnsupportedConfigError, ValueError)


def test_config_errors_separate_invalid_from_unsupported():
    assert issubclass(UnsupportedConfigError, ConfigError) and issubclass(InvalidConfigError, ConfigError)
    assert not issubclass(InvalidConfigError, UnsupportedConfigError)
    assert not issubclass(UnsupportedConfigError, InvalidConfigError)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(grad_reduce_in_fp32=True),
        dict(overlap_grad_reduce=True),
        dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True),
        dict(check_for_nan_in_grad=True),
        dict(bucket_size=40_000_000),
        dict(average_in_collective=True),
        dict(pad_buckets_for_high_nccl_busbw=True),
        dict(align_param_gather=True),
    ],
)
def test_ddp_supported_values_accepted(kwargs):
    c = DistributedDataParallelConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(optimizer="sgd"),
        dict(fp16=True),
        dict(bf16=True),
        dict(loss_scale=1024.0),
        dict(use_distributed_optimizer=True),
        dict(grad_norm_skip_threshold=10.0),
        dict(weight_decay=0.1, clip_grad=0.0),
        dict(store_param_remainders=False),
    ],
)
def test_optimizer_supported_values_accepted(kwargs):
    c = OptimizerConfig(lr=LR, **kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


# --------------------------------------------------------------------------------------------------
# Other validation
# --------------------------------------------------------------------------------------------------


def test_unknown_keyword_raises_type_error():
    with pytest.raises(TypeError):
        OptimizerConfig(lr=LR, not_a_field=1)
    with pytest.raises(TypeError):
        DistributedDataParallelConfig(not_a_field=1)
    # private class constants are not constructor keywords
    with pytest.raises(TypeError):
        OptimizerConfig(lr=LR, _UNSUPPORTED={})


def test_lr_none_raises():
    with pytest.raises(InvalidConfigError, match="lr"):
        OptimizerConfig()
    with pytest.raises(InvalidConfigError, match="lr"):
        OptimizerConfig(lr=None)


def test_fp16_and_bf16_raises():
    with pytest.raises(InvalidConfigError, match="fp16"):
        OptimizerConfig(lr=LR, fp16=True, bf16=True)


@pytest.mark.parametrize("name", ["scion", "Adam", "lamb", ""])
def test_unsupported_optimizer_raises(name):
    """Where the rule is built (the config knows no rule: issue 38)."""
    config = OptimizerConfig(lr=LR, optimizer=name)
    with pytest.raises(UnsupportedConfigError) as ei:
        update_rule_from_config(config)
    assert "optimizer" in str(ei.value)
    assert repr(name) in str(ei.value)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_nonpositive_loss_scale_raises(value):
    with pytest.raises(InvalidConfigError, match="loss_scale"):
        OptimizerConfig(lr=LR, loss_scale=value)


def test_grad_norm_skip_threshold_inf_means_off():
    assert OptimizerConfig(lr=LR, grad_norm_skip_threshold=math.inf).grad_norm_skip_threshold is None
    assert OptimizerConfig(lr=LR, grad_norm_skip_threshold=None).grad_norm_skip_threshold is None
    assert OptimizerConfig(lr=LR, grad_norm_skip_threshold=5.0).grad_norm_skip_threshold == 5.0


def test_overlap_param_gather_needs_distributed_optimizer():
    with pytest.raises(UnsupportedConfigError, match="use_distributed_optimizer"):
        DistributedDataParallelConfig(overlap_param_gather=True)


@pytest.mark.parametrize("value", [0, -1])
def test_nonpositive_bucket_size_raises(value):
    with pytest.raises(InvalidConfigError, match="bucket_size"):
        DistributedDataParallelConfig(bucket_size=value)


def test_model_dtype():
    assert OptimizerConfig(lr=LR).model_dtype == torch.float32
    assert OptimizerConfig(lr=LR, fp16=True).model_dtype == torch.float16
    assert OptimizerConfig(lr=LR, bf16=True).model_dtype == torch.bfloat16


@pytest.mark.parametrize("exp_avg", STATE_DTYPES)
@pytest.mark.parametrize("exp_avg_sq", STATE_DTYPES)
def test_optimizer_cuda_graph_takes_exactly_the_kernel_moment_pairs(exp_avg, exp_avg_sq):
    """The config reads the one table of compiled pairs (csrc/pass2.cuh is checked against it in
    test_kernel_instantiations.py); other pairs run a fallback that cannot be captured."""
    kwargs = dict(lr=LR, use_precision_aware_optimizer=True, exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq,
                  optimizer_cuda_graph=True)
    if (exp_avg, exp_avg_sq) in KERNEL_MOMENT_PAIRS:
        OptimizerConfig(**kwargs)
    else:
        with pytest.raises(UnsupportedConfigError, match=r"optimizer_cuda_graph=True with \(exp_avg_dtype"):
            OptimizerConfig(**kwargs)


# Megatron-LM passes these by default (--optimizer-offload-fraction 1.0; main's
# --data-parallel-sharding-strategy optim_grads_params); each is read only by a feature megatron_opt
# refuses (CPU offload, Megatron-FSDP), so its value changes nothing and is accepted.
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_offload_fraction_without_offload_is_accepted(fraction):
    assert OptimizerConfig(lr=1e-3, optimizer_offload_fraction=fraction).optimizer_offload_fraction == fraction


def test_offload_fraction_out_of_range_is_invalid():
    with pytest.raises(InvalidConfigError, match="optimizer_offload_fraction=1.5"):
        OptimizerConfig(lr=1e-3, optimizer_offload_fraction=1.5)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_sharding_strategy_without_megatron_fsdp_is_accepted(strategy):
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    assert config.data_parallel_sharding_strategy == strategy


def test_unknown_sharding_strategy_is_invalid():
    with pytest.raises(InvalidConfigError, match="data_parallel_sharding_strategy='zero3'"):
        DistributedDataParallelConfig(data_parallel_sharding_strategy="zero3")


def test_megatron_fsdp_is_still_refused_whatever_the_strategy():
    with pytest.raises(UnsupportedConfigError, match="use_megatron_fsdp"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
