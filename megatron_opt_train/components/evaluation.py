"""The main job's evaluation, as Megatron-LM's: --eval-iters global batches of the validation split
every --eval-interval iterations and after training (and of the test split after training), forward
only, logged as Megatron-LM's evaluate_and_print_results logs it:

    ---------------------------------------------------------------------------------------------
     validation loss at iteration 20 | lm loss value: 4.123456E+00 | lm loss PPL: 6.178560E+01 |
    ---------------------------------------------------------------------------------------------

The validation position is counted in samples, as Megatron-LM's consumed_valid_samples: each
evaluation reads the next --eval-iters x global-batch samples, and a resumed run starts where
(iteration // --eval-interval) evaluations left it.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .data import BatchSource


def add_eval_args(parser: argparse.ArgumentParser, eval_iters_default: int) -> None:
    g = parser.add_argument_group("validation (Megatron-LM's)")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="evaluate on the validation split every N iterations (and after training)")
    g.add_argument("--eval-iters", type=int, default=eval_iters_default,
                   help=f"global batches per evaluation; 0 turns evaluation off (default {eval_iters_default})")
    g.add_argument("--skip-train", action="store_true", help="evaluate the loaded model only, without training")


def check_eval_args(args: argparse.Namespace) -> Optional[str]:
    if args.eval_interval <= 0:
        return f"--eval-interval must be a positive integer, got {args.eval_interval}"
    if args.eval_iters < 0:
        return f"--eval-iters must be >= 0 (0 turns evaluation off), got {args.eval_iters}"
    if args.skip_train and args.eval_iters == 0:
        return "--skip-train with --eval-iters 0 has nothing to do: give --eval-iters N"
    return None


def consumed_valid_samples(args: argparse.Namespace, iteration: int) -> int:
    """Megatron-LM's consumed_valid_samples at ``iteration`` (the evaluations already run)."""
    return (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size


def evaluate(model: torch.nn.Module, source: BatchSource, split: str, consumed: int, args: argparse.Namespace,
             loss_terms: Callable[[torch.nn.Module, tuple], tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """The split's loss over --eval-iters global batches from sample ``consumed``: per token with
    --calculate-per-token-loss, else the mean of the micro-batch means (every rank gets the same)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for k in range(args.eval_iters):
            for tokens, labels in source.eval_batches(split, consumed + k * args.global_batch_size,
                                                      args.num_microbatches):
                loss_sum, count = loss_terms(model, (tokens.to(device), labels.to(device)))
                if args.loss_mode == "per_token":
                    totals += torch.stack([loss_sum.double(), count.double()])
                else:
                    totals += torch.stack([loss_sum.double() / count.clamp(min=1).double(),
                                           torch.ones((), dtype=torch.float64, device=device)])
    model.train(was_training)
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def result_lines(prefix: str, loss: float) -> list[str]:
    """Megatron-LM's three lines (dashes, result, dashes)."""
    ppl = math.exp(min(20.0, loss))
    string = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    dashes = "-" * (len(string) + 1)
    return [dashes, string, dashes]
