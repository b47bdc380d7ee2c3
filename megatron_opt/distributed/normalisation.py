"""Gradient normalisation: the one owner of every factor a model chunk's gradients are multiplied by.

Buckets are reduced with SUM and nothing multiplies the gradient buffers, so normalisation costs no
pass (rules 11-12 of docs/contract.md). Instead ``factor`` (Megatron's ``grad_scale_factor``, a
device scalar) records what the gradients must be multiplied by: 1/DP by default (or 1 where the
caller divides by a global count itself), replaced by a loss divisor (1/N tokens) or multiplied by
``scale_gradients(f)``.

16-bit gradient buffers are the exception: a sum over DP ranks can overflow where the average would
not, so (as Megatron-LM does) each bucket is multiplied by ``reduce_prescale`` just before its
reduction. The optimizer never sees that split: each published shard carries one resolved unscale
factor, ``factor / prescale``, kept current here whenever ``factor`` changes.
"""
from __future__ import annotations

from typing import Union

import torch

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def reduce_prescale(grad_dtype: torch.dtype, reduce_ranks: int) -> float:
    """What a bucket is multiplied by just before it is summed over ``reduce_ranks`` ranks: 1/ranks for
    16-bit gradients, else 1 (fp32 buffers stay on the exact deferred path, with no pass at all)."""
    return 1.0 / reduce_ranks if grad_dtype in _SIXTEEN_BIT and reduce_ranks > 1 else 1.0


class GradNormalisation:
    """The deferred normalisation of one model chunk: ``factor`` and, per reduction pre-scale, the
    resolved unscale factor a shard publishes (the optimizer multiplies it by 1/loss_scale)."""

    def __init__(self, base: float, device: torch.device) -> None:
        self.base = base  # what a new step starts at: 1/DP, or 1.0 (megatron-core's per-token loss)
        self.factor = torch.full((1,), base, dtype=torch.float32, device=device)
        # prescale -> factor / prescale. Tensors are updated in place, never replaced: a captured CUDA
        # graph reads them at their address. Prescale 1 is the factor itself (no copy, same bits).
        self._unscale: dict[float, torch.Tensor] = {1.0: self.factor}

    def unscale_factor(self, prescale: float) -> torch.Tensor:
        """The device scalar the logical gradient of a bucket pre-scaled by ``prescale`` is its
        reduced gradient times (``factor / prescale``)."""
        if prescale not in self._unscale:
            self._unscale[prescale] = self.factor / prescale
        return self._unscale[prescale]

    def reset(self) -> None:
        """A new step: back to the base factor."""
        self.factor.fill_(self.base)
        self._refresh()

    def scale(self, multiplier: Union[float, torch.Tensor]) -> None:
        """Megatron's scale_gradients(f), deferred: the factor is multiplied, the buffers are not."""
        self.factor.mul_(multiplier)
        self._refresh()

    def set_factor(self, factor: Union[float, torch.Tensor]) -> None:
        """Replace the whole factor (the default 1/DP included)."""
        self.factor.copy_(torch.as_tensor(factor, dtype=torch.float32).reshape(1))
        self._refresh()

    def _refresh(self) -> None:
        for prescale, resolved in self._unscale.items():
            if resolved is not self.factor:
                torch.div(self.factor, prescale, out=resolved)


def loss_divisor_factor(divisor: Union[float, torch.Tensor]) -> torch.Tensor:
    """fp32(1 / divisor), the reciprocal taken in float64 so that the factor is exactly the fp32
    nearest to 1/N (rule 11 of docs/contract.md)."""
    return torch.as_tensor(divisor, dtype=torch.float64).reciprocal().float()


__all__ = ["GradNormalisation", "reduce_prescale", "loss_divisor_factor"]
