"""One model chunk's per-step state, named (FSDP2 names its ``TrainingState`` the same way).

A step of DistributedDataParallel goes through three phases::

    ACCUMULATING --first bucket launched--> REDUCING --finish_grad_sync()--> REDUCED
         ^                                                                     |
         +------------------------- zero_grad_buffer() ------------------------+

``GradSyncState`` holds the phase and the few per-step facts that go with it (which step this is,
how many gradients arrived, whether the reduction is suspended by ``no_sync()``, whether this step's
buckets are all-reduced instead of reduce-scattered). The bucket launch order has its own state
(grad_sync.BucketLaunchOrder), as FSDP2's reduce-scatter state is its own.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class GradSyncPhase(enum.Enum):
    """Where one model chunk's gradients are in a step."""

    ACCUMULATING = "accumulating"  # backward passes add into main_grad; no bucket launched yet
    REDUCING = "reducing"  # some bucket's reduction was launched (overlap_grad_reduce or start_grad_sync())
    REDUCED = "reduced"  # finish_grad_sync() waited for every bucket: main_grad holds the reduced sum


@dataclass
class GradSyncState:
    """The per-step state of one DistributedDataParallel (one instance per wrapper, never shared)."""

    step_id: int = 0  # advanced by zero_grad_buffer(): lets the optimizer tell steps apart
    phase: GradSyncPhase = GradSyncPhase.ACCUMULATING
    grads_received: int = 0  # gradients accumulated since zero_grad_buffer() (0: no backward ran)
    sync_enabled: bool = True  # False inside no_sync(): gradients accumulate, buckets are not launched
    # Megatron-LM sets it for a step whose main grads it saves whole: all-reduce instead of reduce-scatter.
    force_all_reduce: bool = False
    # A gradient that reached a backward hook after its bucket was launched, while the reduction was in
    # flight: raised by the optimizer's step on every rank together (peers wait in this step's collectives).
    late_gradient: Optional[str] = None

    def enter(self, phase: GradSyncPhase) -> None:
        """The one place a chunk's phase changes (a phase hook, e.g. timers, would observe it here)."""
        self.phase = phase

    def new_step(self) -> None:
        """zero_grad_buffer(): a new step's gradients start."""
        self.step_id += 1
        self.grads_received = 0
        self.late_gradient = None
        self.enter(GradSyncPhase.ACCUMULATING)


__all__ = ["GradSyncPhase", "GradSyncState"]
