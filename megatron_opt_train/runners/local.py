"""The local runner: the main job's own GPT (components/model.py) under megatron_opt's
DistributedDataParallel, stepped by megatron_opt.train_step; data parallelism only."""
from __future__ import annotations

import argparse
import os

import torch

import megatron_opt as mo
from megatron_opt.megatron import arguments as megatron_args

from ..components import evaluation
from ..components.data import Batch, build_source
from ..components.model import GPT, gpt_loss, gpt_mean_loss
from ..components.timers import PhaseTimers
from .base import Place, Runner


class LocalRunner(Runner):
    """The data, the model, its DDP, the optimizer and the schedule, as megatron_opt's API builds them."""

    def __init__(self, args: argparse.Namespace, place: Place, timers: PhaseTimers) -> None:
        super().__init__(args, place, timers)
        self.source = build_source(args, place.rank, place.world)
        torch.manual_seed(args.seed)
        self.dtype = megatron_args.params_dtype_from_args(args)
        self.model = GPT(self.source.vocab_size, args).to(place.device, self.dtype)
        ddp = mo.DistributedDataParallel(self.model, megatron_args.ddp_config_from_args(args))
        ddp.broadcast_params()
        self.ddps = [ddp]
        self.optimizer = mo.get_megatron_optimizer(self.optimizer_config(), ddp)
        self.scheduler = megatron_args.scheduler_from_args(self.optimizer, args)
        self.data_parallel_size = place.world
        self.loss_fn = timers.wrap(gpt_loss if args.loss_mode == "per_token" else gpt_mean_loss,
                                   "forward-compute", level=2)

    def train_step(self, batches: list[Batch]) -> mo.TrainStepResult:
        return mo.train_step(self.ddps[0], self.optimizer, self.scheduler, batches, self.loss_fn,
                             loss_mode=self.args.loss_mode, samples_per_step=self.args.global_batch_size)

    def evaluation_loss(self, split: str, consumed: int) -> float:
        return evaluation.evaluate(self.ddps[0], self.source, split, consumed, self.args, gpt_loss,
                                   self.place.device)

    def layout(self) -> str:
        return f"DP={self.place.world}"

    def describe(self) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # torchrun's launcher (node) count
        return (f"{n_params / 1e6:.2f}M params, DP={self.place.world}, {nodes} node{'s' if nodes > 1 else ''}, "
                f"device={self.place.device}, dtype={self.dtype}, "
                f"ops backend={mo.ops.backend_for(next(self.model.parameters()))}")


__all__ = ["LocalRunner"]
