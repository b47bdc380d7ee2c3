"""SGD: torch.optim.SGD's formula (L2 weight decay, dampening 0, optional Nesterov); Megatron-LM's
optimizer='sgd'. The rule, its pass-2 op on every backend (``SGDStep``: reference, the CUDA kernel
``csrc/rules/sgd.cu``; on the CPU the reference) and its float64 recomputation (``recompute``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ... import ops
from ...ops.op_args import LrWd, ShardOperands, UpdateArgs
from ...ops.step_plan import StepPlan
from ..verify.float64_update import Float64Inputs, Float64Update, rounding_bound
from .base import UpdateRule, constant


@dataclass(frozen=True, kw_only=True)
class SGDStep(UpdateArgs):
    """SGD's pass 2; shard state: (momentum_buffer,) when momentum != 0, else () (a buffer there is
    then ignored by the torch backends). A zero-initialised buffer reproduces torch's first step (buf = g)."""

    op: ClassVar[str] = "sgd_step"
    state_names: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    kernel_constants: ClassVar[tuple[str, ...]] = ("momentum", "nesterov")  # csrc/rules/sgd.cu's Args
    rule: "SGD"

    def reference_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        momentum, table, param_out = self.rule.momentum, shard.table, shard.param_out
        lr, weight_decay = lr_wd.lr, lr_wd.weight_decay
        g = shard.grad[a:b].float() * self.grad_scale
        w = shard.master[a:b]
        for s, e, gid in table.group_runs():
            sl = slice(s - a, e - a)
            if weight_decay[gid] != 0:
                g[sl].add_(w[sl], alpha=weight_decay[gid])
        if momentum != 0:
            buf = shard.state[0][a:b]
            buf.mul_(momentum).add_(g)
            direction = g.add(buf, alpha=momentum) if self.rule.nesterov else buf
        else:
            direction = g
        for s, e, gid in table.group_runs():
            sl = slice(s - a, e - a)
            w[sl].sub_(direction[sl], alpha=lr[gid])
        if param_out is not None:
            param_out[a:b].copy_(w)

    def reference(self, shard: ShardOperands, lr_wd: LrWd) -> None:
        if self.rule.momentum != 0 and not shard.state:
            raise ValueError("sgd_step: momentum != 0 needs a momentum buffer")
        super().reference(shard, lr_wd)

    def check(self, plan: StepPlan) -> None:
        if len(plan.state_dtypes) > 1 or (self.rule.momentum != 0 and not plan.state_dtypes):
            raise ValueError("sgd_step: momentum != 0 needs a momentum buffer (one per shard); without momentum a "
                             "buffer is optional and ignored")
        super().check(plan)  # an unused buffer is still checked


def recompute(inp: Float64Inputs, momentum: float, nesterov: bool) -> Float64Update:
    """SGD in float64:  g' = g + wd w;  b' = mu b + g';  d = g' + mu b' (Nesterov) or b';  w' = w - lr d."""
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


@dataclass(frozen=True)
class SGD(UpdateRule):
    """torch.optim.SGD's formula (L2 weight decay, dampening 0); no state without momentum."""

    momentum: float = constant(0.9, "sgd_momentum", low=0, high=1)
    nesterov: bool = False
    name: ClassVar[str] = "sgd"
    op_record: ClassVar[type] = SGDStep

    def torch_group_fields(self) -> dict[str, Any]:
        """torch.optim.SGD's param-group fields (megatron-core's inner optimizer)."""
        return {"momentum": self.momentum, "nesterov": self.nesterov, "dampening": 0.0, "maximize": False,
                "foreach": None, "differentiable": False, "fused": None}

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"momentum_buffer": torch.float32} if self.momentum != 0 else {}

    def apply(self, plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        ops.update(plan, SGDStep(rule=self, grad_scale=grad_scale, found_inf=found_inf), lr_wd=lr_wd, backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return recompute(inputs, self.momentum, self.nesterov)


__all__ = ["SGD", "SGDStep", "recompute"]
