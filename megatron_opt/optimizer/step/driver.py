"""StepDriver: the one clock of an optimizer step, over any number of leaves.

    IDLE --prepare_grads()--> PREPARED --step_with_ready_grads()--> STEPPED | SKIPPED
      ^                                                                   |
      +---- DistributedDataParallel.zero_grad_buffer() (a new step_id) or optimizer.zero_grad()

The state is tied to the model chunks' ``step_id``: once any chunk starts a new step, the driver
reads IDLE again, so there is one clock, not two.

The step is decided in one place, on the device (``StepDecision``: pass 1, one all-reduce per stats
group, the verdict, the norm and the clip coefficient), and run in one of two ways:

* the host API (Megatron-LM's split API, and step() without ``optimizer_cuda_graph``):
  prepare_grads() runs the decision and reads it once, the step's one host synchronisation;
  get_grad_norm(), clip_grad_norm(), count_zeros() and step_with_ready_grads() act on what was read,
  so step() returns (success, grad_norm, num_zeros) as Python values, logs a skip with its reason
  and raises StepOrderError when a rank had no backward;
* ``optimizer_cuda_graph``: step() runs the decision, the loss-scaler update and pass 2 (which reads
  the skip flag) with no host read and returns device tensors (reading them is the caller's sync);
  on CUDA everything after the gradient sync is captured once in a CUDA graph and replayed.

The loss scaler is updated once per step: at once on an overflow, when the update is applied on a
clean step, and not at all on a step skipped for its norm (docs/contract.md rules 1-3). Before the
param all-gather the ranks agree that the update succeeded everywhere (RankError otherwise).

Leaves implement ``Leaf`` (see OptimizerLeaf).
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch.profiler import record_function

from ...distributed.shard_view import GradSource, gathers_in_graph
from ... import collectives
from ...errors import LateGradientError, RankError, StepOrderError
from . import phase_timers
from . import global_stats as grad_stats
from ..grad_scaler import DynamicGradScaler, MegatronGradScaler
from .param_group_checks import check_param_groups
from .decision import DecisionRead, StepDecision, Verdict
from ..verify.step_verifier import StepVerifier, VerifyReport

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
    param_groups: list[dict]

    def accumulate_local_stats(self, stats: torch.Tensor, loss_scale: torch.Tensor, count_zeros: bool) -> None: ...

    def stage_hyperparams(self) -> Any: ...  # the staged lr / wd (ops.LrWdTable)

    def apply_update(self, clip_coef: Optional[torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None: ...

    def start_param_sync(self, force_sync: bool = False) -> None: ...

    # A leaf with ``has_whole_tensor_stage = True`` (WholeTensorLeaf) also has ``finish_update()``: the
    # collective rest of its pass 2, called once every rank's ``apply_update`` succeeded.

    def clear_model_grads(self, set_to_none: bool) -> None: ...


class _GraphRunner:
    """Runs a step function eagerly once (the warm-up), then captures it in a CUDA graph and replays
    it; on the CPU it always runs eagerly."""

    def __init__(self, device: torch.device) -> None:
        self.use_graph = device.type == "cuda"
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.capturing = False
        self._eager_runs = 0

    def run(self, fn: Callable[[], None]) -> None:
        if self.use_graph and self.graph is None and self._eager_runs >= 1:
            self.graph = torch.cuda.CUDAGraph()
            self.capturing = True
            try:
                with torch.cuda.graph(self.graph):  # capture records, it does not run: replay below
                    fn()
            finally:
                self.capturing = False
        if self.graph is not None:
            self.graph.replay()
        else:
            fn()
            self._eager_runs += 1


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
        self._decision = StepDecision(device)
        self._read: Optional[DecisionRead] = None  # what prepare_grads() read
        self._clip_coef: Optional[torch.Tensor] = None  # set by clip_grad_norm()
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._skipped_host = 0
        self.last_skip_reason: Optional[SkipReason] = None
        self._graph: Optional[_GraphRunner] = None
        if getattr(config, "optimizer_cuda_graph", False):
            self._graph = _GraphRunner(device)
            self._skipped_device = torch.zeros((), dtype=torch.int64, device=device)
            self._success = torch.zeros((), dtype=torch.bool, device=device)
            self._grad_norm = torch.zeros((), dtype=torch.float64, device=device)  # NaN on a skipped step
        self.verifier = StepVerifier.from_config(self.leaves, config, self.stats_groups)  # None: verify mode off

    @property
    def verify_report(self) -> Optional[VerifyReport]:
        """What verify mode has verified so far (None when it is off)."""
        return None if self.verifier is None else self.verifier.report

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (with optimizer_cuda_graph, reading it synchronises with the device)."""
        dev = 0 if self._graph is None else int(self._skipped_device.item())
        return self._skipped_host + dev

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host = int(value)
        if self._graph is not None:
            self._skipped_device.zero_()

    def _step_ids(self) -> tuple:
        return tuple(src.step_id for src in self.sources)

    @property
    def state(self) -> StepState:
        if self._prepared_ids is None or self._prepared_ids != self._step_ids():
            return StepState.IDLE
        return self._state

    def _enter(self, state: StepState) -> None:
        self._state = state
        self._prepared_ids = self._step_ids()

    # ----------------------------------------------------------------- loss scale
    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    # ----------------------------------------------------------------- the parts both ways share
    def _finish_grad_sync(self) -> None:
        with record_function("megatron_opt.finish_grad_sync"):
            for src in self.sources:
                src.finish_grad_sync()

    def _stage_missing_backward(self) -> None:
        """This rank's missing-backward and late-gradient flags, host-side inputs of the decision."""
        self._decision.missing.fill_(1.0 if all(src.grads_received == 0 for src in self.sources) else 0.0)
        self._decision.late.fill_(1.0 if self._late_gradient() is not None else 0.0)

    def _late_gradient(self) -> Optional[str]:
        return next((src.late_gradient for src in self.sources if getattr(src, "late_gradient", None)), None)

    def _decide(self) -> None:
        self._decision.decide(self.leaves, self.get_loss_scale(), bool(self.config.log_num_zeros_in_grad),
                              self.stats_groups, self.config.grad_norm_skip_threshold)

    def _apply_updates(self, stages: list[list[Leaf]], clip_coef: Optional[torch.Tensor],
                       found_inf: Optional[torch.Tensor], failure: Optional[BaseException],
                       sync_params: bool, timed: bool = True) -> None:
        """Pass 2 stage by stage; every rank agrees before it enters a stage's param all-gather.
        ``timed=False``: the caller times the whole (the CUDA-graph step)."""
        for stage in stages:
            with phase_timers.phase(self.config, "megatron_opt.pass2", phase_timers.PASS2 if timed else None):
                if failure is None:
                    try:
                        for leaf in stage:
                            leaf.apply_update(clip_coef, found_inf)
                    except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
                        failure = exc
                whole = [leaf for leaf in stage if getattr(leaf, "has_whole_tensor_stage", False)]
                if whole:
                    # The whole-tensor stage is collective: the ranks agree that every first part
                    # succeeded before any rank enters it (docs/design.md, "Rules that need whole tensors").
                    self._agree_before_param_sync(failure)
                    try:
                        for leaf in whole:
                            leaf.finish_update()
                    except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
                        failure = exc
                # Also between the stages: a rank that failed in a later stage has already joined the
                # earlier stages' all-gathers.
                self._agree_before_param_sync(failure)
            if sync_params:
                self._start_param_sync(stage, timed)

    def _start_param_sync(self, leaves: Sequence[Leaf], timed: bool = True) -> None:
        # Without the distributed optimizer every rank updated every param: there is nothing to gather.
        gathers = timed and any(src.param_gather.use_distributed_optimizer for src in self.sources)
        with phase_timers.phase(self.config, "megatron_opt.param_sync", phase_timers.PARAM_SYNC if gathers else None):
            started: set = set()
            for leaf in leaves:
                # Leaves that split one set of buffers (Muon's matrices and the rest) share one all-gather.
                key = (tuple(id(src) for src in leaf.sources), getattr(leaf, "is_expert_parallel", None))
                if key not in started:
                    started.add(key)
                    leaf.start_param_sync()

    def _update_stages(self) -> list[list[Leaf]]:
        """The leaves in the order their updates are applied and their params all-gathered."""
        n = self.early_param_sync
        return [self.leaves[:n], self.leaves[n:]] if n else [self.leaves]

    def _agree_before_param_sync(self, failure: Optional[BaseException]) -> None:
        """A failure in the update on one rank must not leave the others in the param all-gather:
        one 1-element MAX all-reduce over the stats groups (skipped on a single rank), and on a
        failure every rank raises RankError with the failing rank's message."""
        groups = [g for g in self.stats_groups if collectives.world_size(g) > 1]
        capturing = self._graph is not None and self._graph.capturing  # no host read inside a capture
        if not groups or capturing:
            if failure is not None:  # (a replay runs no Python that could fail)
                raise failure
            return
        with record_function("megatron_opt.update_agreement"):
            collectives.agree_each_step("the optimizer update failed", failure, groups, error_type=RankError,
                                        failure_note="The ranks' params may now differ: restart from the last "
                                                     "checkpoint.")

    # ----------------------------------------------------------------- the host API (Megatron-LM's split API)
    def prepare_grads(self) -> bool:
        """Pass 1 and the global decision, read once. Returns found_inf (True: this step must be skipped)."""
        if self.state is not StepState.IDLE:
            raise StepOrderError(
                "prepare_grads() already ran for this step (rule 1 of docs/contract.md: gradients are prepared "
                "exactly once per step, and step() calls prepare_grads() itself). Do not call prepare_grads() "
                "before step(); start the next step with zero_grad_buffer() and a backward."
            )
        self._finish_grad_sync()
        # the decide phase encloses .pass1 + .stats_allreduce
        with phase_timers.phase(self.config, "megatron_opt.decide", phase_timers.PASS1):
            self._stage_missing_backward()
            self._decide()
            read = self._decision.read()  # the step's one host synchronisation
        if read.late_gradients:  # every rank raises, with the message of the first rank that saw one
            collectives.agree_each_step("a gradient arrived after its bucket was launched", self._late_gradient(),
                                        self.stats_groups, error_type=LateGradientError)
        if read.missing_backward:
            raise StepOrderError(
                f"step() was called on {read.missing_backward} rank(s) with no gradient since "
                f"zero_grad_buffer(): run the forward and backward of the step's micro-batches first."
            )
        if self.grad_scaler is not None and read.found_inf:
            self.grad_scaler.update(True)  # an overflow: back off now. A clean step counts when it is applied.
        self._read, self._clip_coef = read, None
        self._enter(StepState.PREPARED)
        return read.found_inf

    def _require_prepared(self, what: str) -> DecisionRead:
        if self.state is not StepState.PREPARED or self._read is None:
            raise StepOrderError(f"{what} needs prepare_grads() first in this step (state: {self.state.value}).")
        return self._read

    def get_grad_norm(self) -> float:
        return self._require_prepared("get_grad_norm()").grad_norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip by the global norm: the coefficient rides in pass 2's one gradient multiplier."""
        norm = self._require_prepared("clip_grad_norm()").grad_norm
        self._clip_coef = self._decision.clip_coefficient(clip_grad)
        return norm

    def count_zeros(self) -> Optional[int]:
        read = self._require_prepared("count_zeros()")
        return read.num_zeros if self.config.log_num_zeros_in_grad else None

    def step_with_ready_grads(self) -> bool:
        read = self._require_prepared("step_with_ready_grads()")
        if read.found_inf:
            self._skip(SkipReason.OVERFLOW if isinstance(self.grad_scaler, DynamicGradScaler)
                       else SkipReason.NON_FINITE)
            return False
        failure: Optional[BaseException] = None
        try:
            for leaf in self.leaves:  # lr / weight decay as a scheduler or the user left them, before any change
                check_param_groups(leaf.param_groups)
            if self.grad_scaler is not None:
                # Once per step, and only for a step that is applied: a step skipped for its norm
                # (grad_norm_skip_threshold) leaves the scaler exactly as it was.
                self.grad_scaler.update(False)
        except Exception as exc:  # noqa: BLE001  (re-raised on every rank by the agreement)
            failure = exc
        self._apply_updates(self._update_stages(), self._clip_coef, None, failure, sync_params=True)
        self._state = StepState.STEPPED
        return True

    def step(self) -> tuple[Any, Any, Any]:
        # Verify mode's checks run before and after the step, outside any CUDA graph.
        pending = None
        if self.verifier is not None:
            with phase_timers.phase(self.config, "megatron_opt.verify", phase_timers.VERIFY):
                pending = self.verifier.begin(self.sources, self.get_loss_scale())
        result = self._step_on_device() if self._graph is not None else self._step_on_host()
        if pending is not None:
            with phase_timers.phase(self.config, "megatron_opt.verify", phase_timers.VERIFY):
                self.verifier.finish(pending, self._decision.skip, self._decision.grad_norm, self.config.clip_grad)
        return result

    def _step_on_host(self) -> tuple[Any, Any, Any]:
        found_inf = self.prepare_grads()
        if found_inf:
            return self.step_with_ready_grads(), None, None
        read = self._read
        if read.verdict is Verdict.NORM_OVER_THRESHOLD:
            self._skip(SkipReason.NORM_OVER_THRESHOLD,
                       f" (norm {read.grad_norm:.4g} > {self.config.grad_norm_skip_threshold:.4g})")
            return False, None, None
        if self.config.clip_grad > 0.0:
            self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros()
        return self.step_with_ready_grads(), read.grad_norm, num_zeros

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
        self._read, self._clip_coef = None, None

    # ----------------------------------------------------------------- optimizer_cuda_graph: no host read
    def _param_sync_in_graph(self) -> bool:
        return gathers_in_graph([src.param_gather for src in self.sources])

    def _device_core(self) -> None:
        """Everything after the gradient sync, as device work only (what the graph captures). Inputs
        that change between steps live in device tensors it reads: the unscale factors (DDP's), the
        loss scale, the (lr, wd) tables (staged before each replay) and the missing-backward flag."""
        cfg, decision = self.config, self._decision
        self._decide()
        skip = decision.skip[0] != 0
        if self.grad_scaler is not None:
            self.grad_scaler.update(decision.overflow, ~skip)
        clip_coef = decision.clip_coefficient(cfg.clip_grad) if cfg.clip_grad > 0.0 else None
        self._apply_updates([self.leaves], clip_coef, decision.skip, None, sync_params=self._param_sync_in_graph(),
                            timed=False)
        self._skipped_device.add_(skip.to(torch.int64))
        self._success.copy_(~skip)
        self._grad_norm.copy_(torch.where(skip, torch.full_like(self._grad_norm, float("nan")), decision.grad_norm[0]))

    def _step_on_device(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        if self.state is not StepState.IDLE:
            raise StepOrderError("step() already ran for this step: start the next step with zero_grad_buffer() "
                                 "and a backward (docs/contract.md rule 1).")
        self._finish_grad_sync()
        for leaf in self.leaves:  # host-side inputs, outside any graph
            check_param_groups(leaf.param_groups)
            leaf.stage_hyperparams()
        self._stage_missing_backward()
        with phase_timers.phase(self.config, "megatron_opt.graph_step", phase_timers.PASS2):
            self._graph.run(self._device_core)
        if not self._param_sync_in_graph():
            self._start_param_sync(self.leaves)
        self._enter(StepState.STEPPED)
        zeros = self._decision.stats[grad_stats.STAT_ZEROS].clone() if self.config.log_num_zeros_in_grad else None
        return self._success.clone(), self._grad_norm.clone(), zeros


__all__ = ["StepDriver", "StepState", "SkipReason", "Leaf"]
