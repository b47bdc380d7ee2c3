"""GradMultiplier: the one factor a step multiplies the reduced gradients of some shards by.

The shards that share an unscale factor (DDP's 1/DP or 1/N normalisation and grad_scale_factor, kept
current on the device by distributed/) share one multiplier. Per step it is computed once, here:
``stage(loss_scale)`` before pass 1 gives ``inv_scale`` = unscale factor / loss scale (pass 1 scales the
sum of squares by it); ``fold_clip(clip_coef)`` before pass 2 gives ``update_scale`` = inv_scale times the
clip coefficient, one fp32 rounding, the one multiplier every backend's pass 2 reads as it is.
"""
from __future__ import annotations

from typing import Optional

import torch


class GradMultiplier:
    """The gradient multiplier of the shards that share ``unscale_factor`` (a device tensor)."""

    def __init__(self, unscale_factor: torch.Tensor) -> None:
        self.unscale_factor = unscale_factor
        self.inv_scale: Optional[torch.Tensor] = None  # this step's unscale factor / loss scale
        self.update_scale: Optional[torch.Tensor] = None  # this step's inv_scale * clip coefficient

    def stage(self, loss_scale: torch.Tensor) -> torch.Tensor:
        """A new step: unscale factor / loss scale (pass 1's inv_scale)."""
        self.inv_scale = self.unscale_factor / loss_scale
        self.update_scale = None
        return self.inv_scale

    def fold_clip(self, clip_coef: Optional[torch.Tensor]) -> torch.Tensor:
        """Pass 2's multiplier: inv_scale times the fp32 clip coefficient (inv_scale itself without one)."""
        if self.inv_scale is None:
            raise RuntimeError("GradMultiplier.fold_clip() before stage(): pass 1 stages the step's loss scale")
        self.update_scale = self.inv_scale if clip_coef is None else self.inv_scale * clip_coef
        return self.update_scale


__all__ = ["GradMultiplier"]
