"""Megatron-LM's checks on its flags (validate_args), and the value ranges megatron_opt needs, with
messages that name the flags as the user typed them; the values the flags imply are filled in."""
from __future__ import annotations

import argparse
import importlib
import math
import re
from types import MappingProxyType
from typing import Any, Mapping

from ...optimizer.rules.muon import Muon
from ...optimizer.rules.registry import update_rule_from_config
from ...scheduler import OptimizerParamScheduler
from .flags import FLAG_ALIASES, TYPED_FLAGS, ConditionalDefault
from .mapping import ddp_config_from_args, optimizer_config_from_args, scheduler_kwargs_from_args


class MegatronArgumentError(ValueError):
    """A command line Megatron-LM would refuse, or one megatron_opt cannot run (parse_megatron_args
    turns it into the parser's usage error, exit code 2)."""


class FlagNames:
    """Names flags in messages: as typed; an untyped one in the command line's style (a caller's
    alias when the command line uses aliases, else Megatron-LM's name)."""

    def __init__(self, typed: Mapping[str, str], aliases: Mapping[str, str]) -> None:
        self.typed, self.aliases = typed, aliases
        self.alias_style = any(typed.get(dest) == alias for dest, alias in aliases.items())

    @classmethod
    def of(cls, args: argparse.Namespace) -> "FlagNames":
        return cls(getattr(args, TYPED_FLAGS, {}), getattr(args, FLAG_ALIASES, {}))

    def __call__(self, dest: str) -> str:
        if dest in self.typed:
            return self.typed[dest]
        if self.alias_style and dest in self.aliases:
            return self.aliases[dest]
        return "--" + dest.replace("_", "-")


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Megatron-LM's micro-batch count: global batch / (micro batch x data-parallel size), which must divide."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise MegatronArgumentError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size {micro_batch_size} x "
            f"data-parallel size {data_parallel_size} = {per_step}: every step runs global / (micro x data-parallel) "
            f"micro-batches on each rank; pick a global batch size that is a multiple of {per_step}")
    return global_batch_size // per_step


def validate_megatron_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Check the parsed flags as Megatron-LM's validate_args does, plus the ranges megatron_opt needs, and
    fill in what they imply (as validate_args does): ``world_size``, ``data_parallel_size`` (world / (TP x PP
    x CP)), ``virtual_pipeline_model_parallel_size``, ``global_batch_size``, ``num_microbatches``,
    ``train_iters`` (also for --train-samples), ``lr_warmup_iters``, ``loss_mode`` /
    ``calculate_per_token_loss``. Every config megatron_opt builds from them is built once here, so its own
    checks fail now too. Raises MegatronArgumentError.
    """
    name = FlagNames.of(args)
    args.world_size = world_size
    _resolve_conditional_defaults(args)
    _check_sizes(args, name)
    _resolve_model_parallel(args, name)
    _resolve_batch(args)
    sample_based = _check_run_length(args, name)
    _check_schedule(args, name, sample_based)
    _check_optimizer(args, name, sample_based)
    _resolve_loss_mode(args)
    _check_tensorboard(args)
    if sample_based:  # Megatron-LM's update_train_iters (constant batch size)
        args.train_iters = args.train_samples // args.global_batch_size
    _check_configs(args)


def _resolve_conditional_defaults(args: argparse.Namespace) -> None:
    sample_based = args.train_samples is not None
    excluded = {"train_iters": sample_based, "lr_warmup_iters": sample_based or args.lr_warmup_fraction is not None}
    for dest, ruled_out in excluded.items():
        value = getattr(args, dest)
        if isinstance(value, ConditionalDefault):  # in order: a callable lr_warmup_iters sees train_iters
            setattr(args, dest, None if ruled_out else value.resolve(args))


# Flags Megatron-LM has no default for.
REQUIRED = ("lr", "micro_batch_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads")


def _check_sizes(args: argparse.Namespace, name: FlagNames) -> None:
    def positive(*dests: str, optional: bool = False) -> None:
        for dest in dests:
            value = getattr(args, dest)
            if (value is not None or not optional) and (value is None or value <= 0):
                raise MegatronArgumentError(f"{name(dest)} must be a positive integer, got {value}")

    missing = [name(dest) for dest in REQUIRED if getattr(args, dest) is None]
    if missing:
        raise MegatronArgumentError(f"{' '.join(missing)}: required (Megatron-LM has no default)")
    positive("micro_batch_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads",
             "distributed_timeout_minutes", "log_interval", "tensorboard_log_interval")
    positive("train_iters", "train_samples", "num_microbatches", "global_batch_size", "save_interval",
             "exit_interval", "keep_latest_k", "ddp_bucket_size", "lr_decay_iters", "lr_decay_samples",
             "ffn_hidden_size", "max_position_embeddings", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
             optional=True)
    if args.lr_warmup_samples is not None and args.lr_warmup_samples < 0:
        raise MegatronArgumentError(f"{name('lr_warmup_samples')} must be >= 0, got {args.lr_warmup_samples}")
    if args.hidden_size % args.num_attention_heads:
        raise MegatronArgumentError(
            f"{name('hidden_size')} {args.hidden_size} is not divisible by {name('num_attention_heads')} "
            f"{args.num_attention_heads}: each head gets hidden/heads channels; pick {name('num_attention_heads')} "
            f"that divides {name('hidden_size')} (or a {name('hidden_size')} that is a multiple of "
            f"{name('num_attention_heads')})")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise MegatronArgumentError(f"--max-position-embeddings {args.max_position_embeddings} must be >= "
                                    f"{name('seq_length')} {args.seq_length}")


MODEL_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                        "expert_model_parallel_size")


def _resolve_model_parallel(args: argparse.Namespace, name: FlagNames) -> None:
    """Megatron-LM's model-parallel sizes: ``data_parallel_size`` = world / (TP x PP x CP), which must
    divide; ``virtual_pipeline_model_parallel_size`` from --num-layers-per-virtual-pipeline-stage;
    ``expert_tensor_parallel_size`` defaults to TP; --sequence-parallel is off at TP 1 (as Megatron-LM)."""
    for dest in MODEL_PARALLEL_SIZES:
        if getattr(args, dest) is None or getattr(args, dest) <= 0:
            raise MegatronArgumentError(f"{name(dest)} must be a positive integer, got {getattr(args, dest)}")
    tp, pp, cp, ep = (getattr(args, dest) for dest in MODEL_PARALLEL_SIZES)
    model_parallel = tp * pp * cp
    if args.world_size % model_parallel:
        raise MegatronArgumentError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {model_parallel}: the data-parallel "
            f"size is world / (TP x PP x CP); launch a multiple of {model_parallel} ranks (torchrun "
            f"--nproc_per_node) or lower the model-parallel sizes")
    args.data_parallel_size = args.world_size // model_parallel
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if etp <= 0:
        raise MegatronArgumentError(f"--expert-tensor-parallel-size must be a positive integer, got {etp}")
    if args.world_size % (etp * ep * pp):
        raise MegatronArgumentError(
            f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}: the expert "
            f"data-parallel size is world / (expert TP x EP x PP); lower --expert-model-parallel-size")
    if args.num_layers % pp:
        raise MegatronArgumentError(f"{name('num_layers')} {args.num_layers} is not divisible by "
                                    f"--pipeline-model-parallel-size {pp}: each pipeline stage gets layers / stages")
    args.virtual_pipeline_model_parallel_size = None
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        per_stage = args.num_layers // pp
        if pp == 1 or per_virtual <= 0 or per_stage % per_virtual or per_stage == per_virtual:
            raise MegatronArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} needs --pipeline-model-parallel-size > 1 and "
                f"must divide the {per_stage} layers of each pipeline stage into at least two virtual stages "
                f"({name('num_layers')} {args.num_layers} / --pipeline-model-parallel-size {pp})")
        args.virtual_pipeline_model_parallel_size = per_stage // per_virtual
    if tp == 1:
        args.sequence_parallel = False


def _resolve_batch(args: argparse.Namespace) -> None:
    """Megatron-LM's global batch (default micro x DP), or megatron_opt's --num-microbatches."""
    dp = args.data_parallel_size
    if args.num_microbatches is not None:
        implied = args.micro_batch_size * args.num_microbatches * dp
        if args.global_batch_size is not None and args.global_batch_size != implied:
            raise MegatronArgumentError(
                f"--global-batch-size {args.global_batch_size} contradicts --num-microbatches {args.num_microbatches} "
                f"(x --micro-batch-size {args.micro_batch_size} x data-parallel size {dp} = {implied}); give one "
                f"of them")
        args.global_batch_size = implied
    elif args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    args.num_microbatches = num_microbatches(args.global_batch_size, args.micro_batch_size, dp)


def _check_run_length(args: argparse.Namespace, name: FlagNames) -> bool:
    """Iterations or samples (Megatron-LM: exactly one), and the schedule in the same unit; True when
    the run is sample-based."""
    if args.train_iters is not None and args.train_samples is not None:
        raise MegatronArgumentError(f"{name('train_iters')} and --train-samples are exclusive: train for a number "
                                    f"of iterations or of samples")
    if args.train_iters is None and args.train_samples is None:
        raise MegatronArgumentError("give --train-iters or --train-samples: the length of the run")
    sample_based = args.train_samples is not None
    wrong = ({"train_iters": "--train-samples alone", "lr_decay_iters": "--lr-decay-samples",
              "lr_warmup_iters": "--lr-warmup-samples or --lr-warmup-fraction",
              "lr_wsd_decay_iters": "--lr-wsd-decay-samples"} if sample_based else
             {"lr_decay_samples": "--lr-decay-iters", "lr_warmup_samples": "--lr-warmup-iters or --lr-warmup-fraction",
              "lr_wsd_decay_samples": "--lr-wsd-decay-iters"})
    unit = "samples" if sample_based else "iterations"
    for dest, instead in wrong.items():
        if getattr(args, dest) is not None:
            length = "--train-samples" if sample_based else name("train_iters")
            raise MegatronArgumentError(
                f"{name(dest)} does not go with {length}: with {'sample' if sample_based else 'iteration'}-based "
                f"training ({length}) the schedule is given in {unit}; use {instead}")
    if args.lr_warmup_fraction is not None:
        other = "lr_warmup_samples" if sample_based else "lr_warmup_iters"
        if getattr(args, other) is not None:
            raise MegatronArgumentError(f"--lr-warmup-fraction and {name(other)} are exclusive: give one of them")
        if not (math.isfinite(args.lr_warmup_fraction) and 0 <= args.lr_warmup_fraction < 1):
            raise MegatronArgumentError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction:g}")
    if sample_based and args.train_samples < args.global_batch_size:
        raise MegatronArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                                    f"({args.global_batch_size} samples): nothing to train")
    if not sample_based:
        decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        decay_name = name("lr_decay_iters") if args.lr_decay_iters is not None else name("train_iters")
        if args.lr_warmup_iters is not None and not 0 <= args.lr_warmup_iters < decay:
            raise MegatronArgumentError(
                f"{name('lr_warmup_iters')} {args.lr_warmup_iters} must be >= 0 and less than the LR decay length "
                f"{decay_name} {decay} (the LR warms up over {name('lr_warmup_iters')} iterations, then decays until "
                f"{decay_name}); lower {name('lr_warmup_iters')} or raise {decay_name}")
    return sample_based


def _check_schedule(args: argparse.Namespace, name: FlagNames, sample_based: bool) -> None:
    if not (math.isfinite(args.lr) and math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        raise MegatronArgumentError(f"need 0 <= --min-lr <= --lr (both finite), got --lr {args.lr:g} and --min-lr "
                                    f"{args.min_lr:g}")
    if not (math.isfinite(args.lr_warmup_init) and 0 <= args.lr_warmup_init <= args.lr):
        raise MegatronArgumentError(f"need 0 <= --lr-warmup-init <= --lr, got {args.lr_warmup_init:g}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise MegatronArgumentError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay:g}")
    if args.weight_decay_incr_style == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if getattr(args, dest) is not None:
                raise MegatronArgumentError(
                    f"{name(dest)} needs --weight-decay-incr-style linear or cosine (with the default 'constant' "
                    f"the weight decay is --weight-decay throughout)")
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            raise MegatronArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                                        f"--start-weight-decay and --end-weight-decay")
        if not (math.isfinite(args.end_weight_decay) and 0 <= args.start_weight_decay <= args.end_weight_decay):
            raise MegatronArgumentError(f"need 0 <= --start-weight-decay <= --end-weight-decay, got "
                                        f"{args.start_weight_decay:g} and {args.end_weight_decay:g}")
    wsd_decay = args.lr_wsd_decay_samples if sample_based else args.lr_wsd_decay_iters
    if args.lr_decay_style == "WSD" and wsd_decay is None:
        raise MegatronArgumentError(f"--lr-decay-style WSD needs "
                                    f"{'--lr-wsd-decay-samples' if sample_based else '--lr-wsd-decay-iters'}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise MegatronArgumentError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
                                    "exclusive")


def _check_optimizer(args: argparse.Namespace, name: FlagNames, sample_based: bool) -> None:
    if args.optimizer in Muon.aliases:  # Megatron-LM main: dist_muon, muon + the sharded optimizer (deprecated)
        args.optimizer, args.use_distributed_optimizer = Muon.name, True
    if not (math.isfinite(args.min_loss_scale) and args.min_loss_scale > 0):
        raise MegatronArgumentError(f"--min-loss-scale must be a finite number > 0, got {args.min_loss_scale:g}")
    if not (math.isfinite(args.initial_loss_scale) and args.initial_loss_scale >= args.min_loss_scale):
        raise MegatronArgumentError(
            f"--initial-loss-scale must be a finite number >= --min-loss-scale {args.min_loss_scale:g}, got "
            f"{args.initial_loss_scale:g}; fp16 training usually starts at a power of two such as 65536")
    if args.loss_scale is not None and not (math.isfinite(args.loss_scale) and args.loss_scale > 0):
        raise MegatronArgumentError(f"--loss-scale must be a finite number > 0 (a constant loss scale), got "
                                    f"{args.loss_scale:g}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise MegatronArgumentError("--overlap-param-gather needs --use-distributed-optimizer (only the sharded "
                                    "optimizer all-gathers parameters), as in Megatron-LM")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise MegatronArgumentError("--grad-reduce-in-bf16 needs --bf16")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise MegatronArgumentError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive")


def _resolve_loss_mode(args: argparse.Namespace) -> None:
    """Megatron-LM's --calculate-per-token-loss, or megatron_opt's --loss-mode."""
    if args.loss_mode == "mean" and args.calculate_per_token_loss:
        raise MegatronArgumentError("--loss-mode mean contradicts --calculate-per-token-loss (which is --loss-mode "
                                    "per_token)")
    args.loss_mode = args.loss_mode or ("per_token" if args.calculate_per_token_loss else "mean")
    args.calculate_per_token_loss = args.loss_mode == "per_token"


def _check_tensorboard(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as exc:
            raise MegatronArgumentError(
                f"--tensorboard-dir needs the tensorboard package, which is not installed ({exc}); install it "
                f"with `pip install tensorboard`, or leave out --tensorboard-dir") from None


# megatron_opt's config fields whose flag is not the field's name with dashes.
CONFIG_FIELD_FLAGS: Mapping[str, str] = MappingProxyType({
    "bucket_size": "--ddp-bucket-size", "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "init_lr": "--lr-warmup-init", "max_lr": "--lr"})


def _check_configs(args: argparse.Namespace) -> None:
    """Everything megatron_opt checks itself (ranges of betas, eps, clip, hysteresis, the schedule),
    before any process group; its messages name config fields, which become flags here."""
    try:
        ddp_config_from_args(args)
        update_rule_from_config(optimizer_config_from_args(args))  # the rule's checks, as the factory runs them
        OptimizerParamScheduler(_NoParamGroups(), **scheduler_kwargs_from_args(args))
    except (ValueError, TypeError) as exc:
        raise MegatronArgumentError(_flag_names_in(str(exc))) from None


class _NoParamGroups:
    param_groups: tuple[Any, ...] = ()


def _flag_names_in(message: str) -> str:
    def flag(match: "re.Match[str]") -> str:
        field = match.group(2)
        return CONFIG_FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))
    message = re.sub(r"\b(OptimizerConfig|DistributedDataParallelConfig)\.(\w+)", flag, message)
    # Muon's rule names its constants without the config: muon_momentum=1.5 is --muon-momentum 1.5
    return re.sub(r"(?<![\w.-])(muon_\w+)=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message)
