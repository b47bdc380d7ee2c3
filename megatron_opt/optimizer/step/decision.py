"""StepDecision: whether this step is applied, and with which clip coefficient, as device ops.

The one place the step is decided. From the packed statistics of pass 1 (one SUM all-reduce per
stats group) it derives, on the device and with no host synchronisation:

  * ``verdict``: APPLY, or why the step is skipped: LATE_GRADIENT (on some rank a gradient reached a
    backward hook after its bucket was launched; it outranks everything), MISSING_BACKWARD (some rank
    reached the step with no gradient since zero_grad_buffer()), NON_FINITE (an inf/NaN gradient
    element, or a squared norm that overflowed), NORM_OVER_THRESHOLD (grad_norm_skip_threshold);
  * ``grad_norm``: the unscaled global L2 norm, before clipping;
  * ``skip``: the fp32 flag the pass-2 ops read (nonzero: write nothing);
  * the clip coefficient ``min(1, clip_grad / (norm + 1e-6))`` (``clip_coefficient``, the formula's one
    owner: verify mode recomputes the step with it too) as an fp32 scalar.

The CUDA-graph step uses these tensors as they are; the host API (prepare_grads, get_grad_norm, ...)
reads them once per step with ``read()``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.profiler import record_function

from . import global_stats as grad_stats


def clip_coefficient(grad_norm: torch.Tensor, clip_grad: float) -> torch.Tensor:
    """min(1, clip_grad / (norm + 1e-6)) in float64 (Megatron-LM's clip_grad_by_total_norm_fp32), on
    the norm's device; a NaN norm gives 1 (such a step is skipped anyway)."""
    coef = clip_grad / (grad_norm.double() + 1.0e-6)
    return torch.where(coef < 1.0, coef, torch.ones_like(coef))


class Verdict(enum.IntEnum):
    APPLY = 0
    NON_FINITE = 1
    NORM_OVER_THRESHOLD = 2
    MISSING_BACKWARD = 3
    LATE_GRADIENT = 4


@dataclass(frozen=True)
class DecisionRead:
    """The decision as host values: what the one host read of a step returns."""

    verdict: Verdict
    grad_norm: float
    num_zeros: int
    missing_backward: int  # ranks that reached the step with no gradient
    late_gradients: int = 0  # ranks where a gradient reached a hook after its bucket was launched

    @property
    def found_inf(self) -> bool:
        return self.verdict is Verdict.NON_FINITE


class StepDecision:
    """The decision's device tensors (allocated once: a captured CUDA graph reads them in place)."""

    def __init__(self, device: torch.device) -> None:
        self.stats = grad_stats.new_stats(device)
        self.missing = torch.zeros((), dtype=torch.float64, device=device)  # this rank's missing-backward flag
        self.late = torch.zeros((), dtype=torch.float64, device=device)  # this rank's late-gradient flag
        self.verdict = torch.zeros((), dtype=torch.int64, device=device)
        self.grad_norm = torch.zeros(1, dtype=torch.float64, device=device)
        self.skip = torch.zeros(1, dtype=torch.float32, device=device)
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)  # the loss scaler backs off

    def decide(self, leaves: Sequence, loss_scale: torch.Tensor, count_zeros: bool,
               groups: Sequence[Optional[torch.distributed.ProcessGroup]], threshold: Optional[float]) -> None:
        """Pass 1 on every leaf, the statistics all-reduce and the verdict: device work only."""
        stats = self.stats
        stats.zero_()
        with record_function("megatron_opt.pass1"):
            for leaf in leaves:
                leaf.accumulate_local_stats(stats, loss_scale, count_zeros)
        stats[grad_stats.STAT_MISSING_BACKWARD].copy_(self.missing)
        stats[grad_stats.STAT_LATE_GRADIENT].copy_(self.late)
        with record_function("megatron_opt.stats_allreduce"):
            grad_stats.reduce_stats(stats, groups)
        missing = stats[grad_stats.STAT_MISSING_BACKWARD] != 0
        # A squared sum that overflowed also counts: it cannot be clipped meaningfully.
        non_finite = (stats[grad_stats.STAT_NONFINITE] != 0) | ~torch.isfinite(stats[grad_stats.STAT_SUMSQ])
        self.grad_norm.copy_(grad_stats.grad_norm_of(stats))
        verdict = torch.where(non_finite, int(Verdict.NON_FINITE), int(Verdict.APPLY))
        if threshold is not None:
            over = self.grad_norm[0] > threshold
            verdict = torch.where(~non_finite & over, int(Verdict.NORM_OVER_THRESHOLD), verdict)
        verdict = torch.where(missing, int(Verdict.MISSING_BACKWARD), verdict)
        late = stats[grad_stats.STAT_LATE_GRADIENT] != 0
        verdict = torch.where(late, int(Verdict.LATE_GRADIENT), verdict)
        self.verdict.copy_(verdict)
        self.overflow.copy_(non_finite & ~missing & ~late)
        self.skip.copy_((verdict != Verdict.APPLY).reshape(1))

    def clip_coefficient(self, clip_grad: float) -> torch.Tensor:
        """This step's clip coefficient as an fp32 device scalar (the norm in float64)."""
        return clip_coefficient(self.grad_norm, clip_grad).float()

    def read(self) -> DecisionRead:
        """The decision on the host: the step's one synchronisation."""
        values = torch.cat([self.stats, self.grad_norm, self.verdict.reshape(1).double()]).tolist()
        return DecisionRead(verdict=Verdict(int(values[-1])), grad_norm=values[-2],
                            num_zeros=int(values[grad_stats.STAT_ZEROS]),
                            missing_backward=int(values[grad_stats.STAT_MISSING_BACKWARD]),
                            late_gradients=int(values[grad_stats.STAT_LATE_GRADIENT]))


__all__ = ["StepDecision", "DecisionRead", "Verdict", "clip_coefficient"]
