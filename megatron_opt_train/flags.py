"""The main job's command line: Megatron-LM's flags (megatron_opt.megatron.arguments) with the demo's
defaults, the flags of the components and runners, and the main job's own; every problem exits with
code 2 before any process group exists. The help text is the package's docstring."""
from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence

from megatron_opt.megatron import arguments as megatron_args

import megatron_opt_train

from .components import data, evaluation, metrics, resume
from .runners import megatron_core_args


class DemoWarmupIters:
    """The demo's --lr-warmup-iters: a sixth of --train-iters (5 at the default 30), so a short run
    (--train-iters 5) works without a warmup flag."""

    def __call__(self, args: argparse.Namespace) -> Optional[int]:
        return None if args.train_iters is None else args.train_iters // 6

    def __repr__(self) -> str:
        return "train-iters // 6"


DEMO_DEFAULTS = {"lr": 3e-3, "train_iters": 30, "micro_batch_size": 4, "seq_length": 64, "hidden_size": 128,
                 "num_layers": 2, "num_attention_heads": 4, "lr_warmup_iters": DemoWarmupIters(),
                 "log_interval": 1}
DEMO_EVAL_ITERS = 10  # Megatron-LM: 100 (a validation after training stays short in the demo)
LEGACY_ALIASES = {"train_iters": "--steps", "seq_length": "--seq-len", "hidden_size": "--hidden",
                  "num_layers": "--layers", "num_attention_heads": "--heads", "lr_warmup_iters": "--warmup-steps",
                  "ddp_bucket_size": "--bucket-size"}
NOOP_VALUES = {"--attention-dropout": "0", "--hidden-dropout": "0",  # the model has no dropout
               "--attention-backend": "auto"}  # torch's scaled_dot_product_attention picks its kernel
UNSUPPORTED_REASONS = {  # megatron_opt.megatron.arguments.UNSUPPORTED_FLAGS' features, as this script lacks them
    "data": "this data or tokenizer option is not implemented (supported: --data-path --split --mock-data "
            "--data-cache-path --no-mmap-bin-files --eod-mask-loss --num-dataset-builder-threads --num-workers "
            "--tokenizer-type GPT2BPETokenizer|HuggingFaceTokenizer|NullTokenizer --vocab-file --merge-file "
            "--tokenizer-model --vocab-size --make-vocab-size-divisible-by)",
    "model": "the model is this script's own GPT (learned positions, LayerNorm, GELU MLP, multi-head attention, "
             "no dropout)",
    "evaluation": "this evaluation option is not implemented (supported: --eval-interval --eval-iters --skip-train)",
    "logging": "this logging option is not implemented (supported: --log-interval, --log-throughput, "
               "--log-num-zeros-in-grad, --log-params-norm, --log-memory-to-tensorboard, "
               "--log-world-size-to-tensorboard, --log-validation-ppl-to-tensorboard, --log-timers-to-tensorboard, "
               "--timing-log-level, --timing-log-option, --no-log-loss-scale-to-tensorboard, --log-json, "
               "--tensorboard-dir, --tensorboard-log-interval)",
    "overlap_param_gather_with_optimizer_step":
        "it overlaps the first model chunk's all-gather with the other chunks' update, and this script builds one "
        "model chunk (Megatron-LM also requires virtual pipeline chunks); megatron_opt's API supports it "
        "(OptimizerConfig.overlap_param_gather_with_optimizer_step, docs/usage.md)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", description=megatron_opt_train.__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    megatron_args.add_megatron_args(parser, defaults=DEMO_DEFAULTS, aliases=LEGACY_ALIASES)
    data.add_data_args(parser)
    evaluation.add_eval_args(parser, DEMO_EVAL_ITERS)
    metrics.add_logging_args(parser)
    resume.add_checkpoint_args(parser)
    megatron_core_args.add_args(parser)
    own = parser.add_argument_group("this script's own")
    own.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="auto: one GPU per local rank when there are enough GPUs (NCCL), else CPU (gloo)")
    own.add_argument("--log-json", default=None, metavar="FILE",
                     help="append one JSON line per iteration (rank 0): the exact values")
    own.add_argument("--watchdog-multiple", type=float, default=20.0,
                     help="exit (code 3) when a step runs longer than this many median step times and "
                          "--watchdog-min-seconds; 0 disables the watchdog (default 20)")
    own.add_argument("--watchdog-min-seconds", type=float, default=60.0,
                     help="never fire before a step has run this long (default 60)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Every error exits with code 2 before any process group exists (WORLD_SIZE: torchrun's)."""
    parser = build_parser()
    args = megatron_args.parse_megatron_args(argv, parser=parser, unsupported_reasons=UNSUPPORTED_REASONS,
                                             noop_values=NOOP_VALUES)
    if not (math.isfinite(args.watchdog_multiple) and args.watchdog_multiple >= 0):
        parser.error(f"--watchdog-multiple must be a finite number >= 0 (0 disables the watchdog), "
                     f"got {args.watchdog_multiple:g}")
    if not (math.isfinite(args.watchdog_min_seconds) and args.watchdog_min_seconds > 0):
        parser.error(f"--watchdog-min-seconds must be a positive number of seconds, got {args.watchdog_min_seconds:g}")
    for check in (data.check_data_args, evaluation.check_eval_args, resume.find_load, resume.check_save,
                  megatron_core_args.check_args):
        problem = check(args)
        if problem:
            parser.error(problem)
    if args.skip_train and args.load_iteration is None:
        parser.error("--skip-train evaluates a loaded model: give --load with a checkpoint")
    return args


__all__ = ["build_parser", "parse_args", "DEMO_DEFAULTS", "DEMO_EVAL_ITERS", "LEGACY_ALIASES", "NOOP_VALUES",
           "UNSUPPORTED_REASONS", "DemoWarmupIters"]
