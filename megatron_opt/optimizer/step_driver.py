"""StepDriver: the one clock of an optimizer step, over any number of shard groups (leaves).

    IDLE --prepare_grads()--> PREPARED --step_with_ready_grads()--> STEPPED | SKIPPED
      ^                                                                   |
      +---- DistributedDataParallel.zero_grad_buffer() (a new step_id) or optimizer.zero_grad()

The state is tied to the model chunks' ``step_id``: once any chunk starts a new step, the driver
reads IDLE again, so there is one clock, not two. prepare_grads() finishes the gradient sync, runs
pass 1 on every leaf, reduces the packed statistics with one all-reduce per group and one host
read; the loss scaler is updated once per step: at once on an overflow, when the update is
applied on a clean step, and not at all on a step skipped for its norm (docs/contract.md rules 1-3). step() runs the whole
sequence once and returns (success, grad_norm, num_zeros). The driver owns the skip log.

With ``optimizer_cuda_graph`` the step is decided on the device instead (``_step_on_device``): the
skip decision, the clip coefficient and the loss-scaler update are device ops, pass 2 reads the skip
flag on the device, step() returns device tensors (reading them is the caller's sync), and on CUDA
everything after the gradient sync (pass 1, the statistics all-reduce, the decision, pass 2 and a
synchronous param all-gather) is captured once in a CUDA graph and replayed every step.

Leaves implement (see ShardGroup): ``sources``, ``accumulate_local_stats(stats, loss_scale,
count_zeros)``, ``stage_hyperparams()``, ``apply_update(clip_coef, found_inf=None)``,
``start_param_sync()``, ``clear_model_grads(set_to_none)``.
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Optional, Protocol, Sequence, Union

import torch
from torch.profiler import record_function

from ..distributed.shard_view import GradSource
from .. import collectives
from ..errors import RankError, StepOrderError
from . import stats as grad_stats
from .grad_scaler import DynamicGradScaler, MegatronGradScaler
from .hyperparams import check_param_groups

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


class Leaf(Protocol):
    sources: list[GradSource]

    def accumulate_local_stats(self, stats: torch.Tensor, loss_scale: torch.Tensor, count_zeros: bool) -> None: ...

    def stage_hyperparams(self) -> torch.Tensor: ...

    def apply_update(self, clip_coef: Union[float, torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None: ...

    def start_param_sync(self, force_sync: bool = False) -> None: ...

    def clear_model_grads(self, set_to_none: bool) -> None: ...


class StepDriver:
    """Runs the step over ``leaves``; every statistic is reduced over ``stats_groups`` in turn."""

    def __init__(self, leaves: Sequence[Leaf], config: Any, grad_scaler: Optional[MegatronGradScaler],
                 stats_groups: Sequence[Optional[torch.distributed.ProcessGroup]], device: torch.device,
                 early_param_sync: int = 0) -> None:
        """``early_param_sync`` = n > 0: the first n leaves are updated, agreed on and have their param
        all-gather dispatched before the other leaves are updated (Megatron-LM's
        overlap_param_gather_with_optimizer_step: the first model chunk's all-gather overlaps the rest
        of the step)."""
        self.leaves = list(leaves)
        self.early_param_sync = early_param_sync if 0 < early_param_sync < len(self.leaves) else 0
        self.config = config
        self.grad_scaler = grad_scaler
        self.stats_groups = list(stats_groups)
        self.sources: list[GradSource] = []
        for leaf in self.leaves:
            for src in leaf.sources:
                if all(src is not seen for seen in self.sources):
                    self.sources.append(src)
        self._state = StepState.IDLE
        self._prepared_ids: Optional[tuple] = None
        self._stats: Optional[grad_stats.GradStats] = None
        self._clip_coef = 1.0
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._skipped_host = 0
        self.last_skip_reason: Optional[SkipReason] = None
        self._device_step: Optional[_DeviceStep] = None
        if getattr(config, "optimizer_cuda_graph", False):
            self._device_step = _DeviceStep(self, device)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (with optimizer_cuda_graph, reading it synchronises with the device)."""
        dev = 0 if self._device_step is None else int(self._device_step.skipped.item())
        return self._skipped_host + dev

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host = int(value)
        if self._device_step is not None:
            self._device_step.skipped.zero_()

    def _step_ids(self) -> tuple:
        return tuple(src.step_id for src in self.sources)

    @property
    def state(self) -> StepState:
        if self._prepared_ids is None or self._prepared_ids != self._step_ids():
            return StepState.IDLE
        return self._state

    # ----------------------------------------------------------------- loss scale
    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    # ----------------------------------------------------------------- the split API
    def prepare_grads(self) -> bool:
        """Pass 1 and the global decision. Returns found_inf (True: this step must be skipped)."""
        if self.state is not StepState.IDLE:
            raise StepOrderError(
                "prepare_grads() already ran for this step (rule 1 of docs/contract.md: gradients are prepared "
                "exactly once per step, and step() calls prepare_grads() itself). Do not call prepare_grads() "
                "before step(); start the next step with zero_grad_buffer() and a backward."
            )
        with record_function("megatron_opt.finish_grad_sync"):
            for src in self.sources:
                src.finish_grad_sync()
        stats = grad_stats.new_stats(self._one.device)
        with record_function("megatron_opt.pass1"):
            loss_scale = self.get_loss_scale()
            for leaf in self.leaves:
                leaf.accumulate_local_stats(stats, loss_scale, bool(self.config.log_num_zeros_in_grad))
        if all(src.grads_received == 0 for src in self.sources):
            stats[grad_stats.STAT_MISSING_BACKWARD] = 1
        with record_function("megatron_opt.stats_allreduce"):
            grad_stats.reduce_stats(stats, self.stats_groups)
            result = grad_stats.GradStats.from_tensor(stats)
        if result.missing_backward:
            raise StepOrderError(
                f"step() was called on {result.missing_backward} rank(s) with no gradient since "
                f"zero_grad_buffer(): run the forward and backward of the step's micro-batches first."
            )
        if self.grad_scaler is not None and result.found_inf:
            self.grad_scaler.update(True)  # an overflow: back off now. A clean step counts when it is applied.
        self._stats = result
        self._clip_coef = 1.0
        self._state = StepState.PREPARED
        self._prepared_ids = self._step_ids()
        return result.found_inf

    def _require_prepared(self, what: str) -> grad_stats.GradStats:
        if self.state is not StepState.PREPARED or self._stats is None:
            raise StepOrderError(f"{what} needs prepare_grads() first in this step (state: {self.state.value}).")
        return self._stats

    def get_grad_norm(self) -> float:
        return self._require_prepared("get_grad_norm()").grad_norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self._require_prepared("clip_grad_norm()").grad_norm
        coef = clip_grad / (norm + 1.0e-6)
        self._clip_coef = coef if coef < 1.0 else 1.0
        return norm

    def count_zeros(self) -> Optional[int]:
        stats = self._require_prepared("count_zeros()")
        return stats.num_zeros if self.config.log_num_zeros_in_grad else None

    def step_with_ready_grads(self) -> bool:
        stats = self._require_prepared("step_with_ready_grads()")
        if stats.found_inf:
            self._skip(SkipReason.OVERFLOW if isinstance(self.grad_scaler, DynamicGradScaler) else SkipReason.NON_FINITE)
            return False
        failure: Optional[BaseException] = None
        try:
            for leaf in self.leaves:  # lr / weight decay as a scheduler or the user left them, before any change
                check_param_groups(leaf.param_groups)
            if self.grad_scaler is not None:
                # Once per step, and only for a step that is applied: a step skipped for its norm
                # (grad_norm_skip_threshold) leaves the scaler exactly as it was.
                self.grad_scaler.update(False)
        except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
            failure = exc
        for stage in self._update_stages():
            if failure is None:
                try:
                    with record_function("megatron_opt.pass2"):
                        for leaf in stage:
                            leaf.apply_update(self._clip_coef)
                except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
                    failure = exc
            # Every rank agrees before it enters an all-gather, also between the stages: a rank that
            # failed in a later stage has already joined the earlier stages' all-gathers.
            self._agree_before_param_sync(failure)
            with record_function("megatron_opt.param_sync"):
                for leaf in stage:
                    leaf.start_param_sync()
        self._state = StepState.STEPPED
        return True

    def _update_stages(self) -> list[list[Leaf]]:
        """The leaves in the order their updates are applied and their params all-gathered."""
        n = self.early_param_sync
        return [self.leaves[:n], self.leaves[n:]] if n else [self.leaves]

    def _agree_before_param_sync(self, failure: Optional[BaseException]) -> None:
        """A failure in the update on one rank must not leave the others in the param all-gather:
        one 1-element MAX all-reduce over the stats groups (skipped on a single rank), and on a
        failure every rank raises RankError with the failing rank's message."""
        groups = [g for g in self.stats_groups if collectives.world_size(g) > 1]
        if not groups:
            if failure is not None:
                raise failure
            return
        with record_function("megatron_opt.update_agreement"):
            failed = collectives.max_over_groups([0.0 if failure is None else 1.0], groups)[0] > 0
        if not failed:
            return
        bad = [(r, m) for r, (m, _) in enumerate(collectives.gather_failures(failure, groups[0])) if m is not None]
        where = f"rank {bad[0][0]} of the data-parallel group: {bad[0][1]}" if bad else "a model-parallel peer"
        raise RankError(f"the optimizer update failed on {where}. The ranks' params may now differ: restart from the "
                        f"last checkpoint.") from failure

    def step(self) -> tuple[Any, Any, Any]:
        if self._device_step is not None:
            return self._device_step.run()
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

    def _skip(self, reason: SkipReason, detail: str = "") -> None:
        self._state = StepState.SKIPPED
        self._skipped_host += 1
        self.last_skip_reason = reason
        scale = f"; loss scale is now {self.get_loss_scale().item():g}" if self.grad_scaler is not None else ""
        logger.warning("megatron_opt: step skipped: %s%s%s (skipped steps so far: %d)",
                       reason.value, detail, scale, self.skipped_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model-param .grad (the DDP buffer is zeroed by zero_grad_buffer()) and start a new step."""
        for leaf in self.leaves:
            leaf.clear_model_grads(set_to_none)
        self._state = StepState.IDLE
        self._prepared_ids = None
        self._stats = None


class _DeviceStep:
    """The step decided on the device (optimizer_cuda_graph): no host synchronisation, and on CUDA
    one CUDA graph for everything after the gradient sync. Inputs that change between steps live
    in device tensors the graph reads: the gradient scale factor (DDP's), the loss scale, the
    (lr, wd) tables (staged before each replay) and the missing-backward flag."""

    def __init__(self, driver: "StepDriver", device: torch.device) -> None:
        self.d = driver
        self.stats = grad_stats.new_stats(device)
        self.missing = torch.zeros((), dtype=torch.float64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.success = torch.zeros((), dtype=torch.bool, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=device)
        self.use_graph = device.type == "cuda"
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._eager_runs = 0

    def _param_sync_in_graph(self) -> bool:
        return not any(src.ddp_config.overlap_param_gather for src in self.d.sources)

    def core(self) -> None:
        """Everything after the gradient sync, as device work only (what the graph captures)."""
        d, cfg, stats = self.d, self.d.config, self.stats
        stats.zero_()
        loss_scale = d.get_loss_scale()
        with record_function("megatron_opt.pass1"):
            for leaf in d.leaves:
                leaf.accumulate_local_stats(stats, loss_scale, bool(cfg.log_num_zeros_in_grad))
        stats[grad_stats.STAT_MISSING_BACKWARD].copy_(self.missing)
        with record_function("megatron_opt.stats_allreduce"):
            grad_stats.reduce_stats(stats, d.stats_groups)
        sumsq = stats[grad_stats.STAT_SUMSQ]
        missing = stats[grad_stats.STAT_MISSING_BACKWARD] != 0
        overflow = ((stats[grad_stats.STAT_NONFINITE] != 0) | ~torch.isfinite(sumsq)) & ~missing
        norm = grad_stats.grad_norm_of(stats)[0]
        skip = overflow | missing
        if cfg.grad_norm_skip_threshold is not None:
            skip = skip | (norm > cfg.grad_norm_skip_threshold)
        if d.grad_scaler is not None:
            d.grad_scaler.update_on_device(overflow, ~skip)
        if cfg.clip_grad > 0.0:
            coef = cfg.clip_grad / (norm + 1.0e-6)
            clip = torch.where(coef < 1.0, coef, torch.ones_like(coef)).float()
        else:
            clip = torch.ones((), dtype=torch.float32, device=stats.device)
        self.found_inf.copy_(skip.reshape(1))
        failure: Optional[BaseException] = None
        try:
            with record_function("megatron_opt.pass2"):
                for leaf in d.leaves:
                    leaf.apply_update(clip, self.found_inf)
        except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
            failure = exc
        if self.use_graph and torch.cuda.is_current_stream_capturing():
            if failure is not None:  # no host read inside a capture; a replay runs no Python that could fail
                raise failure
        else:  # eager (CPU, or the first CUDA step): the same agreement as the host-decided step
            d._agree_before_param_sync(failure)
        self.skipped.add_(skip.to(torch.int64))
        self.success.copy_(~skip)
        self.grad_norm.copy_(torch.where(skip, torch.full_like(norm, float("nan")), norm))
        if self._param_sync_in_graph():
            with record_function("megatron_opt.param_sync"):
                for leaf in d.leaves:
                    leaf.start_param_sync()

    def run(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        d = self.d
        if d.state is not StepState.IDLE:
            raise StepOrderError("step() already ran for this step: start the next step with zero_grad_buffer() "
                                 "and a backward (docs/contract.md rule 1).")
        with record_function("megatron_opt.finish_grad_sync"):
            for src in d.sources:
                src.finish_grad_sync()
        for leaf in d.leaves:  # host-side inputs, outside any graph
            check_param_groups(leaf.param_groups)
            leaf.stage_hyperparams()
        self.missing.fill_(1.0 if all(src.grads_received == 0 for src in d.sources) else 0.0)
        if self.use_graph and self.graph is None and self._eager_runs >= 1:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # capture records, it does not run: replay below
                self.core()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.core()  # CPU, or the warm-up run before the capture on CUDA
            self._eager_runs += 1
        if not self._param_sync_in_graph():
            with record_function("megatron_opt.param_sync"):
                for leaf in d.leaves:
                    leaf.start_param_sync()
        d._state = StepState.STEPPED
        d._prepared_ids = d._step_ids()
        zeros = self.stats[grad_stats.STAT_ZEROS].clone() if d.config.log_num_zeros_in_grad else None
        return self.success.clone(), self.grad_norm.clone(), zeros


__all__ = ["StepDriver", "StepState", "SkipReason", "Leaf"]
