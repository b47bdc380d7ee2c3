"""Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay; optimizer='lion'.
The rule, its pass-2 op on every backend (``LionStep``: reference, the CUDA kernel ``csrc/rules/lion.cu``;
on the CPU the reference, already one pass of vector ops: torch has no fused Lion) and its float64
recomputation (``recompute``).

    c = beta1 * m + (1 - beta1) * g;  w = w * (1 - lr * wd) - lr * sign(c);  m = beta2 * m + (1 - beta2) * g
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from ... import ops
from ...ops.op_args import LrWd, ShardOperands, UpdateArgs
from ...ops.step_plan import StepPlan
from ..verify.float64_update import Float64Inputs, Float64Update, rounding_bound
from .base import UpdateRule, constant, is_matrix_param

LION_SCOPES = ("all", "matrices")


@dataclass(frozen=True, kw_only=True)
class LionStep(UpdateArgs):
    """Lion's pass 2; shard state: (exp_avg,). Gap elements of master, exp_avg and param_out are left
    bitwise unchanged."""

    op: ClassVar[str] = "lion_step"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg",)
    kernel_constants: ClassVar[tuple[str, ...]] = ("beta1", "beta2")  # csrc/rules/lion.cu's Args
    rule: "Lion"

    def reference_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        lr, weight_decay, param_out = lr_wd.lr, lr_wd.weight_decay, shard.param_out
        g = shard.grad[a:b].float() * self.grad_scale
        m, w = shard.state[0][a:b], shard.master[a:b]
        direction = m.lerp(g, 1 - self.rule.beta1).sign_()
        for s, e, gid in shard.table.group_runs():
            w_run = w[s - a : e - a]
            decay = lr[gid] * weight_decay[gid]
            if decay != 0:
                w_run.mul_(1 - decay)
            w_run.sub_(direction[s - a : e - a], alpha=lr[gid])
        m.lerp_(g, 1 - self.rule.beta2)
        if param_out is not None:
            param_out[a:b].copy_(w)

    def check(self, plan: StepPlan) -> None:
        if len(plan.state_dtypes) != 1:
            raise ValueError(f"lion_step: a plan for Lion holds one state per shard (exp_avg), this one has "
                             f"{len(plan.state_dtypes)}")
        super().check(plan)


def recompute(inp: Float64Inputs, beta1: float, beta2: float) -> Float64Update:
    """Lion in float64. Where |c| is within its rounding bound of 0, fp32 may see another sign: w' may
    then differ by up to 2 lr, which the bound allows."""
    w, g, m = inp.master, inp.grad, inp.state["exp_avg"]
    c = beta1 * m + (1 - beta1) * g
    sign_may_differ = c.abs() <= rounding_bound(m, g)
    w_new = w * (1 - inp.lr * inp.weight_decay) - inp.lr * c.sign()
    dw = rounding_bound(w, torch.full_like(w, inp.lr)) + sign_may_differ * (2 * inp.lr)
    m_new = beta2 * m + (1 - beta2) * g
    return Float64Update({"master": w_new, "exp_avg": m_new}, {"master": dw, "exp_avg": rounding_bound(m, g)})


@dataclass(frozen=True)
class Lion(UpdateRule):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay."""

    # megatron-core 0.19's names and defaults (Megatron-LM's --lion-beta1 / --lion-beta2)
    beta1: float = constant(0.95, "lion_beta1", low=0, high=1, high_open=False)  # the interpolation for the sign
    beta2: float = constant(0.98, "lion_beta2", low=0, high=1, high_open=False)  # the momentum decay
    # Which params: 'all', or megatron-core's optimizer='lion' (0.19, Megatron-LM main): 'matrices', the 2-D weights
    # that are not embedding or output, AdamW the rest (install() converts megatron-core's config to it, with the
    # Adam betas, which megatron-core's Lion reads: config_conversion.py).
    scope: str = constant("all", "lion_scope", choices=LION_SCOPES,
                          help="the params Lion updates: all, or matrices (megatron-core's optimizer='lion': the 2-D "
                               "weights that are not embedding or output; AdamW the rest)")
    name: ClassVar[str] = "lion"
    op_record: ClassVar[type] = LionStep

    def param_split(self) -> Optional[Callable[[torch.Tensor], bool]]:
        return is_matrix_param if self.scope == "matrices" else None

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"exp_avg": torch.float32}

    def apply(self, plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        ops.update(plan, LionStep(rule=self, grad_scale=grad_scale, found_inf=found_inf), lr_wd=lr_wd, backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return recompute(inputs, self.beta1, self.beta2)


__all__ = ["Lion", "LionStep", "recompute", "LION_SCOPES"]
