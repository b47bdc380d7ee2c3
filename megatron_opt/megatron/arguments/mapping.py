"""From the validated flags to megatron_opt's objects, as Megatron-LM maps its arguments
(training.py: get_model, get_megatron_optimizer_config, get_optimizer_param_scheduler)."""
from __future__ import annotations

import argparse
import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

import torch

from ...config import DistributedDataParallelConfig, OptimizerConfig
from ...errors import UnsupportedConfigError
from ...scheduler import HasParamGroups, OptimizerParamScheduler
from .flags import rule_constant_flags

# The dtype flags' values (--main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype).
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})


def params_dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    """The model's dtype: --bf16, --fp16, or fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def loss_mode_from_args(args: argparse.Namespace) -> str:
    """train_step's ``loss_mode``: "per_token" with --calculate-per-token-loss, else "mean"."""
    return "per_token" if args.calculate_per_token_loss else "mean"


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """DistributedDataParallel's config; gradients are reduced in fp32 with --bf16 unless --grad-reduce-in-bf16."""
    grad_reduce_in_fp32 = args.accumulate_allreduce_grads_in_fp32 or (args.bf16 and not args.grad_reduce_in_bf16)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size, num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """get_megatron_optimizer's config."""
    if args.muon_scalar_optimizer != "adam":
        raise UnsupportedConfigError(f"--muon-scalar-optimizer {args.muon_scalar_optimizer}: megatron_opt's Muon "
                                     f"trains the params Muon does not take with AdamW only; use adam (the default)")
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        fp16=args.fp16, bf16=args.bf16, params_dtype=params_dtype_from_args(args),
        # Megatron-LM uses a loss scaler only with fp16/bf16: --loss-scale does nothing in fp32.
        loss_scale=args.loss_scale if (args.fp16 or args.bf16) else None,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, clip_grad=args.clip_grad,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_params_dtype=DTYPES[args.main_params_dtype], exp_avg_dtype=DTYPES[args.exp_avg_dtype],
        exp_avg_sq_dtype=DTYPES[args.exp_avg_sq_dtype], store_param_remainders=args.store_param_remainders,
        stochastic_rounding=args.stochastic_rounding,
        verify_interval=args.verify_interval, verify_action=args.verify_action,
        muon_coefficient_type=args.muon_coefficient_type,
        # Every update rule's declared constants, with the flags' values (Megatron-LM's defaults where they
        # differ from megatron-core's config defaults: --muon-momentum 0.9, --muon-tp-mode duplicated).
        **rule_constants_from_args(args),
    )


def rule_constants_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """OptimizerConfig's keywords for every rule constant's flag: megatron-core's fields by name, the rules'
    own constants in ``rule_constants``."""
    ours = {f.name for f in dataclasses.fields(OptimizerConfig)}
    values = {dest: getattr(args, dest) for _, dest, _, _ in rule_constant_flags()}
    own = {k: v for k, v in values.items() if k not in ours}
    return {**{k: v for k, v in values.items() if k in ours}, **({"rule_constants": own} if own else {})}


def scheduler_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """OptimizerParamScheduler's arguments after ``optimizer``, counted in samples as Megatron-LM's
    scheduler counts them: with --train-iters every length is iterations x global batch."""
    gbs = args.global_batch_size
    if args.train_samples is not None:  # sample-based: the flags are in samples already
        decay_steps = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_samples or 0)
    else:
        decay_steps = (args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_decay_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else (args.lr_warmup_iters or 0) * gbs)
    constant_wd = args.weight_decay_incr_style == "constant"
    return dict(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay if constant_wd else args.start_weight_decay,
        end_wd=args.weight_decay if constant_wd else args.end_weight_decay,
        wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        # Neither flag: take the checkpoint's schedule (Megatron-LM would refuse a changed one).
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def scheduler_from_args(optimizer: HasParamGroups, args: argparse.Namespace) -> OptimizerParamScheduler:
    """The LR and weight-decay schedule; step it by the global batch size (samples) per successful step."""
    return OptimizerParamScheduler(optimizer, **scheduler_kwargs_from_args(args))
