"""Signum (Bernstein et al., 2018) with a step scale: the sign of the momentum, decoupled weight decay;
optimizer='signum'. A throwaway rule (issue 38): proves that a rule with two constants is its own file,
its kernel file and its test.

    m = beta * m + (1 - beta) * g;  w = w * (1 - lr * wd) - lr * (scale * sign(m))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ... import ops
from ...ops.op_args import LrWd, ShardOperands, UpdateArgs
from ...ops.step_plan import StepPlan
from ..verify.float64_update import Float64Inputs, Float64Update, rounding_bound
from .base import UpdateRule, constant


@dataclass(frozen=True, kw_only=True)
class SignumStep(UpdateArgs):
    """Signum's pass 2; shard state: (exp_avg,)."""

    op: ClassVar[str] = "signum_step"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg",)
    kernel_constants: ClassVar[tuple[str, ...]] = ("beta", "scale")  # csrc/rules/signum.cu's Args
    rule: "Signum"

    def reference_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        lr, weight_decay, param_out = lr_wd.lr, lr_wd.weight_decay, shard.param_out
        g = shard.grad[a:b].float() * self.grad_scale
        m, w = shard.state[0][a:b], shard.master[a:b]
        m.lerp_(g, 1 - self.rule.beta)
        direction = m.sign() * self.rule.scale
        for s, e, gid in shard.table.group_runs():
            w_run = w[s - a : e - a]
            decay = lr[gid] * weight_decay[gid]
            if decay != 0:
                w_run.mul_(1 - decay)
            w_run.sub_(direction[s - a : e - a], alpha=lr[gid])
        if param_out is not None:
            param_out[a:b].copy_(w)

    def check(self, plan: StepPlan) -> None:
        if len(plan.state_dtypes) != 1:
            raise ValueError(f"signum_step: a plan for Signum holds one state per shard (exp_avg), this one has "
                             f"{len(plan.state_dtypes)}")
        super().check(plan)


def recompute(inp: Float64Inputs, beta: float, scale: float) -> Float64Update:
    """Signum in float64. Where |m'| is within its rounding bound of 0, fp32 may see another sign: w' may then
    differ by up to 2 lr scale, which the bound allows."""
    w, g, m = inp.master, inp.grad, inp.state["exp_avg"]
    m_new = beta * m + (1 - beta) * g
    dm = rounding_bound(beta * m, (1 - beta) * g)
    sign_may_differ = m_new.abs() <= dm
    step = inp.lr * scale
    w_new = w * (1 - inp.lr * inp.weight_decay) - step * m_new.sign()
    dw = rounding_bound(w, torch.full_like(w, step)) + sign_may_differ * (2 * step)
    return Float64Update({"master": w_new, "exp_avg": m_new}, {"master": dw, "exp_avg": dm})


@dataclass(frozen=True)
class Signum(UpdateRule):
    """The sign of an EMA of the gradients, times ``scale``, with decoupled weight decay."""

    beta: float = constant(0.9, "signum_beta", low=0, high=1, help="Signum's momentum")
    scale: float = constant(1.0, "signum_scale", low=0, low_open=True, help="Signum's step scale")
    name: ClassVar[str] = "signum"
    op_record: ClassVar[type] = SignumStep

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"exp_avg": torch.float32}

    def apply(self, plan: StepPlan, *, lr_wd: ops.LrWdTable, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        ops.update(plan, SignumStep(rule=self, grad_scale=grad_scale, found_inf=found_inf), lr_wd=lr_wd,
                   backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return recompute(inputs, self.beta, self.scale)


__all__ = ["Signum", "SignumStep", "recompute"]
