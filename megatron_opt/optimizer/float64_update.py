"""One update recomputed in float64, with a bound on the error of the fp32 arithmetic, per update rule.

Verify mode's ``update`` check (optimizer/verify.py) compares what pass 2 stored with these values.
The bound is derived from the magnitudes of the individual terms of each formula, never from the
result alone: a moment update such as ``beta1 * m + (1 - beta1) * g`` can cancel to nearly zero
while each of its terms was rounded at its own magnitude. Every fp32 operation rounds with a
relative error of at most u = 2^-24; a term that passes through a handful of operations (the fp32
gradient multiplier, the fp32 lr, the product, the sum) carries at most ``SLACK`` roundings of
its own magnitude, and an absolute ``SLACK`` fp32 subnormals covers underflow. Rounding into a
16-bit store (moments, fp16 masters) is not part of these bounds: verify.py adds it, by dtype.

The formulas are the mathematics of ops/reference.py in float64 (not a copy of its fp32 code):

  AdamW  m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g^2;  D = sqrt(v') / sqrt(1-b2^t) + eps
         w' = w (1 - lr wd) - lr / (1-b1^t) * m' / D
  SGD    g' = g + wd w;  b' = mu b + g';  d = g' + mu b' (Nesterov) or b';  w' = w - lr d
  Lion   c = b1 m + (1-b1) g;  w' = w (1 - lr wd) - lr sign(c);  m' = b2 m + (1-b2) g
         (where |c| is within its rounding bound of 0, fp32 may see another sign: w' may then
         differ by up to 2 lr, which the bound allows)

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


_K = SLACK * FP32_UNIT
_C = SLACK * FP32_SUBNORMAL


def rounding_bound(*terms: torch.Tensor) -> torch.Tensor:
    """SLACK fp32 roundings of each term's magnitude, plus underflow."""
    total = terms[0].abs()
    for t in terms[1:]:
        total.add_(t.abs())
    return total.mul_(_K).add_(_C)


def adamw(inp: Float64Inputs, beta1: float, beta2: float, eps: float) -> Float64Update:
    # Written with in-place ops: verify mode runs this over the whole shard, and passes cost time.
    w, g, m, v = inp.master, inp.grad, inp.state["exp_avg"], inp.state["exp_avg_sq"]
    m_new = torch.lerp(m, g, 1 - beta1)  # b1 m + (1-b1) g
    dm = torch.lerp(m.abs(), g.abs(), 1 - beta1).mul_(_K).add_(_C)  # r(b1 m, (1-b1) g)
    g2 = g * g
    v_new = torch.lerp(v, g2, 1 - beta2)
    dv = torch.lerp(v.abs(), g2, 1 - beta2).mul_(_K).add_(_C)
    bc1, bc2_sqrt = 1 - beta1**inp.step, (1 - beta2**inp.step) ** 0.5
    root = v_new.sqrt()
    # |sqrt(a) - sqrt(b)| = |a - b| / (sqrt(a) + sqrt(b)) <= |a - b| / max(sqrt(a), sqrt(|a - b|)): the
    # relative error halves, and near 0 it is at most the root of the error.
    d_root = dv / torch.maximum(root, dv.sqrt())
    d_root.add_(root, alpha=_K).add_(_C)
    denom = root.div_(bc2_sqrt).add_(eps)
    d_denom = d_root.div_(bc2_sqrt).add_(denom, alpha=_K).add_(_C)
    direction = m_new / denom
    a_dir = direction.abs()
    d_direction = (a_dir * d_denom).add_(dm).div_((denom - d_denom).clamp_min_(FP32_SUBNORMAL))
    d_direction.add_(a_dir, alpha=_K).add_(_C)
    step_size = inp.lr / bc1
    w_new = (w * (1 - inp.lr * inp.weight_decay)).sub_(direction, alpha=step_size)
    dw = w.abs().add_(a_dir, alpha=step_size).mul_(_K).add_(_C).add_(d_direction, alpha=step_size)
    return Float64Update({"master": w_new, "exp_avg": m_new, "exp_avg_sq": v_new},
                         {"master": dw, "exp_avg": dm, "exp_avg_sq": dv})


def sgd(inp: Float64Inputs, momentum: float, nesterov: bool) -> Float64Update:
    w, g = inp.master, inp.grad
    g_eff = g + inp.weight_decay * w
    dg = rounding_bound(g, inp.weight_decay * w)
    values, tolerance = {}, {}
    if momentum != 0:
        b = inp.state["momentum_buffer"]
        b_new = momentum * b + g_eff
        db = dg + rounding_bound(momentum * b, g_eff)
        values["momentum_buffer"], tolerance["momentum_buffer"] = b_new, db
        if nesterov:
            direction = g_eff + momentum * b_new
            d_direction = dg + momentum * db + rounding_bound(g_eff, momentum * b_new)
        else:
            direction, d_direction = b_new, db
    else:
        direction, d_direction = g_eff, dg
    values["master"] = w - inp.lr * direction
    tolerance["master"] = rounding_bound(w, inp.lr * direction) + inp.lr * d_direction
    return Float64Update(values, tolerance)


def lion(inp: Float64Inputs, beta1: float, beta2: float) -> Float64Update:
    w, g, m = inp.master, inp.grad, inp.state["exp_avg"]
    c = beta1 * m + (1 - beta1) * g
    sign_may_differ = c.abs() <= rounding_bound(m, g)
    w_new = w * (1 - inp.lr * inp.weight_decay) - inp.lr * c.sign()
    dw = rounding_bound(w, torch.full_like(w, inp.lr)) + sign_may_differ * (2 * inp.lr)
    m_new = beta2 * m + (1 - beta2) * g
    return Float64Update({"master": w_new, "exp_avg": m_new}, {"master": dw, "exp_avg": rounding_bound(m, g)})


__all__ = ["Float64Inputs", "Float64Update", "rounding_bound", "adamw", "sgd", "lion", "FP32_UNIT", "SLACK"]
