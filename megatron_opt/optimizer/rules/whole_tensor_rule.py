"""WholeTensorRule: the family of update rules that read whole matrices (Muon, AdaptiveMuon), beside the
elementwise ones. One rule of the family is one file in this folder; the whole-tensor leaf
(optimizer/whole_tensor/leaf.py) runs any of them, and homes, the exchange, skips, clipping, lr / wd,
checkpoints and verify mode are the leaf's, the same for every rule (docs/design.md, "Add a whole-tensor rule").

A rule of the family declares:

* what it needs (``takes``: which params it updates, the rest going to its AdamW companion;
  ``tensor_parallel_mode``: ``blockwise`` = the TP-local block is the matrix (TP-split parts), else the
  whole matrix across the TP group);
* its state, of two kinds: elementwise state (``state_dtypes``, element-range sharded like AdamW's moments;
  ``direction_state`` names what part 1 updates, ``finish_state`` what part 3 updates) and per-matrix state
  (``matrix_state``: lives once, at the matrix's home, and is read and replaced by ``matrix_step``: SOAP's, read
  with the direction; or, ``state_follows_update``, by ``update_with_state`` after part 2's update, so it also
  runs where that update is computed across the TP group: AdaptiveMuon's NorMuon second moment);
* its cost model for the home balance (``steady_cost`` every step, ``periodic_cost`` every ``period`` steps,
  such as a preconditioner refresh; ``home_cost`` combines them) and where homes may be (``homes_anywhere``);
* its step in three parts: ``direction`` (elementwise, owned ranges), ``matrix_update`` (the whole matrix, at
  its home; ``matrix_step`` with per-matrix state), ``finish`` (elementwise, owned ranges: decay and the step);
* its float64 recomputation for verify mode (``recompute_direction``, ``matrix_tolerance``, ``recompute_finish``;
  with per-matrix state ``recompute_matrix_step``, or ``recompute_update_with_state``).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch

from ... import ops
from ...errors import UnsupportedConfigError
from ...ops.step_plan import StepPlan
from .base import Needs, UpdateRule, constant, is_matrix_param

Scalar = Union[float, torch.Tensor]  # a host float, or a 0-d device tensor (the staged lr / wd table)
TensorDict = dict[str, torch.Tensor]


def state_tp_size_constant() -> Any:
    """The declaration of ``matrix_state_tp_size`` (megatron_opt's own name: ``rule_constants``, the main job's
    ``--matrix-state-tp-size``), for the rules that keep per-matrix state (leaf.py, ``StateBlocks``)."""
    return constant(0, "matrix_state_tp_size", low=0, integer=True,
                    help="the tensor-parallel size whose blocks the per-matrix state (SOAP's, NorMuon's) belongs to: "
                         "0 = this run's; the saved run's TP size keeps its blocks at another split (a TP2 "
                         "checkpoint loads bitwise at TP1, whose SOAP then runs on those blocks)")


@dataclass(frozen=True)
class MatrixFacts:
    """What parts 3 and verify mode may read of one matrix: its (TP-local) shape, QKV split and how many
    times each dimension the orthogonalised matrix is (TP-split matrices taken whole: (tp, 1) or (1, tp))."""

    shape: tuple[int, int]
    qkv_split: Optional[tuple[int, ...]] = None
    tensor_split_multiple: tuple[int, int] = (1, 1)


class WholeTensorRule(UpdateRule):
    """The base of the whole-tensor family (see the module docstring)."""

    needs: ClassVar[Needs] = Needs.WHOLE_TENSORS
    # Whether any rank of the data-parallel group may be a matrix's home, not only its owners (homes.assign_homes):
    # for rules whose per-matrix work and state outweigh moving the whole matrix (SOAP); Muon keeps owners only.
    homes_anywhere: ClassVar[bool] = False
    direction_state: ClassVar[tuple[str, ...]] = ()  # elementwise state part 1 updates
    finish_state: ClassVar[tuple[str, ...]] = ()  # elementwise state part 3 updates
    # Whether the per-matrix state is read only after part 2's update (``update_with_state``), on the TP-local block
    # of that update, so that the update itself may be computed across the TP group (tensor_parallel_mode
    # 'duplicated' / 'distributed'). False: ``matrix_step`` reads it with the direction (SOAP's factors), which
    # only TP-local blocks may do.
    state_follows_update: ClassVar[bool] = False

    # ----------------------------------------------------------------- what it needs
    @staticmethod
    def takes(param: torch.Tensor) -> bool:
        """megatron-core's split for its matrix optimizers (``is_matrix_param``); the rest goes to AdamW."""
        return is_matrix_param(param)

    def param_split(self) -> Optional[Callable[[torch.Tensor], bool]]:
        return self.takes

    @property
    def tensor_parallel_mode(self) -> str:
        """``blockwise``: the TP-local block is the matrix; ``duplicated`` / ``distributed``: the whole matrix
        across the TP group (tensor_parallel_newton_schulz.py)."""
        return "blockwise"

    def qkv_split_of(self, name: str, param: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The rows of (Q, K, V) in one query group when the rule splits this param (None: it does not)."""
        return None

    def pieces(self, shape: Sequence[int], qkv_split: Optional[Sequence[int]]) -> int:
        """Independent problems in one matrix (the home balance counts them)."""
        return 1

    # ----------------------------------------------------------------- state
    def matrix_state(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-matrix state kept once at the matrix's home, by name: (shape, dtype). None by default."""
        return {}

    @property
    def matrix_state_tp_size(self) -> int:
        """The tensor-parallel size whose blocks the per-matrix state belongs to (0: the run's own). A rule that
        keeps per-matrix state declares ``state_tp_size`` (``state_tp_size_constant``)."""
        return int(getattr(self, "state_tp_size", 0))

    def new_matrix_state(self, shape: tuple[int, int], device: torch.device) -> TensorDict:
        """The per-matrix state before the first step (zeros by default)."""
        return {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in self.matrix_state(shape).items()}

    # ----------------------------------------------------------------- cost model (homes.assign_homes)
    @abc.abstractmethod
    def steady_cost(self, shape: tuple[float, float], pieces: int) -> float:
        """Work of one step's ``matrix_update`` on a matrix of ``shape`` made of ``pieces`` equal row blocks."""

    def periodic_cost(self, shape: tuple[float, float], pieces: int) -> tuple[float, int]:
        """(work, period): extra work every ``period`` steps (a preconditioner refresh). None by default."""
        return 0.0, 1

    def home_cost(self, shape: tuple[float, float], pieces: int) -> float:
        """The balance's cost of one matrix: the steady work plus the periodic work per step."""
        work, period = self.periodic_cost(shape, pieces)
        cost = self.steady_cost(shape, pieces)
        return cost + work / period if work else cost

    # ----------------------------------------------------------------- the step, in three parts
    @abc.abstractmethod
    def direction(self, grad: torch.Tensor, grad_scale: torch.Tensor, state: TensorDict) -> torch.Tensor:
        """Part 1 on one owned range: updates ``state`` (fp32 slices of ``direction_state``) in place and
        returns the direction the home reads (fp32)."""

    @abc.abstractmethod
    def matrix_update(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]]) -> torch.Tensor:
        """Part 2 on a whole (TP-local) matrix at its home: fp32 in, fp32 out; float64 in, float64 out."""

    def matrix_step(self, u: torch.Tensor, qkv_split: Optional[Sequence[int]], state: TensorDict,
                    step: int) -> tuple[torch.Tensor, TensorDict]:
        """Part 2 with the matrix's per-matrix ``state`` (read, never written) and this update's 1-based ``step``:
        (the update, the new state). By default ``matrix_update``, then ``update_with_state``."""
        return self.update_with_state(self.matrix_update(u, qkv_split), state)

    def update_with_state(self, update: torch.Tensor, state: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        """Part 2's per-matrix state applied to the (TP-local) block of part 2's update, at its home: (the new
        update, the new state; ``state`` read, never written). The update as it is by default."""
        return update, state

    @abc.abstractmethod
    def finish(self, master: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: Scalar, weight_decay: Scalar,
               matrix: MatrixFacts) -> None:
        """Part 3 on one owned range: updates ``master`` and ``state`` (fp32 slices of ``finish_state``)."""

    def apply(self, plan: StepPlan, *, lr_wd: Any, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        raise UnsupportedConfigError(f"{type(self).__name__} needs whole matrices: it runs through the whole-tensor "
                                     f"leaf (optimizer/whole_tensor/leaf.py), not as an elementwise pass 2.")

    # ----------------------------------------------------------------- float64 recomputation (verify mode)
    @abc.abstractmethod
    def recompute_direction(self, g: torch.Tensor, state: TensorDict) -> tuple[TensorDict, TensorDict, torch.Tensor]:
        """Part 1 in float64 from the float64 gradient and pre-step state: (state values, their bounds, U)."""

    @abc.abstractmethod
    def matrix_tolerance(self, matrix: MatrixFacts, device: torch.device) -> float:
        """A bound on every element's error of part 2's fp32 result (|e_ij| <= ||E||_F)."""

    def recompute_matrix_step(self, g: torch.Tensor, before: TensorDict, after: TensorDict, step: int
                              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """Part 2 in float64 for a rule with per-matrix state, at the home: from the float64 direction ``g``, the
        state ``before`` the step and as stored ``after`` it, (the update, its elementwise bound, per check name
        (stored, recomputed, bound) of the per-matrix state). Rules without per-matrix state use
        ``matrix_update`` in float64 and ``matrix_tolerance``."""
        raise UnsupportedConfigError(f"{type(self).__name__} keeps per-matrix state but has no float64 "
                                     f"recomputation of it (recompute_matrix_step).")

    def recompute_update_with_state(self, update: torch.Tensor, tolerance: float, before: TensorDict,
                                    after: TensorDict
                                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """``update_with_state`` in float64 (a ``state_follows_update`` rule), at the home: from part 2's float64
        ``update`` (each element within ``tolerance`` of the fp32 one), the state ``before`` the step and as stored
        ``after`` it, (the update, its elementwise bound, per check name (stored, recomputed, bound))."""
        return update, torch.full_like(update, tolerance), {}

    @abc.abstractmethod
    def recompute_finish(self, w0: torch.Tensor, update: torch.Tensor, state: TensorDict, lr: float,
                         weight_decay: float, update_tolerance: float, matrix: MatrixFacts
                         ) -> tuple[TensorDict, TensorDict]:
        """Part 3 in float64: ({"master": W, finish_state...}, their bounds)."""


__all__ = ["WholeTensorRule", "MatrixFacts", "Scalar", "TensorDict", "state_tp_size_constant"]
