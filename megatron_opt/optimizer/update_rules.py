"""Update rules: what pass 2 does to a master shard, one class each.

A rule declares its state tensors and their dtypes, allocates them for a shard, and dispatches
pass 2 to ``megatron_opt.ops`` (reference, CPU or CUDA, by the backend it is given). Adding a rule
is one class here plus its op: a front in ``ops/__init__.py``, an argument record in ``ops/op_args.py``
and the backend functions in ``ops.reference`` / ``ops.cpu`` / ``ops.cuda`` (run over a StepPlan); everything
that walks optimizer state (skips, state dicts, checkpoints) reads ``state_dtypes`` and needs no change.
"""
from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, ClassVar, Optional

import torch

from .. import ops
from ..ops.step_plan import StepPlan
from . import float64_update as f64
from .float64_update import Float64Inputs, Float64Update


class UpdateRule(abc.ABC):
    """One optimizer's update on a flat fp32 master shard."""

    name: ClassVar[str]  # OptimizerConfig.optimizer value

    @abc.abstractmethod
    def state_dtypes(self) -> dict[str, torch.dtype]:
        """The state tensors this rule keeps per owned element, by name, with their dtypes."""

    def init_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-initialised state for one shard (what torch.optim's lazy init produces)."""
        return {n: torch.zeros(master.shape, dtype=d, device=master.device) for n, d in self.state_dtypes().items()}

    @abc.abstractmethod
    def apply(self, plan: StepPlan, *, lr_wd: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        """Pass 2 over every shard of ``plan`` (whose shard state is ``state_dtypes()``'s tensors, in
        that order). ``lr_wd``: [param groups, 2] (lr, weight decay) on the plan's device; the grads
        are multiplied by ``grad_scale``, the one fp32 device multiplier that already holds the
        unscale factor, 1/loss scale and the clip coefficient; ``step`` is the 1-based index of this
        update; a nonzero device flag ``found_inf`` means: write nothing (a step decided on the device)."""

    def hyperparameters(self) -> dict[str, Any]:
        """The rule's constants, recorded in state dicts for inspection (a load keeps the running
        rule's own constants, as torch.optim keeps the constructor's defaults for new groups)."""
        return asdict(self) if is_dataclass(self) else {}

    def float64_update(self, inputs: Float64Inputs) -> Optional[Float64Update]:
        """This rule's update of ``inputs`` recomputed in float64, with a per-element bound on the
        error of fp32 arithmetic (optimizer/float64_update.py): what verify mode's ``update`` check
        compares pass 2 with. None: the rule has none, and verify mode refuses to run with it."""
        return None


@dataclass(frozen=True)
class AdamW(UpdateRule):
    """torch.optim.AdamW's formula (decoupled weight decay); Megatron-LM's optimizer='adam'.

    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (Megatron-LM's precision-aware optimizer) store the
    moments in bf16 or fp16: pass 2 widens them to fp32, updates and rounds once on store, to
    nearest even or, with ``stochastic_rounding``, stochastically (bf16 moments only).
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        for field_name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, field_name) not in ops.STATE_DTYPES:
                raise ValueError(f"AdamW.{field_name}={getattr(self, field_name)}: use one of {ops.STATE_DTYPES}.")

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype}

    def hyperparameters(self) -> dict[str, Any]:
        out = super().hyperparameters()
        return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in out.items()}

    def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None) -> None:
        ops.adamw_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step, beta1=self.beta1,
                               beta2=self.beta2, eps=self.eps, found_inf=found_inf,
                               stochastic_rounding=self.stochastic_rounding, backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return f64.adamw(inputs, self.beta1, self.beta2, self.eps)


@dataclass(frozen=True)
class SGD(UpdateRule):
    """torch.optim.SGD's formula (L2 weight decay, dampening 0); no state without momentum."""

    momentum: float = 0.9
    nesterov: bool = False
    name: ClassVar[str] = "sgd"

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"momentum_buffer": torch.float32} if self.momentum != 0 else {}

    def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None) -> None:
        ops.sgd_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, momentum=self.momentum,
                             nesterov=self.nesterov, found_inf=found_inf, backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return f64.sgd(inputs, self.momentum, self.nesterov)


@dataclass(frozen=True)
class Lion(UpdateRule):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay."""

    beta1: float = 0.95
    beta2: float = 0.98
    name: ClassVar[str] = "lion"

    def state_dtypes(self) -> dict[str, torch.dtype]:
        return {"exp_avg": torch.float32}

    def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None) -> None:
        ops.lion_step_planned(plan, lr_wd=lr_wd, grad_scale=grad_scale, beta1=self.beta1, beta2=self.beta2,
                              found_inf=found_inf, backend=backend)

    def float64_update(self, inputs: Float64Inputs) -> Float64Update:
        return f64.lion(inputs, self.beta1, self.beta2)


UPDATE_RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (AdamW, SGD, Lion)}


def update_rule_from_config(config: Any) -> UpdateRule:
    """The rule an OptimizerConfig asks for, with its hyperparameters."""
    if config.optimizer == "adam":
        return AdamW(beta1=config.adam_beta1, beta2=config.adam_beta2, eps=config.adam_eps,
                     exp_avg_dtype=getattr(config, "exp_avg_dtype", torch.float32),
                     exp_avg_sq_dtype=getattr(config, "exp_avg_sq_dtype", torch.float32),
                     stochastic_rounding=getattr(config, "stochastic_rounding", False))
    if config.optimizer == "sgd":
        return SGD(momentum=config.sgd_momentum)
    if config.optimizer == "lion":
        return Lion(beta1=config.lion_beta1, beta2=config.lion_beta2)
    raise ValueError(f"no update rule named {config.optimizer!r}; known: {sorted(UPDATE_RULES)}.")


__all__ = ["UpdateRule", "AdamW", "SGD", "Lion", "UPDATE_RULES", "update_rule_from_config"]
