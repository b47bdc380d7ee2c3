"""The optimizer step as an explicit state machine, shared by DistributedOptimizer and ChainedOptimizer.

    IDLE --prepare_grads()--> PREPARED --step_with_ready_grads()--> STEPPED | SKIPPED
      ^                                                                  |
      +------------- zero_grad() or DistributedDataParallel.zero_grad_buffer()

prepare_grads() runs pass 1 over every child's shards, the one packed all-reduce and the one host
read, then updates the loss scaler once. A second prepare_grads() in the same step raises
(CONTRACT rule 1). step() runs the whole sequence once and returns (success, grad_norm, num_zeros).
"""
from __future__ import annotations

import enum
import logging
from typing import Optional

import torch

from . import stats as grad_stats
from .grad_scaler import DynamicGradScaler, MegatronGradScaler

logger = logging.getLogger("megatron_opt")


class StepState(enum.Enum):
    IDLE = "idle"
    PREPARED = "prepared"
    STEPPED = "stepped"
    SKIPPED = "skipped"


class SkipReason(str, enum.Enum):
    OVERFLOW = "overflow"  # non-finite grads with a dynamic loss scaler
    NON_FINITE = "non-finite"  # non-finite grads without a dynamic scaler (bf16 / fp32 / constant scale)
    NORM_OVER_THRESHOLD = "norm over threshold"


class StepMachine:
    """Mixin: subclasses provide ``config``, ``grad_scaler``, ``_children()`` and ``_stats_groups()``."""

    config: object
    grad_scaler: Optional[MegatronGradScaler]

    def _init_step_machine(self, device: torch.device) -> None:
        self._state = StepState.IDLE
        self._prepared_generations: Optional[tuple] = None
        self._stats: Optional[grad_stats.GradStats] = None
        self._clip_coef = 1.0
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.skipped_steps = 0
        self.last_skip_reason: Optional[SkipReason] = None

    # ----------------------------------------------------------------- hooks for subclasses
    def _children(self) -> list:
        raise NotImplementedError

    def _stats_groups(self) -> list:
        raise NotImplementedError

    def _model_chunks(self) -> list:
        chunks, seen = [], set()
        for child in self._children():
            for chunk in child.model_chunks:
                if id(chunk) not in seen:
                    seen.add(id(chunk))
                    chunks.append(chunk)
        return chunks

    def _generations(self) -> tuple:
        return tuple(chunk.generation for chunk in self._model_chunks())

    # ----------------------------------------------------------------- loss scale
    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale().to(loss.dtype)

    # ----------------------------------------------------------------- the split API
    def prepare_grads(self) -> bool:
        """Pass 1 and the global decision. Returns found_inf (True: this step must be skipped)."""
        generations = self._generations()
        if self._state is not StepState.IDLE and generations == self._prepared_generations:
            raise RuntimeError(
                "prepare_grads() already ran for this step (CONTRACT rule 1: gradients are prepared exactly "
                "once per step, and step() calls prepare_grads() itself). Do not call prepare_grads() before "
                "step(); start the next step with zero_grad_buffer() and a backward."
            )
        chunks = self._model_chunks()
        for chunk in chunks:
            chunk.finish_grad_sync()
        stats = grad_stats.new_stats(self._one.device)
        loss_scale = self.get_loss_scale()
        for child in self._children():
            child._accumulate_local_stats(stats, loss_scale)
        if all(chunk.grads_received == 0 for chunk in chunks):
            stats[grad_stats.STAT_MISSING_BACKWARD] = 1
        grad_stats.reduce_stats(stats, self._stats_groups())
        result = grad_stats.GradStats.from_tensor(stats)
        if result.missing_backward:
            raise RuntimeError(
                f"step() was called on {result.missing_backward} rank(s) with no gradient since "
                f"zero_grad_buffer(): run the forward and backward of the step's micro-batches first."
            )
        if self.grad_scaler is not None:
            self.grad_scaler.update(result.found_inf)  # once per step, after the global decision
        self._stats = result
        self._clip_coef = 1.0
        self._state = StepState.PREPARED
        self._prepared_generations = generations
        return result.found_inf

    def _require_prepared(self, what: str) -> grad_stats.GradStats:
        if self._state is not StepState.PREPARED or self._stats is None:
            raise RuntimeError(f"{what} needs prepare_grads() first in this step (state: {self._state.value}).")
        return self._stats

    def get_grad_norm(self) -> float:
        """The unscaled global gradient norm, before clipping, identical on every rank."""
        return self._require_prepared("get_grad_norm()").grad_norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip by the global norm. No pass over the grads: the coefficient rides in pass 2's scalar."""
        norm = self._require_prepared("clip_grad_norm()").grad_norm
        coef = clip_grad / (norm + 1.0e-6)
        self._clip_coef = coef if coef < 1.0 else 1.0
        return norm

    def count_zeros(self) -> Optional[int]:
        """Zero gradient elements over all ranks; None unless config.log_num_zeros_in_grad."""
        stats = self._require_prepared("count_zeros()")
        return stats.num_zeros if self.config.log_num_zeros_in_grad else None

    def step_with_ready_grads(self) -> bool:
        """Pass 2 on every child and the param all-gather; False (and no change) when the step skips."""
        stats = self._require_prepared("step_with_ready_grads()")
        if stats.found_inf:
            self._skip(SkipReason.OVERFLOW if self._dynamic_scaling() else SkipReason.NON_FINITE)
            return False
        for child in self._children():
            child._apply_update(self._clip_coef)
        for child in self._children():
            child._sync_params()
        self._state = StepState.STEPPED
        return True

    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """Run the whole update once. Returns (success, grad_norm, num_zeros); (False, None, None) on a skip."""
        found_inf = self.prepare_grads()
        if found_inf:
            return self.step_with_ready_grads(), None, None
        grad_norm = self.get_grad_norm()
        if self.config.clip_grad > 0.0:
            self.clip_grad_norm(self.config.clip_grad)
        threshold = self.config.grad_norm_skip_threshold
        if threshold is not None and grad_norm > threshold:
            self._skip(SkipReason.NORM_OVER_THRESHOLD, f" (norm {grad_norm:.4g} > {threshold:.4g})")
            return False, None, None
        num_zeros = self.count_zeros()
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros

    def _dynamic_scaling(self) -> bool:
        return isinstance(self.grad_scaler, DynamicGradScaler)

    def _skip(self, reason: SkipReason, detail: str = "") -> None:
        self._state = StepState.SKIPPED
        self.skipped_steps += 1
        self.last_skip_reason = reason
        scale = f"; loss scale is now {self.get_loss_scale().item():g}" if self.grad_scaler is not None else ""
        logger.warning("megatron_opt: step skipped: %s%s%s (skipped steps so far: %d)",
                       reason.value, detail, scale, self.skipped_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model-param .grad (the DDP buffer is zeroed by zero_grad_buffer()) and start a new step."""
        for chunk in self._model_chunks():
            for p in chunk.module.parameters():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        self._state = StepState.IDLE
        self._stats = None

    @property
    def step_state(self) -> StepState:
        return self._state
