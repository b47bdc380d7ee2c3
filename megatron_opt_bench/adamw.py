"""The AdamW setup the step benchmarks share: their hyperparameter flags, megatron_opt's config and
optimizer-state options built from them, and torch.optim param groups that follow megatron_opt's own
weight-decay rule (so that every implementation decays the same params)."""
from __future__ import annotations

import argparse
from types import MappingProxyType
from typing import Iterable, Mapping

import torch

import megatron_opt as mo
from megatron_opt.optimizer.build.param_groups import build_param_groups, standard_overrides

# --mo-states of bench_step.py and bench_optimizer_step.py: megatron_opt's optimizer-state options
# (Megatron-LM's precision-aware optimizer fields of OptimizerConfig).
MO_STATES: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "fp32": MappingProxyType({}),
    "bf16": MappingProxyType(dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=False)),
    "bf16+rem": MappingProxyType(dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                      exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)),
})


def add_adamw_arguments(parser: argparse.ArgumentParser) -> None:
    """--lr, --weight-decay, --beta1, --beta2, --eps and --clip-grad, with the benchmarks' defaults."""
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--clip-grad", type=float, default=1.0)


def adamw_config(args: argparse.Namespace, **fields: object) -> mo.OptimizerConfig:
    """megatron_opt's distributed AdamW config from the flags of add_adamw_arguments, plus ``fields``."""
    return mo.OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.beta1, adam_beta2=args.beta2,
        adam_eps=args.eps, clip_grad=args.clip_grad, use_distributed_optimizer=True, **fields)


def weight_decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], config: mo.OptimizerConfig) -> list[dict]:
    """torch.optim param groups (``params``, ``weight_decay``) split as megatron_opt splits its own under
    ``config``: megatron-core's standard overrides through the library's param-group builder (no weight
    decay on biases and 1-D params), in its order (the decayed group first); no empty groups."""
    groups = build_param_groups(list(named_params), config, standard_overrides(config))
    return [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]
