"""UpdateRule: the base of every update rule, built in (adamw.py, sgd.py, lion.py) or the user's own.

A rule declares its state tensors and their dtypes, what it needs to see of the params (``needs``),
and runs pass 2 over a step plan; everything that walks optimizer state (skips, state dicts,
checkpoints) reads ``state_dtypes`` and needs no change for a new rule. docs/design.md ("Update
rules") says how to add one.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import asdict, is_dataclass
from typing import Any, ClassVar, Optional

import torch

from ... import ops
from ...ops.step_plan import StepPlan
from ..verify.float64_update import Float64Inputs, Float64Update


class Needs(enum.Enum):
    """What of the params a rule's update reads at once.

    ELEMENTWISE: each element on its own (AdamW, SGD, Lion): any owned range of a flat shard can be
    updated alone, so a rank updates exactly the element ranges it owns.
    WHOLE_TENSORS: each param as a whole tensor (a matrix rule such as Muon's Newton-Schulz): the step
    must hand the rule full matrices, assembled from the owners of their ranges (docs/design.md,
    "Rules that need whole tensors"). Declared, not yet run: the optimizer refuses such a rule.
    """

    ELEMENTWISE = "elementwise"
    WHOLE_TENSORS = "whole tensors"


class UpdateRule(abc.ABC):
    """One optimizer's update on a flat fp32 master shard."""

    name: ClassVar[str]  # OptimizerConfig.optimizer value (registry.py lists the built-in ones)
    needs: ClassVar[Needs] = Needs.ELEMENTWISE

    @classmethod
    def from_config(cls, config: Any) -> "UpdateRule":
        """The rule with the hyperparameters an OptimizerConfig gives it (default: the rule's own defaults)."""
        return cls()

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
        update; a nonzero device flag ``found_inf`` means: write nothing (a step decided on the device).
        An elementwise rule builds its op record and calls ``ops.update(plan, record, lr_wd=lr_wd,
        backend=backend)``."""

    def hyperparameters(self) -> dict[str, Any]:
        """The rule's constants, recorded in state dicts for inspection (a load keeps the running
        rule's own constants, as torch.optim keeps the constructor's defaults for new groups)."""
        return asdict(self) if is_dataclass(self) else {}

    def float64_update(self, inputs: Float64Inputs) -> Optional[Float64Update]:
        """This rule's update of ``inputs`` recomputed in float64, with a per-element bound on the
        error of fp32 arithmetic (optimizer/verify/float64_update.py): what verify mode's ``update`` check
        compares pass 2 with. None: the rule has none, and verify mode refuses to run with it."""
        return None


__all__ = ["UpdateRule", "Needs"]
