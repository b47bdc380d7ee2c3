"""What the backends take: the typed fronts (``ops/__init__.py``) own every op's signature and pack
their arguments into the frozen records below, so each backend function is
``op(shard, args)`` (pass 1) or ``op(shard, lr_wd, args)`` (pass 2), and each planned one
``op_planned(plan, args)`` / ``op_planned(plan, lr_wd, args)``.

* ``ShardOperands``: one shard's flat tensors (the rows of a ``StepPlan`` are these).
* ``LrWd``: per param group lr and weight decay as host numbers (single-shard ops; the planned ops
  take the same values as a float64 ``[groups, 2]`` device table instead).
* ``StatsArgs``: pass 1's scalars; ``AdamWArgs``, ``SGDArgs``, ``LionArgs``: pass 2's, the per-step
  device scalars (``UpdateArgs``) plus the rule's constants.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from .piece_table import PieceTable


@dataclass(frozen=True)
class ShardOperands:
    """One shard's flat tensors for a step: the table's coordinates index them directly."""

    table: PieceTable
    grad: torch.Tensor
    master: Optional[torch.Tensor] = None  # None for a stats-only plan
    state: tuple[torch.Tensor, ...] = ()
    param_out: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class LrWd:
    """lr and weight decay per param group, indexed by the piece table's group ids."""

    lr: Sequence[float]
    weight_decay: Sequence[float]

    @classmethod
    def from_table(cls, lr_wd: torch.Tensor) -> "LrWd":
        """The host values of a ``[groups, 2]`` (lr, weight decay) table (a host read)."""
        pairs = lr_wd.tolist()
        return cls([p[0] for p in pairs], [p[1] for p in pairs])


@dataclass(frozen=True)
class StatsArgs:
    """Pass 1: ``stats += [non-finite count, sum of (grad*inv_scale)^2 over in-norm pieces, zero count]``."""

    inv_scale: torch.Tensor
    stats: torch.Tensor
    count_zeros: bool = True


@dataclass(frozen=True, kw_only=True)
class UpdateArgs:
    """What every pass-2 op takes per step: ``grad_scale``, the one fp32 gradient multiplier (unscale
    factor, 1/loss scale and clip coefficient folded in), and ``found_inf``, a device flag that,
    when nonzero, makes the op write nothing."""

    op: ClassVar[str]  # the op's name: the backend function, and the prefix of its error messages
    grad_scale: torch.Tensor
    found_inf: Optional[torch.Tensor] = None


@dataclass(frozen=True, kw_only=True)
class AdamWArgs(UpdateArgs):
    """AdamW; ``step`` is the 1-based index of this update (already advanced). Shard state:
    (exp_avg, exp_avg_sq)."""

    op: ClassVar[str] = "adamw_step"
    step: torch.Tensor
    beta1: float
    beta2: float
    eps: float
    stochastic_rounding: bool = False


@dataclass(frozen=True, kw_only=True)
class SGDArgs(UpdateArgs):
    """SGD; shard state: (momentum_buffer,) when momentum != 0, else ()."""

    op: ClassVar[str] = "sgd_step"
    momentum: float
    nesterov: bool = False


@dataclass(frozen=True, kw_only=True)
class LionArgs(UpdateArgs):
    """Lion; shard state: (exp_avg,)."""

    op: ClassVar[str] = "lion_step"
    beta1: float
    beta2: float


__all__ = ["ShardOperands", "LrWd", "StatsArgs", "UpdateArgs", "AdamWArgs", "SGDArgs", "LionArgs"]
