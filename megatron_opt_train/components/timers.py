"""Megatron-LM's --timing-log-level timers for the main job, reported at each --log-interval:

    level 1: forward-backward, all-grads-sync, optimizer and the optimizer's own phases
    level 2: also batch-generator, forward-compute, backward-compute

Nothing is monkeypatched. This object speaks Megatron-LM's Timers interface (``timers(name,
log_level)`` -> the one clock of that name, with start/stop) and is given where Megatron-LM gives its
Timers: as ``OptimizerConfig.timers`` (the optimizer times its passes, and megatron_opt.train_step its
gradient sync and the step: megatron_opt.optimizer.step.phase_timers, docs/usage.md "Timers"), and, for
``all-grads-sync`` only, as megatron-core's ``TransformerConfig.timers`` (finalize_model_grads). What
the runner calls itself it times itself (the model-parallel runner's optimizer.step, the forward
step). Level 0 times nothing and adds no synchronisation.
"""
from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_opt.optimizer.step import phase_timers

# Level 1 ends with the optimizer's own phases (timed by the optimizer through OptimizerConfig.timers).
TIMERS_BY_LEVEL = {1: ("forward-backward", phase_timers.GRAD_SYNC, phase_timers.OPTIMIZER, phase_timers.PASS1,
                       phase_timers.PASS2, phase_timers.PARAM_SYNC),
                   2: ("batch-generator", "forward-compute", "backward-compute")}


class PhaseTimers:
    """Megatron-LM's level-1/2 timers around a training iteration's phases (seconds summed per name
    until ``report``)."""

    def __init__(self, level: int, cuda: bool) -> None:
        self.level, self.cuda = level, cuda
        self.device = torch.device("cuda") if cuda else torch.device("cpu")  # NCCL reduces device tensors
        self.totals: dict[str, float] = defaultdict(float)
        self._clocks: dict[str, _Clock] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(name for lvl in (1, 2) if lvl <= self.level for name in TIMERS_BY_LEVEL[lvl])

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return datetime.datetime.now().timestamp()

    @contextlib.contextmanager
    def time(self, name: str, level: int = 1) -> Iterator[None]:
        if self.level < level:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            self.totals[name] += self._now() - start

    def __call__(self, name: str, log_level: Optional[int] = None) -> "_Clock":
        """Megatron-LM's Timers interface: the clock of ``name`` (made at its first call's level)."""
        if name not in self._clocks:
            self._clocks[name] = _Clock(self, name, 2 if log_level is None else log_level)
        return self._clocks[name]

    def wrap(self, fn: Callable[..., Any], name: str, level: int = 1) -> Callable[..., Any]:
        """``fn`` timed as ``name`` (``fn`` itself above this level)."""
        if self.level < level:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(name, level):
                return fn(*args, **kwargs)
        return timed

    def for_optimizer(self) -> Optional["PhaseTimers"]:
        """What ``OptimizerConfig.timers`` gets: this object from level 1 on, else None (no timing)."""
        return self if self.level >= 1 else None

    def only(self, *names: str) -> Optional[Callable[..., Any]]:
        """Megatron-LM's Timers interface over ``names`` only (the other names: clocks that do nothing),
        for megatron-core's ``TransformerConfig.timers``; None at level 0. megatron-core also times
        phases this object times itself (forward-compute), which must not count twice."""
        if self.level < 1:
            return None
        idle = _Clock(self, "", self.level + 1)

        def timers(name: str, log_level: Optional[int] = None) -> _Clock:
            return self(name, log_level) if name in names else idle
        return timers

    def step_totals(self) -> tuple[float, float]:
        """The gradient-sync and optimizer seconds so far: close_step takes a train step's share."""
        return self.totals[phase_timers.GRAD_SYNC], self.totals[phase_timers.OPTIMIZER]

    def close_step(self, step_seconds: float, before: tuple[float, float]) -> None:
        """Split one train step's time: what it spent neither in the gradient sync nor in the optimizer's
        step is forward-backward (``before``: step_totals() before the step)."""
        if self.level < 1:
            return
        sync, optimizer = self.step_totals()
        self.totals["forward-backward"] += step_seconds - (sync - before[0]) - (optimizer - before[1])

    def report(self, normalizer: int, option: str) -> tuple[Optional[str], dict[str, float]]:
        """Megatron-LM's timers.log text over the ranks (ms per iteration) and {name: max ms}; resets."""
        names = self.names()
        if not names:
            return None, {}
        if "forward-compute" in self.totals:
            self.totals["backward-compute"] = self.totals["forward-backward"] - self.totals["forward-compute"]
        local = torch.tensor([self.totals.get(n, 0.0) * 1000.0 / normalizer for n in names], dtype=torch.float64,
                             device=self.device)
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        self.totals.clear()
        title = "max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"
        lines = [title]
        for name, lo, hi in zip(names, low.tolist(), high.tolist()):
            value = f"{hi:.2f}" if option == "max" else f"({lo:.2f}, {hi:.2f})"
            lines.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
        return "\n".join(lines), dict(zip(names, high.tolist()))


class _Clock:
    """One named timer of PhaseTimers, started and stopped by its user (no-ops above the level)."""

    def __init__(self, timers: PhaseTimers, name: str, level: int) -> None:
        self.timers, self.name, self.on = timers, name, level <= timers.level
        self.started: Optional[float] = None

    def start(self, barrier: bool = False) -> None:
        if self.on:
            self.started = self.timers._now()

    def stop(self, barrier: bool = False) -> None:
        if self.on and self.started is not None:
            self.timers.totals[self.name] += self.timers._now() - self.started
            self.started = None


__all__ = ["PhaseTimers", "TIMERS_BY_LEVEL"]
