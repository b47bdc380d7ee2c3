"""AdamW: torch.optim.AdamW's formula (decoupled weight decay); Megatron-LM's optimizer='adam'.

Everything of the rule in one file: the rule (``AdamW``), its pass-2 op on every backend
(``AdamWStep``: reference, CPU on torch._fused_adamw_, the CUDA kernel ``csrc/rules/adamw.cu``) and
its float64 recomputation for verify mode (``recompute``).

Precision-aware state (ops/precision.py): the moments may be fp32, bf16 or fp16 and the master fp32,
fp16 or an int16 remainder of the bf16 ``param_out``. Every element is widened to fp32, updated with
the same fp32 arithmetic, and rounded once on store (to nearest even, or stochastically for bf16
moments with ``stochastic_rounding``). The kernel handles the moment pairs in
``precision.KERNEL_MOMENT_PAIRS``; for any other pair the CUDA backend runs the reference shard by
shard on the same CUDA tensors (same results; it reads ``found_inf`` and ``step`` on the host, so it
syncs and cannot be captured in a CUDA graph).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ... import ops
from ...ops import precision
from ...ops.op_args import KernelCall, LrWd, ShardOperands, UpdateArgs
from ...ops.operand_checks import check_scalar
from ...ops.precision import KERNEL_MOMENT_PAIRS
from ...ops.step_plan import StepPlan
from ..verify.float64_update import FP32_SUBNORMAL, TERM_ROUNDING, UNDERFLOW, Float64Inputs, Float64Update
from .base import UpdateRule, constant

_K, _C = TERM_ROUNDING, UNDERFLOW
# The CPU pass runs over about this many elements at a time (a multiple of every vector width): its
# scaled copy of the gradient then stays small and is reused by the allocator, where a shard-sized copy is
# a fresh allocation every step whose page faults cost 3x the fused update itself (25M elements: 45 ms
# against 13 ms).
CPU_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class AdamWStep(UpdateArgs):
    """AdamW's pass 2 (``rule``: the ``AdamW`` whose constants it reads); ``step`` is the 1-based index of
    this update (already advanced). Shard state: (exp_avg, exp_avg_sq)."""

    op: ClassVar[str] = "adamw_step"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    precision_aware: ClassVar[bool] = True
    kernel_constants: ClassVar[tuple[str, ...]] = ("beta1", "beta2", "eps")  # csrc/rules/adamw.cu's Args
    rule: "AdamW"
    step: torch.Tensor

    def reference_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        """``param_out`` (model dtype) receives the rounded master; it is None when the master aliases an
        fp32 param."""
        master, param_out, exp_avg, exp_avg_sq = shard.master, shard.param_out, shard.state[0], shard.state[1]
        lr, weight_decay, beta1, beta2, step = lr_wd.lr, lr_wd.weight_decay, self.rule.beta1, self.rule.beta2, self.step
        g = shard.grad[a:b].float() * self.grad_scale  # a new tensor: never scale the persistent grad buffer
        m, v = exp_avg[a:b].float(), exp_avg_sq[a:b].float()  # .float() of fp32 is the tensor itself
        w = precision.load_master(master[a:b], None if param_out is None else param_out[a:b])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = step.double().reshape(())
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = (1 - beta2**t).sqrt()
        update = m / (v.sqrt() / bias_correction2_sqrt.float()).add_(self.rule.eps)
        for s, e, gid in shard.table.group_runs():
            w_run = w[s - a : e - a]
            decay = lr[gid] * weight_decay[gid]
            if decay != 0:
                w_run.mul_(1 - decay)
            w_run.sub_(update[s - a : e - a] * (lr[gid] / bias_correction1).float())
        self._store_moments(m, v, exp_avg, exp_avg_sq, a, b)
        precision.store_master(w, master[a:b], None if param_out is None else param_out[a:b])

    def cpu_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        """torch._fused_adamw_ (one fused loop per param group) over chunks of about ``CPU_CHUNK``
        elements, each on a scaled copy of that part of the gradient (the grad buffer is never written)."""
        step_f = self.step.to(torch.float32).reshape(())
        chunk: list[tuple[int, int, int]] = []
        size = 0
        for s, e, gid in shard.table.group_runs():
            # Cut each run at multiples of CPU_CHUNK from its own start: the fused loop then takes the same
            # elements on its vector and its scalar path as for the whole run, so the bits do not change.
            for lo in range(s, e, CPU_CHUNK):
                hi = min(e, lo + CPU_CHUNK)
                chunk.append((lo, hi, gid))
                size += hi - lo
                if size >= CPU_CHUNK:
                    self._cpu_chunk(shard, lr_wd, chunk, step_f)
                    chunk, size = [], 0
        if chunk:
            self._cpu_chunk(shard, lr_wd, chunk, step_f)

    def _cpu_chunk(self, shard: ShardOperands, lr_wd: LrWd, runs: list[tuple[int, int, int]],
                   step_f: torch.Tensor) -> None:
        a, b = runs[0][0], runs[-1][1]
        g = shard.grad[a:b].float() * self.grad_scale  # a new tensor: the grad buffer is never written
        by_group: dict[int, list] = {}
        for s, e, gid in runs:
            by_group.setdefault(gid, []).append((s - a, e - a))
        master, param_out, exp_avg, exp_avg_sq = shard.master, shard.param_out, shard.state[0], shard.state[1]
        po = None if param_out is None else param_out[a:b]
        # 16-bit state: torch's fused loop needs fp32 params and state, so it runs on widened
        # copies (views when already fp32), which are rounded back once afterwards.
        w, m, v = precision.load_master(master[a:b], po), exp_avg[a:b].float(), exp_avg_sq[a:b].float()
        for gid, group in by_group.items():
            torch._fused_adamw_(
                [w[s:e] for s, e in group], [g[s:e] for s, e in group], [m[s:e] for s, e in group],
                [v[s:e] for s, e in group], [], [step_f] * len(group), lr=float(lr_wd.lr[gid]),
                beta1=self.rule.beta1, beta2=self.rule.beta2, weight_decay=float(lr_wd.weight_decay[gid]),
                eps=self.rule.eps, amsgrad=False, maximize=False,
            )
        self._store_moments(m, v, exp_avg, exp_avg_sq, a, b)
        precision.store_master(w, master[a:b], po)

    def _store_moments(self, m: torch.Tensor, v: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       a: int, b: int) -> None:
        """Round 16-bit moments once on store (fp32 moments were updated in place)."""
        if exp_avg.dtype == torch.float32 and exp_avg_sq.dtype == torch.float32:
            return
        sr = self.rule.stochastic_rounding
        index = torch.arange(a, b, device=m.device) if sr else None
        step_i = int(self.step.reshape(())) if sr else 0
        precision.store_state(m, exp_avg[a:b], stochastic=sr, index=index, step=step_i, slot=0)
        precision.store_state(v, exp_avg_sq[a:b], stochastic=sr, index=index, step=step_i, slot=1)

    def check(self, plan: StepPlan) -> None:
        if len(plan.state_dtypes) != 2:
            raise ValueError(f"adamw_step: a plan for AdamW holds two states per shard (exp_avg, exp_avg_sq), "
                             f"this one has {len(plan.state_dtypes)}")
        super().check(plan)
        check_scalar(f"{self.op}: step", self.step, plan.device, torch.int64)

    def kernel_call(self, plan: StepPlan) -> Optional[KernelCall]:
        """The kernel takes the moment pairs of ``precision.KERNEL_MOMENT_PAIRS`` (and reads the update
        counter and the rounding); other pairs run the reference on the CUDA tensors."""
        if plan.state_dtypes not in KERNEL_MOMENT_PAIRS:
            return None
        return dataclasses.replace(super().kernel_call(plan), step=self.step,
                                   stochastic=self.rule.stochastic_rounding)


def recompute(inp: Float64Inputs, beta1: float, beta2: float, eps: float) -> Float64Update:
    """AdamW in float64:  m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g^2;  D = sqrt(v') / sqrt(1-b2^t) + eps;
    w' = w (1 - lr wd) - lr / (1-b1^t) * m' / D, with the bound of each term's fp32 rounding."""
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


@dataclass(frozen=True)
class AdamW(UpdateRule):
    """torch.optim.AdamW's formula (decoupled weight decay); Megatron-LM's optimizer='adam'.

    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (Megatron-LM's precision-aware optimizer) store the
    moments in bf16 or fp16: pass 2 widens them to fp32, updates and rounds once on store, to
    nearest even or, with ``stochastic_rounding``, stochastically (bf16 moments only).
    """

    beta1: float = constant(0.9, "adam_beta1", low=0, high=1)
    beta2: float = constant(0.999, "adam_beta2", low=0, high=1,
                            hint="adam_beta2=1 divides by zero in the bias correction")
    eps: float = constant(1e-8, "adam_eps", low=0)
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    name: ClassVar[str] = "adam"
    op_record: ClassVar[type] = AdamWStep
    precision_aware: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for field_name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, field_name) not in ops.STATE_DTYPES:
                raise ValueError(f"AdamW.{field_name}={getattr(self, field_name)}: use one of {ops.STATE_DTYPES}.")

    @classmethod
    def from_config(cls, config: Any) -> "AdamW":
        cls.check_config(config)
        return cls(**cls.constants_from(config), exp_avg_dtype=getattr(config, "exp_avg_dtype", torch.float32),
                   exp_avg_sq_dtype=getattr(config, "exp_avg_sq_dtype", torch.float32),
                   stochastic_rounding=getattr(config, "stochastic_rounding", False))

    def torch_group_fields(self) -> dict[str, Any]:
        """torch.optim.AdamW's param-group fields (megatron-core's inner optimizer)."""
        return {"betas": (self.beta1, self.beta2), "eps": self.eps, "bias_correction": True, "amsgrad": False,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                "decoupled_weight_decay": True}

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype}

    def apply(self, plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        ops.update(plan, AdamWStep(rule=self, grad_scale=grad_scale, found_inf=found_inf, step=step), lr_wd=lr_wd,
                   backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return recompute(inputs, self.beta1, self.beta2, self.eps)


__all__ = ["AdamW", "AdamWStep", "recompute"]
