"""Megatron-LM's DistributedDataParallelConfig and OptimizerConfig, with the same field names and defaults.

Fields that Megatron-LM has but megatron_opt does not implement are present (so Megatron launch code
that sets them keeps working when they hold their defaults) and raise a clear error when set to
anything else (UnsupportedConfigError): nothing is silently ignored. Numeric fields are range-checked
at construction as torch.optim checks its arguments (InvalidConfigError naming the field, the value
and the valid range): a NaN, negative or out-of-range value would otherwise train silently wrong.

What depends on the update rule is checked where the rule is built (optimizer/rules/registry.py's
``update_rule_from_config``: get_megatron_optimizer, DistributedOptimizer and the main job's flag checks
call it), against the rule's own declaration: the ``optimizer`` name, the rule's constants (``adam_beta1``,
``muon_*``, ...) and its other settings. This module imports nothing from optimizer/ (the layers point down).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


from .errors import ConfigError, InvalidConfigError, UnsupportedConfigError  # noqa: F401  (re-exported)
from .ops.precision import KERNEL_MOMENT_PAIRS, STATE_DTYPES, dtype_names


_INF = math.inf
VERIFY_ACTIONS = ("raise", "warn")  # OptimizerConfig.verify_action: what a failed verification does
# DistributedDataParallelConfig.data_parallel_sharding_strategy: read only by Megatron-FSDP (which is refused),
# so any of megatron-core's values is inert here; Megatron-LM main passes 'optim_grads_params' by default.
DATA_PARALLEL_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _fmt_bound(bound: Any) -> str:
    """A range end as a person writes it: 0 not 0.0, inf, or a label such as 'lr=0.001'."""
    if isinstance(bound, str):
        return bound
    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return str(bound)


def check_range(owner: str, name: str, value: Any, low: Any, high: Any, *, low_open: bool = False,
                 high_open: bool = True, high_label: Optional[str] = None, integer: bool = False,
                 hint: str = "") -> None:
    """Raise InvalidConfigError unless ``value`` is a real number in the interval (NaN never is).

    ``low``/``high`` are the numeric ends and ``*_open`` excludes them, so ``high=inf`` with
    ``high_open=True`` also rejects inf; ``high_label`` replaces ``high`` in the message when the
    bound is another field (``lr=0.001``). Strings are rejected even when float() would parse them.
    """
    interval = (f"{'(' if low_open else '['}{_fmt_bound(low)}, "
                f"{high_label or _fmt_bound(high)}{')' if high_open else ']'}")
    what = f"an integer in {interval}" if integer else f"in {interval}"
    number: Optional[float] = None
    if not isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
            pass
    if number is None:
        raise InvalidConfigError(f"{owner}.{name}={value!r} is not a number: it must be {what}.")
    ok = (low < number if low_open else low <= number) and (number < high if high_open else number <= high)
    if ok and integer:
        ok = not isinstance(value, bool) and number.is_integer()
    if not ok:
        raise InvalidConfigError(f"{owner}.{name}={value!r} is out of range: it must be {what}"
                                 f"{f' ({hint})' if hint else ''}.")


def _reject_unsupported(config: Any, unsupported: dict[str, Any], why: dict[str, str]) -> None:
    for name, default in unsupported.items():
        value = getattr(config, name)
        if value != default:
            raise UnsupportedConfigError(
                f"{type(config).__name__}.{name}={value!r} is not supported by megatron_opt "
                f"({why.get(name, 'not implemented')}); leave it at its default {default!r}."
            )


@dataclass
class DistributedDataParallelConfig:
    """Gradient-buffer and communication settings (megatron.core.distributed)."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    nccl_ub: bool = False
    delay_wgrad_compute: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False

    _UNSUPPORTED = {
        "check_for_large_grads": False,
        "fp8_param_gather": False,
        "reuse_grad_buf_for_mxfp8_param_ag": False,
        "use_megatron_fsdp": False,
        "use_custom_fsdp": False,
        "nccl_ub": False,
        "reduce_scatter_with_fp32_accumulation": False,
        "delay_wgrad_compute": False,
    }
    _WHY = {
        "fp8_param_gather": "fp8 params are not supported",
        "use_megatron_fsdp": "megatron_opt is ZeRO-1; use torch FSDP2 for parameter sharding",
        "use_custom_fsdp": "megatron_opt is ZeRO-1; use torch FSDP2 for parameter sharding",
        "nccl_ub": "NCCL user buffers are not used",
        "reduce_scatter_with_fp32_accumulation": "use grad_reduce_in_fp32=True instead",
        "delay_wgrad_compute": "Transformer Engine's delayed weight gradients are not hooked for reduction",
    }

    def __post_init__(self) -> None:
        # Invalid values first (InvalidConfigError), then valid-but-unsupported ones (UnsupportedConfigError).
        owner = type(self).__name__
        check_range(owner, "num_distributed_optimizer_instances", self.num_distributed_optimizer_instances,
                     1, _INF, integer=True)
        if self.bucket_size is not None:
            check_range(owner, "bucket_size", self.bucket_size, 0, _INF, low_open=True, integer=True,
                         hint="a bucket's element count; None lets megatron_opt choose")
        if self.data_parallel_sharding_strategy not in DATA_PARALLEL_SHARDING_STRATEGIES:
            raise InvalidConfigError(
                f"{owner}.data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r} is not one of "
                f"{', '.join(repr(s) for s in DATA_PARALLEL_SHARDING_STRATEGIES)}.")
        _reject_unsupported(self, self._UNSUPPORTED, self._WHY)
        if self.num_distributed_optimizer_instances > 1 and not self.use_distributed_optimizer:
            raise UnsupportedConfigError(
                f"{owner}.num_distributed_optimizer_instances={self.num_distributed_optimizer_instances!r} needs "
                f"use_distributed_optimizer=True (it shards the distributed optimizer within groups of "
                f"DP / num_distributed_optimizer_instances ranks; without a sharded optimizer there is nothing to "
                f"split). Set use_distributed_optimizer=True, or leave num_distributed_optimizer_instances at its "
                f"default 1."
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UnsupportedConfigError(
                "overlap_param_gather=True needs use_distributed_optimizer=True (only the sharded "
                "optimizer all-gathers params)."
            )


@dataclass
class OptimizerConfig:
    """Optimizer settings (megatron.core.optimizer.OptimizerConfig)."""

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    lion_beta1: float = 0.95  # the interpolation for the sign (megatron-core 0.19's default, as --lion-beta1)
    lion_beta2: float = 0.98  # the momentum decay (megatron-core 0.19's default, as --lion-beta2)
    # optimizer='muon': megatron-core 0.19's muon_* fields and defaults (docs/muon.md).
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_nesterov: bool = False  # megatron-core 0.16.1 calls it muon_use_nesterov (converted to this)
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"  # blockwise / duplicated / distributed: only meaningful at TP > 1
    muon_extra_scale_factor: float = 1.0
    # optimizer='adaptive_muon': Muon's muon_* fields and megatron-core's adaptive_muon_* (docs/muon.md).
    adaptive_muon_moment2_method: str = "adamuon"  # 'adamuon' (elementwise) or 'normuon' (per row, per matrix)
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-8
    # optimizer='soap': megatron-core's soap_* fields (SOAP's betas are adam_beta1 / adam_beta2; docs/muon.md).
    soap_shampoo_beta: float = 0.95
    soap_use_kl_shampoo: bool = True
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    # read only with optimizer_cpu_offload (refused): any value in [0, 1] is inert
    optimizer_offload_fraction: float = 0.0
    clip_grad: float = 1.0
    grad_norm_skip_threshold: Optional[float] = None
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None
    optimizer_cuda_graph: bool = False
    apply_wd_to_qk_layernorm: bool = False
    config_logger_dir: str = ""
    # megatron_opt only: round 16-bit moments stochastically (unbiased) instead of to nearest.
    stochastic_rounding: bool = False
    # megatron_opt only: verify mode (docs/usage.md, "Verify mode"). Every verify_interval-th call of
    # step() checks the replicas, the update and the param/master cast (0: off); on a failure
    # VerificationError is raised on every rank ("raise") or a WARNING logged ("warn").
    verify_interval: int = 0
    verify_action: str = "raise"
    # megatron_opt only: the constants of update rules megatron-core's OptimizerConfig has no field for, by the
    # name the rule declares (optimizer/rules/<rule>.py); {} gives each its declared default.
    rule_constants: dict[str, Any] = dataclasses.field(default_factory=dict)

    _UNSUPPORTED = {
        "main_grads_dtype": torch.float32,
        "decoupled_weight_decay": True,
        "optimizer_cpu_offload": False,
    }
    _WHY = {
        "main_grads_dtype": "gradients are reduced in the DDP config's dtype (grad_reduce_in_fp32)",
        "decoupled_weight_decay": "Adam runs as AdamW (decoupled weight decay) only",
        "optimizer_cpu_offload": "CPU offload of the optimizer is not implemented",
    }

    def __post_init__(self) -> None:
        # Invalid values first (InvalidConfigError), then valid-but-unsupported ones (UnsupportedConfigError).
        if self.lr is None:
            raise InvalidConfigError("OptimizerConfig.lr must be set (the peak learning rate).")
        if self.grad_norm_skip_threshold == _INF:
            self.grad_norm_skip_threshold = None  # Megatron's default 'inf' means off (-inf is invalid).
        self._check_ranges()
        if self.fp16 and self.bf16:
            raise InvalidConfigError("OptimizerConfig: fp16 and bf16 are mutually exclusive; set one.")
        _reject_unsupported(self, self._UNSUPPORTED, self._WHY)
        if self.overlap_param_gather_with_optimizer_step and not self.use_distributed_optimizer:
            raise InvalidConfigError(
                "OptimizerConfig.overlap_param_gather_with_optimizer_step=True overlaps the distributed optimizer's "
                "param all-gather with its own step; it needs use_distributed_optimizer=True (and the model wrapped "
                "with DistributedDataParallelConfig(overlap_param_gather=True)), as in Megatron-LM.")
        self._check_precision_aware()

    def _check_precision_aware(self) -> None:
        """Megatron-LM's precision-aware optimizer: 16-bit moments and masters, only when asked for."""
        owner = type(self).__name__
        for name, allowed in (("exp_avg_dtype", STATE_DTYPES), ("exp_avg_sq_dtype", STATE_DTYPES),
                              ("main_params_dtype", (torch.float32, torch.float16))):
            value = getattr(self, name)
            if value not in allowed:
                raise InvalidConfigError(f"{owner}.{name}={value} is not supported; use one of "
                                         f"{', '.join(str(d) for d in allowed)}.")
            if value != torch.float32 and not self.use_precision_aware_optimizer:
                raise InvalidConfigError(f"{owner}.{name}={value} needs use_precision_aware_optimizer=True (as in "
                                         f"Megatron-LM); set it, or leave {name} at torch.float32.")
        if self.stochastic_rounding and (not self.use_precision_aware_optimizer or torch.bfloat16 not in
                                         (self.exp_avg_dtype, self.exp_avg_sq_dtype)):
            raise InvalidConfigError(f"{owner}.stochastic_rounding=True rounds bf16 moments; it needs "
                                     f"use_precision_aware_optimizer=True with exp_avg_dtype or exp_avg_sq_dtype "
                                     f"torch.bfloat16.")
        pair = (self.exp_avg_dtype, self.exp_avg_sq_dtype)
        if self.optimizer_cuda_graph and pair not in KERNEL_MOMENT_PAIRS:
            raise UnsupportedConfigError(
                f"{owner}.optimizer_cuda_graph=True with (exp_avg_dtype, exp_avg_sq_dtype)=({dtype_names(pair)}): the "
                f"CUDA kernels take the pairs {dtype_names(KERNEL_MOMENT_PAIRS)} (others run a torch fallback that "
                f"cannot be captured in a graph); choose one of them or leave optimizer_cuda_graph off.")

    @property
    def uses_param_remainders(self) -> bool:
        """Masters of bf16 params kept as the bf16 param plus a 16-bit remainder (Megatron-LM's
        store_param_remainders): only with the precision-aware optimizer and fp32 main params."""
        return bool(self.use_precision_aware_optimizer and self.store_param_remainders
                    and self.main_params_dtype == torch.float32 and self.optimizer == "adam")  # Muon: fp32 masters

    def _check_ranges(self) -> None:
        """Reject values torch.optim would reject, and those that silently train wrong (like torch.optim,
        every bound excludes NaN; a finite bound also excludes inf)."""
        owner = type(self).__name__

        def check(name: str, low: Any, high: Any, **kw: Any) -> None:
            value = getattr(self, name)
            if value is not None:
                check_range(owner, name, value, low, high, **kw)

        check("lr", 0, _INF, hint="a negative lr trains in the wrong direction")
        check("min_lr", 0, self.lr, high_open=False, high_label=f"lr={self.lr!r}")
        check("decoupled_lr", 0, _INF)
        if self.decoupled_lr is not None:
            check("decoupled_min_lr", 0, self.decoupled_lr, high_open=False,
                  high_label=f"decoupled_lr={self.decoupled_lr!r}")
        else:
            check("decoupled_min_lr", 0, _INF)
        check("weight_decay", 0, _INF)
        check("clip_grad", 0, _INF, high_open=False, hint="0 turns gradient clipping off")
        check("grad_norm_skip_threshold", 0, _INF, hint="None or inf turns the check off")
        check("loss_scale", 0, _INF, low_open=True,
              hint="a constant loss scale; None selects dynamic scaling for fp16")
        check("initial_loss_scale", 0, _INF, low_open=True)
        check("min_loss_scale", 0, self.initial_loss_scale, low_open=True, high_open=False,
              high_label=f"initial_loss_scale={self.initial_loss_scale!r}")
        check("loss_scale_window", 1, _INF, hint="clean steps before the dynamic loss scale grows")
        check("hysteresis", 1, _INF, integer=True, hint="overflowing steps before the loss scale backs off")
        check("optimizer_offload_fraction", 0, 1, high_open=False)
        check("verify_interval", 0, _INF, integer=True, hint="0 turns verify mode off")
        if self.verify_action not in VERIFY_ACTIONS:
            raise InvalidConfigError(f"{owner}.verify_action={self.verify_action!r} is not one of "
                                     f"{', '.join(repr(a) for a in VERIFY_ACTIONS)}.")

    @property
    def model_dtype(self) -> torch.dtype:
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32


def config_fields(cls: type) -> list[str]:
    """Public field names of a config dataclass (the private class constants are not fields)."""
    return [f.name for f in dataclasses.fields(cls)]


__all__ = ["DistributedDataParallelConfig", "OptimizerConfig", "ConfigError", "InvalidConfigError",
           "UnsupportedConfigError", "config_fields"]
