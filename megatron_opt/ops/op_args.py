"""What the ops take: the one front (``ops/__init__.py``) runs a pass over every shard of a
``StepPlan``; these frozen records carry the rest.

* ``ShardOperands``: one shard's flat tensors (the rows of a ``StepPlan`` are these).
* ``LrWd``: per param group lr and weight decay as host numbers (what the torch backends read; the
  CUDA kernels read the same values as a float64 ``[groups, 2]`` device table instead).
* ``LrWdTable``: one step's lr and weight decay both ways, the device table and its host values, in one
  named object (the host values never ride on the tensor).
* ``StatsArgs``: pass 1's scalars.
* ``UpdateArgs``: pass 2's per-step device scalars and the rule whose constants it reads, the base of each
  update rule's op record. A rule subclasses it once (``optimizer/rules/<rule>.py``) with its math and
  the data its kernel takes: ``reference_span`` (the spec, torch ops), optionally ``cpu_span`` (torch's
  fused CPU kernels), ``kernel_constants`` (the rule's constants its compiled kernel reads, in order;
  ``kernel_call`` turns them into a ``KernelCall``) and ``check(plan)``, its operand checks on the CUDA path.

Dispatch goes one way: the rule builds its op record and hands it to the front (``ops.update``), which
picks the backend; a backend reads the record (its math, its ``KernelCall``) and never calls the front
or the rule back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

import torch

from .common import gaps_kept, update_span
from .operand_checks import check_scalar, check_update_operands
from .piece_table import PieceTable

if TYPE_CHECKING:
    from .step_plan import StepPlan


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
class LrWdTable:
    """One step's lr and weight decay per param group, both ways: ``table``, the ``[groups, 2]`` float64
    (lr, weight decay) tensor the CUDA kernels read on the device, and ``host``, the same values as host
    numbers, kept from when they were staged (float64 both ways, so bitwise the table's), which the torch
    backends read without a device read. ``pinned_source``: the pinned host copy an asynchronous upload
    reads (kept alive with the table: a CUDA graph replay reads it again)."""

    table: torch.Tensor
    host: LrWd
    pinned_source: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, lr_wd: "LrWdTable | torch.Tensor") -> "LrWdTable":
        """``lr_wd`` itself, or a bare ``[groups, 2]`` table with its values read back from the device."""
        return lr_wd if isinstance(lr_wd, LrWdTable) else cls(lr_wd, LrWd.from_table(lr_wd))


@dataclass(frozen=True)
class KernelCall:
    """What the CUDA backend hands a rule's registered kernel besides the plan's tables (one launch):
    the rule's constants in the order the kernel's ``Args`` reads them, the device update counter for a
    kernel that reads it, and whether 16-bit state is rounded stochastically."""

    constants: tuple[float, ...]
    step: Optional[torch.Tensor] = None
    stochastic: bool = False


@dataclass(frozen=True)
class StatsArgs:
    """Pass 1: ``stats += [non-finite count, sum of (grad*inv_scale)^2 over in-norm pieces, zero count]``."""

    inv_scale: torch.Tensor
    stats: torch.Tensor
    count_zeros: bool = True


@dataclass(frozen=True, kw_only=True)
class UpdateArgs:
    """What every pass-2 op takes per step: ``rule``, the update rule whose constants the op reads (its
    op record never copies them), ``grad_scale``, the one fp32 gradient multiplier (unscale factor,
    1/loss scale and clip coefficient folded in), and ``found_inf``, a device flag that, when nonzero,
    makes the op write nothing. A rule's op record adds its math and what its kernel takes."""

    op: ClassVar[str]  # the op's name: the compiled kernel's registered name, and the prefix of its error messages
    state_names: ClassVar[tuple[str, ...]] = ()  # the shard state, in order (named in error messages)
    precision_aware: ClassVar[bool] = False  # 16-bit state and float16 / int16-remainder masters allowed
    # The rule's constants its compiled kernel (csrc/rules/<rule>.cu, registered as ``op``) reads, in the
    # order of its Args; None: no kernel (the CUDA backend runs the reference on the CUDA tensors).
    kernel_constants: ClassVar[Optional[tuple[str, ...]]] = None
    rule: Any  # the UpdateRule (ops/ imports nothing from optimizer/)
    grad_scale: torch.Tensor
    found_inf: Optional[torch.Tensor] = None

    def reference(self, shard: ShardOperands, lr_wd: LrWd) -> None:
        """Pass 2 on one shard with torch ops: the behavioural spec every other backend matches."""
        self._over_span(shard, lr_wd, self.reference_span)

    def cpu(self, shard: ShardOperands, lr_wd: LrWd) -> None:
        """Pass 2 on one CPU shard (``cpu_span``)."""
        self._over_span(shard, lr_wd, self.cpu_span)

    def reference_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        """The rule's torch ops over elements [a, b) of the shard (the span of its pieces, gaps
        included: their elements are put back afterwards); ``lr_wd`` indexed by the table's group ids."""
        raise NotImplementedError(f"{type(self).__name__} has no reference implementation")

    def cpu_span(self, shard: ShardOperands, lr_wd: LrWd, a: int, b: int) -> None:
        """A faster CPU version of ``reference_span`` (default: the reference itself)."""
        self.reference_span(shard, lr_wd, a, b)

    def _over_span(self, shard: ShardOperands, lr_wd: LrWd, run: Callable[[ShardOperands, LrWd, int, int], None]
                   ) -> None:
        """``run`` over the span of the shard's pieces, unless there is none or ``found_inf`` is set; the
        torch ops sweep whole runs, so the gap elements of every output are put back afterwards."""
        span = update_span(shard, self)
        if span is None:
            return
        with gaps_kept(shard.table, shard.master, *shard.state, shard.param_out):
            run(shard, lr_wd, *span)

    def check(self, plan: "StepPlan") -> None:
        """The operand checks before a CUDA launch: each shard's tensors by name (once per plan) and the
        rule's device scalars (every call). A rule with more scalars or constraints extends it."""
        device = plan.device

        def operands() -> None:
            for s in plan.shards:
                check_update_operands(self.op, device, s.table, s.grad, s.master,
                                      dict(zip(self.state_names, s.state)), s.param_out, {},
                                      precision_aware=self.precision_aware,
                                      rule=type(self).__name__.removesuffix("Step"))

        plan.check_once(self.op, operands)
        check_scalar(f"{self.op}: grad_scale", self.grad_scale, device, torch.float32)
        if self.found_inf is not None:
            check_scalar(f"{self.op}: found_inf", self.found_inf, device, torch.float32)

    def kernel_call(self, plan: "StepPlan") -> Optional[KernelCall]:
        """The launch of the compiled kernel for ``plan``, or None (no kernel, or none for this plan's
        dtypes): the rule's ``kernel_constants`` read from the rule, as floats."""
        if self.kernel_constants is None:
            return None
        return KernelCall(tuple(float(getattr(self.rule, name)) for name in self.kernel_constants))


__all__ = ["ShardOperands", "LrWd", "LrWdTable", "KernelCall", "StatsArgs", "UpdateArgs"]
