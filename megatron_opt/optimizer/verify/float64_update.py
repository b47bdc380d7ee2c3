"""What a rule's float64 recomputation takes and returns, and the rounding bound it is built from.
Each rule's own recomputation (``recompute`` in ``optimizer/rules/<rule>.py``, behind
``UpdateRule.float64_update``) uses these.

Verify mode's ``update`` check (optimizer/verify/step_verifier.py) compares what pass 2 stored with these values.
The bound is derived from the magnitudes of the individual terms of each formula, never from the
result alone: a moment update such as ``beta1 * m + (1 - beta1) * g`` can cancel to nearly zero
while each of its terms was rounded at its own magnitude. Every fp32 operation rounds with a
relative error of at most u = 2^-24; a term that passes through a handful of operations (the fp32
gradient multiplier, the fp32 lr, the product, the sum) carries at most ``SLACK`` roundings of
its own magnitude, and an absolute ``SLACK`` fp32 subnormals covers underflow. Rounding into a
16-bit store (moments, fp16 masters) is not part of these bounds: verify.py adds it, by dtype.

Each rule file states its formulas beside its recomputation.

A custom UpdateRule provides its own ``float64_update`` returning a ``Float64Update``; verify mode
refuses to run on a rule that has none (docs/usage.md, "Verify mode").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

FP32_UNIT = 2.0**-24  # unit roundoff of one fp32 operation
FP32_SUBNORMAL = 2.0**-149  # the smallest fp32 step: the absolute error of an underflow
SLACK = 16  # roundings allowed per term (a few ops, the fp32 lr and the fp32 gradient multiplier)


@dataclass(frozen=True)
class Float64Inputs:
    """A run of one param group's elements before the update, as float64."""

    master: torch.Tensor
    grad: torch.Tensor  # the reduced gradient: unscaled (loss scale, 1/DP or 1/N) and clipped
    state: Mapping[str, torch.Tensor]  # the rule's state by name (UpdateRule.state_dtypes())
    lr: float
    weight_decay: float
    step: int  # the 1-based index of this update


@dataclass(frozen=True)
class Float64Update:
    """The expected values after the update (``"master"`` and each state name) and, per element, an
    absolute bound on the error that fp32 arithmetic may make computing them."""

    values: dict[str, torch.Tensor]
    tolerance: dict[str, torch.Tensor]


TERM_ROUNDING = SLACK * FP32_UNIT  # the relative error a term may carry
UNDERFLOW = SLACK * FP32_SUBNORMAL  # the absolute error underflow may add


def rounding_bound(*terms: torch.Tensor) -> torch.Tensor:
    """SLACK fp32 roundings of each term's magnitude, plus underflow."""
    total = terms[0].abs()
    for t in terms[1:]:
        total.add_(t.abs())
    return total.mul_(TERM_ROUNDING).add_(UNDERFLOW)


__all__ = ["Float64Inputs", "Float64Update", "rounding_bound", "FP32_UNIT", "FP32_SUBNORMAL", "SLACK", "TERM_ROUNDING",
           "UNDERFLOW"]
