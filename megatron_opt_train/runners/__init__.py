"""The runners behind the Trainer's one interface (base.Runner): the local one (the main job's own GPT,
data parallelism) and megatron-core's GPTModel (model parallelism, --num-experts, --use-mcore-models;
megatron-core needed only then)."""
from __future__ import annotations

import argparse

from ..components.timers import PhaseTimers
from . import megatron_core_args
from .base import Place, Runner


def build_runner(args: argparse.Namespace, place: Place, timers: PhaseTimers) -> Runner:
    """The runner the flags ask for, built (process groups must exist)."""
    if megatron_core_args.wanted(args):
        from .megatron_core import ModelParallelRunner

        return ModelParallelRunner(args, place, timers)
    from .local import LocalRunner

    return LocalRunner(args, place, timers)


__all__ = ["build_runner", "Place", "Runner"]
