"""Worker-side cases: the optimizer's phases through OptimizerConfig.timers (Megatron-LM's Timers
interface: ``timers(name, log_level=...)`` gives an object with ``start(barrier=...)`` / ``stop()``)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tests.support.common import TinyLM, build, global_batch, token_loss_sum


class RecordingTimers:
    """Megatron-LM's Timers interface; records every call as (event, name, log_level, barrier)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def __call__(self, name: str, log_level: int = None) -> "RecordingTimers._Clock":
        return RecordingTimers._Clock(self, name, log_level)

    class _Clock:
        def __init__(self, owner: "RecordingTimers", name: str, log_level: int) -> None:
            self.owner, self.name, self.log_level = owner, name, log_level

        def start(self, barrier: bool = False) -> None:
            self.owner.events.append(("start", self.name, self.log_level, barrier))

        def stop(self, barrier: bool = False) -> None:
            self.owner.events.append(("stop", self.name, self.log_level, barrier))


def timed_steps(multipliers: list, **opt_kwargs) -> list[list[tuple]]:
    """TinyLM trained one step per gradient multiplier (inf: an overflow on rank 0) with a
    RecordingTimers in the config; the timer events of each step()."""
    timers = RecordingTimers()
    model = TinyLM(torch.float32)
    ddp, opt = build(model, clip_grad=1.0, timers=timers, **opt_kwargs)
    batches = global_batch(2 * dist.get_world_size(), seed=3)
    out = []
    for i, mult in enumerate(multipliers):
        ddp.zero_grad_buffer()
        x, y = batches[(2 * dist.get_rank() + i) % len(batches)]
        loss = token_loss_sum(ddp(x), y)[0]
        opt.scale_loss(loss * (mult if math.isfinite(mult) else 1.0)).backward()
        if not math.isfinite(mult) and dist.get_rank() == 0:
            next(p for p in model.parameters()).main_grad.view(-1)[0] = float("inf")
        timers.events.clear()
        opt.step()
        out.append(list(timers.events))
    return out
