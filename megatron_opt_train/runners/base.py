"""The one interface the Trainer drives a model through: a runner builds the model, its DDP chunks,
the optimizer and the schedule for this rank's place in the layout, and runs one training step and
one evaluation. Two runners: the main job's own GPT with megatron_opt.train_step (local.py), and
megatron-core's GPTModel through megatron-core's schedule (megatron_core.py, model parallelism)."""
from __future__ import annotations

import abc
import argparse
import dataclasses
from typing import Any

import torch

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)
from megatron_opt.megatron import arguments as megatron_args

from ..components.data import Batch, BatchSource
from ..components.timers import PhaseTimers


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this process runs: its global rank, the world size and its device."""

    rank: int
    world: int
    device: torch.device


class Runner(abc.ABC):
    """One rank's model, DDP chunks, optimizer, schedule and data; what differs between the runners.

    Attributes every runner sets when built: ``source`` (this rank's batches), ``dtype`` (the params'),
    ``model`` (the parameters, for their norm), ``ddps`` (the DDP-wrapped model chunks, as the
    optimizer and megatron_opt.checkpoint see them), ``optimizer``, ``scheduler`` and
    ``data_parallel_size``."""

    source: BatchSource
    dtype: torch.dtype
    model: torch.nn.Module
    ddps: list
    optimizer: Any
    scheduler: Any
    data_parallel_size: int

    def __init__(self, args: argparse.Namespace, place: Place, timers: PhaseTimers) -> None:
        self.args, self.place, self.timers = args, place, timers

    def optimizer_config(self) -> mo.OptimizerConfig:
        """The flags' optimizer config, with the timers the optimizer times its phases by."""
        return dataclasses.replace(megatron_args.optimizer_config_from_args(self.args),
                                   timers=self.timers.for_optimizer())

    @abc.abstractmethod
    def train_step(self, batches: list[Batch]) -> mo.TrainStepResult:
        """One training step over this rank's micro-batches (already on the device)."""

    @abc.abstractmethod
    def evaluation_loss(self, split: str, consumed: int) -> float:
        """The loss of --eval-iters global batches of ``split`` from sample ``consumed`` (the same on
        every rank); the forward pre-hooks are off meanwhile (the Trainer's job)."""

    @abc.abstractmethod
    def layout(self) -> str:
        """The parallel layout, as a resume names the saved and the current one."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The header's words for the model and where it runs (collective: every rank calls it)."""

    def data_extra(self) -> dict:
        """Run-wide checkpoint extras for the data position (none by default: each rank's own position
        is its rank_extra, which comes back at the same world size)."""
        return {}

    def resume_data(self, state: mo.checkpoint.LoadResult) -> None:
        """Put the data where the checkpoint left it."""
        self.source.resume(state.rank_extra, state.iteration)


__all__ = ["Place", "Runner"]
