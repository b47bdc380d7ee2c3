"""The flags of the model-parallel runner (megatron-core's GPTModel): which runs take it, and what it
cannot run, refused with its reason before anything runs. megatron-core is not imported here (the
flags are parsed whether or not it is installed)."""
from __future__ import annotations

import argparse
import importlib.util
from typing import Optional

import torch

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)

SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
         "expert_model_parallel_size")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags of megatron-core's model that this path implements (the model-parallel sizes
    are megatron_opt.megatron.arguments' flags)."""
    g = parser.add_argument_group("megatron-core's GPTModel (model parallelism; megatron-core needed)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="train megatron-core's GPTModel (implied by any model-parallel size > 1 or --num-experts)")
    g.add_argument("--num-experts", type=int, default=None, help="a mixture of experts in every MLP")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default --ffn-hidden-size")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the run trains megatron-core's GPTModel through this path."""
    return args.use_mcore_models or args.num_experts is not None or any(getattr(args, s) > 1 for s in SIZES)


def check_args(args: argparse.Namespace) -> Optional[str]:
    """What this path cannot run, as one problem with its fix; None when it can (or is not taken)."""
    if not wanted(args):
        return None
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ("model parallelism (and --num-experts, --use-mcore-models) trains megatron-core's GPTModel, and "
                "megatron-core is not installed: `pip install megatron-core`, or use data parallelism only")
    tp, pp, cp, ep = (getattr(args, s) for s in SIZES)
    if cp > 1:
        return (f"--context-parallel-size {cp}: megatron-core's GPTModel needs Transformer Engine's attention for "
                f"context parallelism (its local attention refuses it), and this script builds the local layer spec; "
                f"use --context-parallel-size 1 (megatron_opt itself supports CP: docs/megatron.md)")
    if ep > 1 and args.num_experts is None:
        return f"--expert-model-parallel-size {ep} needs --num-experts (experts to split)"
    if args.num_experts is not None and (args.num_experts <= 0 or args.num_experts % ep):
        return (f"--num-experts {args.num_experts} must be a positive multiple of --expert-model-parallel-size {ep} "
                f"(each expert-parallel rank holds num-experts / EP experts)")
    if args.num_experts is not None and not 0 < args.moe_router_topk <= args.num_experts:
        return f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts {args.num_experts}]"
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.num_experts is not None and args.moe_token_dispatcher_type == "alltoall" and on_cpu:
        return ("--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's all-to-all dispatcher creates CUDA "
                "streams); on CPU use --moe-token-dispatcher-type allgather")
    if args.log_params_norm:
        return "--log-params-norm is not supported with megatron-core's GPTModel yet (model-parallel shards)"
    problem = check_checkpoint_args(args)
    if problem:
        return problem
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    for flag, value in (("--hidden-size", args.hidden_size), ("--num-attention-heads", args.num_attention_heads),
                        ("--ffn-hidden-size", ffn)):
        if value % tp:
            return f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}: each TP rank holds 1/TP"
    if args.sequence_parallel and args.seq_length % tp:
        return (f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size {tp}: "
                f"--sequence-parallel splits the sequence over the TP ranks")
    return None


def model_parallel(args: argparse.Namespace) -> bool:
    """A layout that splits the model over ranks (tensor, pipeline or expert parallelism)."""
    return any(getattr(args, s) > 1 for s in SIZES) or (args.expert_tensor_parallel_size or 1) > 1


def check_checkpoint_args(args: argparse.Namespace) -> Optional[str]:
    """--save/--load on this path (components/resume.py's rules apply as at data parallelism): what
    megatron_opt.checkpoint cannot do here, before anything runs. It names a model-parallel model's
    params by megatron-core's global keys (a checkpoint then loads at any TP / PP / DP layout) at tensor /
    pipeline / expert parallelism, with or without the optimizer; at TP1 x PP1 x EP1 by their local names."""
    if not model_parallel(args):
        return None
    if args.load_iteration is not None:
        if not mo.checkpoint.read_info(args.load).global_param_keys:
            return (f"--load {args.load}: iteration {args.load_iteration} names its params locally (saved at data "
                    f"parallelism: by this script's own GPT, or by megatron-core's GPTModel at TP1 x PP1 x EP1), so it "
                    f"cannot be placed in a tensor, pipeline or expert-parallel layout; load it at TP1 x PP1 x EP1 "
                    f"(--use-mcore-models), or resume from a checkpoint saved with model parallelism")
    return None


__all__ = ["add_args", "wanted", "check_args", "model_parallel", "SIZES"]
