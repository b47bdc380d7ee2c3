"""DistributedDataParallel: grad buffers, backward hooks, bucket reduction and param all-gather.

This module is the public class and the order of its work; each concern has its own module:
ddp_call.py (the two call shapes), ddp_checks.py (construction checks and the replicas' agreement),
grad_sync.py (buffers and the bucket launch order), hooks.py (grad and forward pre-hooks),
grad_sync_state.py (the named per-step state), shard_publish.py (the optimizer's LocalShards),
normalisation.py (the gradient factors), megatron_core_members.py (megatron-core's module passthroughs).

Normalisation is deferred (normalisation.py): the buckets are reduced with SUM and nothing
multiplies the gradients. ``grad_scale_factor`` (a device scalar, 1/DP by default) records what the
gradients must be multiplied by; ``set_loss_divisor`` and ``scale_gradients`` change it, and every
published shard carries the one resolved unscale factor the optimizer folds into its two passes. So
``param.main_grad`` holds the raw sum; the logical gradient is ``main_grad * grad_scale_factor``.
16-bit gradient buffers are the exception: each bucket is divided by the group size just before its
reduction (``ParamAndGradBuffer.grad_prescale``), so there ``main_grad`` holds the sum / DP.

Partial sharding (``num_distributed_optimizer_instances = k > 1``, Megatron-LM's partial distributed
optimizer): the data-parallel ranks form k instances of DP / k consecutive ranks; buffers are laid
out and sharded over one instance (the intra-instance group), each bucket is reduce-scattered inside
the instance and its shard then all-reduced across instances (the inter-instance group), and the
param all-gather stays inside the instance. The sum, and so the 1/DP scale, is over all DP ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Union, overload

import torch

from .. import collectives
from ..config import DistributedDataParallelConfig
from ..errors import LateGradientError, StepOrderError
from .buffers import ParamAndGradBuffer
from .ddp_call import parse_ddp_call
from .ddp_checks import (SUPPORTED_PARAM_DTYPES, WrappedParams, WrappingFacts, agree_on_wrapping, check_membership,
                         resolve_instance_groups)
from .grad_sync import BucketLaunchOrder, build_buffers, bucket_size_of
from .hooks import ForwardPreHooks, install_grad_hooks
from .megatron_core_members import MegatronCoreModuleMembers
from .normalisation import GradNormalisation, loss_divisor_factor
from .parallel_groups import ModelParallelGroups
from .shard_publish import publish_shards
from .shard_view import LocalShard, ParamGather
from .grad_sync_state import GradSyncPhase, GradSyncState


class DistributedDataParallel(MegatronCoreModuleMembers, torch.nn.Module):
    """Megatron-LM's data-parallel wrapper over grad buffers, for one model chunk.

    Two call shapes, told apart by the type of the first argument (or by keywords):

    * megatron_opt's: ``DistributedDataParallel(module, ddp_config=None, data_parallel_group=None,
      expert_data_parallel_group=None, instance_groups=None, model_parallel_groups=None)``; a
      step's gradients start scaled by 1/DP, and ``train_step`` sets the step's whole normalisation.
    * megatron-core's: ``DistributedDataParallel(config, ddp_config, module, disable_bucketing=False,
      pg_collection=None)`` with ``config`` a TransformerConfig, as Megatron-LM's ``get_model`` calls
      it; megatron-core's semantics: with ``config.calculate_per_token_loss`` the gradient scale
      starts at 1.0 (``finalize_model_grads`` divides by the global token count), else at 1/DP; the
      groups come from ``pg_collection`` (``dp_cp``, ``expt_dp``) or megatron-core's parallel_state
      when it is initialised; ``disable_bucketing`` puts each buffer in one bucket.

    Model parallelism (tensor with sequence parallel, pipeline with virtual stages, context, expert):
    the gradients are reduced over the data-parallel group (with context parallelism: data x
    context) and expert params over the expert data-parallel group, so tensor-parallel peers and the
    first/last stages lay out, and own, the same ranges of a param (the layout is a pure function of
    the params, their order, the DP size and the bucket size; the shared embedding has its own
    bucket), which megatron-core's ``finalize_model_grads`` relies on when it all-reduces
    ``main_grad`` across them. ``model_parallel_groups`` (``ModelParallelGroups``; megatron-core's
    call shape takes them from pg_collection / parallel_state) gives the tensor and expert-tensor
    ranks that decide which copy of a replicated param counts in the gradient statistics, and the
    group (the world by default) the statistics and the failure agreements are summed over.
    Stages after the first get one bucket per buffer, as in megatron-core.

    ``ddp_config`` may be ours or megatron-core's DistributedDataParallelConfig (converted field by
    field; an unsupported value raises UnsupportedConfigError naming it).

    With ``ddp_config.num_distributed_optimizer_instances = k > 1`` the optimizer is sharded within
    instances of DP / k ranks and replicated across them (see the module docstring); the instance
    groups come from megatron-core when its call shape provides them, else they are created here
    (a collective over the data-parallel group: every rank must construct the wrapper together).
    """

    @overload
    def __init__(self, module: torch.nn.Module, ddp_config: Optional[DistributedDataParallelConfig] = None,
                 data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
                 expert_data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
                 instance_groups: Optional[tuple[Any, Any]] = None,
                 model_parallel_groups: Optional[ModelParallelGroups] = None) -> None: ...

    @overload
    def __init__(self, config: Any, ddp_config: Any, module: torch.nn.Module, disable_bucketing: bool = False,
                 pg_collection: Any = None) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        call = parse_ddp_call(args, kwargs)
        super().__init__()
        self.module = call.module
        self.config = call.transformer_config  # megatron-core's DDP carries the TransformerConfig too
        self.ddp_config = call.ddp_config
        self.disable_bucketing = call.disable_bucketing
        self.model_parallel_groups = call.model_parallel
        self.data_parallel_group = call.data_parallel_group
        self.expert_data_parallel_group = call.expert_data_parallel_group or call.data_parallel_group
        check_membership(call.data_parallel_group, "data_parallel_group")
        check_membership(call.expert_data_parallel_group, "expert_data_parallel_group")
        self.dp_size = collectives.world_size(self.data_parallel_group)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        facts = WrappingFacts(named, self.ddp_config, self.dp_size, self.model_parallel_groups,
                              self.data_parallel_group, self.expert_data_parallel_group)
        agree_on_wrapping(facts)
        # The ranks agreed on the config, the DP size and whether expert params can be partially
        # sharded, so what follows raises on every rank or on none.
        self.num_distributed_optimizer_instances = self.ddp_config.num_distributed_optimizer_instances
        self.intra_instance_group, self.inter_instance_group = resolve_instance_groups(call, facts)
        one_bucket = self.disable_bucketing or self.model_parallel_groups.pipeline_parallel_rank > 0
        bucket_size = bucket_size_of(self.ddp_config, self.dp_size, one_bucket)
        self._all_buffers = build_buffers(named, self.ddp_config, bucket_size, self.data_parallel_group,
                                          self.expert_data_parallel_group, self.intra_instance_group,
                                          self.inter_instance_group)
        self._wrapped = WrappedParams(named)
        self._buffer_of = {id(p): buf for buf in self._all_buffers for p in buf.params}
        device = named[0][1].device
        self._state = GradSyncState()
        self._launch_order = BucketLaunchOrder([b for buf in self._all_buffers for b in buf.buckets],
                                               partial_sharding=self.inter_instance_group is not None,
                                               check_for_nan=self.ddp_config.check_for_nan_in_grad, device=device)
        self._normalisation = GradNormalisation(1.0 if call.grad_scale_starts_at_one else 1.0 / self.dp_size, device)
        self._local_shards: Optional[list[LocalShard]] = None  # published once, on the optimizer's first call
        self._param_gather = ParamGather(self.ddp_config.use_distributed_optimizer,
                                         self.ddp_config.overlap_param_gather)
        install_grad_hooks(self, [p for _, p in named])
        self._pre_hooks = ForwardPreHooks(self.module, self._buffer_of)
        if self.ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # ----------------------------------------------------------------- forward / state
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    @property
    def buffers(self) -> list[ParamAndGradBuffer]:  # type: ignore[override]  (megatron-core's name)
        """The dense (non-expert) param and grad buffers."""
        return [b for b in self._all_buffers if not b.is_expert_parallel]

    @property
    def expert_parallel_buffers(self) -> list[ParamAndGradBuffer]:
        """The expert-parallel buffers (params with ``allreduce == False``)."""
        return [b for b in self._all_buffers if b.is_expert_parallel]

    # ----------------------------------------------------------------- forward pre-hooks (overlap_param_gather)
    def enable_forward_pre_hook(self) -> None:
        """Make each submodule's forward wait for the all-gather of its params' buckets (installed at
        construction with overlap_param_gather; Megatron-LM removes them around evaluation and saves)."""
        if not self.ddp_config.overlap_param_gather:
            raise StepOrderError("enable_forward_pre_hook() needs "
                                 "DistributedDataParallelConfig.overlap_param_gather=True "
                                 "(without it the param all-gather is synchronous and there is nothing to wait for).")
        self._pre_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; with ``param_sync`` first finish every param all-gather, so the
        module holds the updated params without them."""
        if not self.ddp_config.overlap_param_gather:
            raise StepOrderError("disable_forward_pre_hook() needs "
                                 "DistributedDataParallelConfig.overlap_param_gather=True.")
        self._pre_hooks.disable()
        if param_sync:
            self.start_param_sync(force_sync=True)

    @property
    def remove_forward_pre_hook_handles(self) -> list:
        """The installed forward pre-hook handles (empty when disabled); Megatron-LM reads its length."""
        return list(self._pre_hooks.handles)

    # ----------------------------------------------------------------- the optimizer's view (shard_view.GradSource)
    def local_shards(self, expert_parallel: Optional[bool] = None) -> list[LocalShard]:
        """This rank's shard of every bucket, in buffer and bucket order (dense or expert only if asked)."""
        if self._local_shards is None:
            self._local_shards = publish_shards(self._all_buffers, self._normalisation, self.model_parallel_groups)
        return [s for s in self._local_shards if expert_parallel is None or s.is_expert_parallel == expert_parallel]

    # What the optimizer reads of the step (the GradSource protocol), from the named per-step state.
    step_id = property(lambda self: self._state.step_id,
                       doc="Advanced by every zero_grad_buffer(): the gradients in the buffers belong to this step.")
    late_gradient = property(lambda self: self._state.late_gradient,
                             doc="The message of this step's first gradient that reached a backward hook after its "
                                 "bucket was launched (None: none); the optimizer's step raises it on every rank.")
    grads_received = property(lambda self: self._state.grads_received,
                              doc="Gradients accumulated since zero_grad_buffer() (0 means no backward ran this step).")
    grad_sync_phase = property(lambda self: self._state.phase,
                               doc="Where this chunk's gradients are in the step (grad_sync_state.GradSyncPhase).")
    param_gather = property(lambda self: self._param_gather,
                            doc="Whether, how and by whom this chunk's param all-gather is dispatched "
                                "(shard_view.ParamGather).")

    @property
    def overlap_param_gather_with_optimizer_step(self) -> bool:
        """megatron-core's attribute, set by get_megatron_optimizer on the first chunk when OptimizerConfig's
        field of the same name is on: the optimizer dispatches this chunk's param all-gather inside its
        step, so a plain start_param_sync() from a training loop or schedule does not dispatch it again."""
        return self._param_gather.owned_by_step

    @overlap_param_gather_with_optimizer_step.setter
    def overlap_param_gather_with_optimizer_step(self, value: bool) -> None:
        self._param_gather = dataclasses.replace(self._param_gather, owned_by_step=bool(value))

    # ----------------------------------------------------------------- gradients
    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        if getattr(param, "grad_added_to_main_grad", False):
            # A fused weight-gradient kernel (gradient_accumulation_fusion: Transformer Engine, apex)
            # already accumulated into main_grad; autograd's grad is a placeholder.
            self._accumulate(param, None, from_hook=True)
        elif grad is not None:
            self._accumulate(param, grad, from_hook=True)

    def add_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` into ``param.main_grad`` (in the buffer dtype) and mark the param ready.

        The backward hooks call this; code that computes weight gradients outside autograd (deferred
        wgrads) must call it too, before the last micro-batch's grad sync.
        """
        self._accumulate(param, grad)

    def _accumulate(self, param: torch.nn.Parameter, grad: Optional[torch.Tensor], from_hook: bool = False) -> None:
        buf = self._buffer_of.get(id(param))
        if buf is None:
            raise ValueError("add_grad: this param is not managed by this DistributedDataParallel "
                             "(it has requires_grad=False or belongs to another module).")
        bucket = buf.bucket_of(param)
        if bucket.launched:
            message = (
                f"gradient for param '{buf.name_of(param)}' arrived after its bucket {bucket.index} was "
                f"launched for reduction, so it would be lost (rule 7 of docs/contract.md). Flush deferred weight "
                f"gradients before finish_grad_sync(), and call zero_grad_buffer() before a new step's backward."
            )
            if from_hook and self._state.phase is GradSyncPhase.REDUCING:
                # Raising inside this rank's backward would leave the peers in this step's reductions, which
                # this rank would never join: note it, let the backward launch the rest, and let the step
                # raise it on every rank (StepDriver.prepare_grads).
                if self._state.late_gradient is None:
                    self._state.late_gradient = message
                return
            raise LateGradientError(message)
        if grad is not None:
            param.main_grad.add_(grad)  # accumulate in the buffer dtype, then nothing is replaced
        self._state.grads_received += 1
        if self._state.sync_enabled and self.ddp_config.overlap_grad_reduce:
            bucket.mark_ready(param)
            self._launch_order.launch_ready(self._state.force_all_reduce)
            self._note_launches()

    def _note_launches(self) -> None:
        if self._launch_order.launched and self._state.phase is GradSyncPhase.ACCUMULATING:
            self._state.enter(GradSyncPhase.REDUCING)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside accumulate only; the one after it (the last) triggers the reduction."""
        previous, self._state.sync_enabled = self._state.sync_enabled, False
        try:
            yield
        finally:
            self._state.sync_enabled = previous  # nested no_sync() blocks leave sync off until the outermost ends

    @property
    def force_all_reduce(self) -> bool:
        """Megatron-LM sets it for a step whose main grads it saves whole: buckets are all-reduced."""
        return self._state.force_all_reduce

    @force_all_reduce.setter
    def force_all_reduce(self, value: bool) -> None:
        self._state.force_all_reduce = value

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every bucket not yet launched. Positional arguments (megatron-core's
        interleaved schedules pass the chunk's params) are accepted and ignored."""
        self._launch_order.launch_rest(self.ddp_config.overlap_grad_reduce, self._state.force_all_reduce)
        self._note_launches()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Launch every bucket not yet launched (unused params contribute zeros) and wait for all.

        ``force_all_reduce`` (megatron-core's): all-reduce instead of reduce-scatter the buckets not
        yet launched, so every rank's ``main_grad`` holds the whole reduced gradient (Megatron-LM
        saves gradients that way); the optimizer reads its shard of it either way.
        """
        previous = self._state.force_all_reduce
        self._state.force_all_reduce = previous or bool(force_all_reduce)
        try:
            self.start_grad_sync()
        finally:
            self._state.force_all_reduce = previous
        self._launch_order.wait_all()
        self._state.enter(GradSyncPhase.REDUCED)
        if self.ddp_config.check_for_nan_in_grad:
            self._launch_order.raise_if_nonfinite(self.agreement_groups[-1])

    @property
    def agreement_groups(self) -> list[Optional[torch.distributed.ProcessGroup]]:
        """The groups a failure on this rank must reach, in turn: the data-parallel group, and with
        model parallelism every rank of the model (``model_parallel_groups.grad_stats``; a tensor- or
        pipeline-parallel peer that carried on would wait forever in its next collective with this rank)."""
        if self.model_parallel_groups.is_model_parallel:
            return [self.data_parallel_group, self.model_parallel_groups.grad_stats]
        return [self.data_parallel_group]

    def check_params_unchanged(self) -> None:
        """Raise naming the param if the module changed under the wrapper: a param's storage is no
        longer the buffer view (``.data`` reassigned, ``module.to(dtype)``, ``load_state_dict(assign=True)``),
        its dtype changed, ``requires_grad`` was flipped, or the process group appeared after wrapping.
        One pass over the params; zero_grad_buffer() calls it once per step."""
        self._wrapped.check_unchanged(self.module)

    def zero_grad_buffer(self) -> None:
        """Start a new step: zero every grad buffer, reset bucket state and the scale factor."""
        self.check_params_unchanged()
        for buf in self._all_buffers:
            buf.zero_grad()
            for p in buf.params:
                if getattr(p, "grad_added_to_main_grad", False):
                    p.grad_added_to_main_grad = False
        self._launch_order.reset()
        self._normalisation.reset()
        self._state.new_step()

    # ----------------------------------------------------------------- normalisation (normalisation.py)
    @property
    def grad_scale_factor(self) -> torch.Tensor:
        """What this step's reduced gradients must be multiplied by (a 1-element fp32 device tensor;
        change it with set_loss_divisor, set_grad_scale_factor or scale_gradients, never in place)."""
        return self._normalisation.factor

    def scale_gradients(self, factor: Union[float, torch.Tensor]) -> None:
        """Megatron's scale_gradients, deferred: multiplies grad_scale_factor instead of the buffer."""
        self._normalisation.scale(factor)

    def set_grad_scale_factor(self, factor: Union[float, torch.Tensor]) -> None:
        """Set the whole normalisation of this step's gradients, replacing the default 1/DP."""
        self._normalisation.set_factor(factor)

    def set_loss_divisor(self, divisor: Union[float, torch.Tensor]) -> None:
        """Normalise this step's gradients by 1/``divisor`` (e.g. the global token count of a per-token
        loss), replacing the default 1/DP: the factor is exactly fp32(1/divisor)."""
        self.set_grad_scale_factor(loss_divisor_factor(divisor))

    # ----------------------------------------------------------------- params
    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False,
                         expert_parallel: Optional[bool] = None) -> None:
        """All-gather updated param shards; async (waited in forward pre-hooks) with overlap_param_gather.

        ``expert_parallel`` limits it to the dense (False) or expert (True) buffers; positional
        arguments are accepted and ignored, as megatron-core's schedules pass some. As in
        megatron-core, a chunk whose all-gather the optimizer dispatches during its step
        (``overlap_param_gather_with_optimizer_step``) does nothing here unless ``force_dispatch``
        or ``force_sync`` is given.
        """
        if not self._param_gather.dispatches(force_dispatch, force_sync):
            return
        async_op = self._param_gather.is_async(force_sync)
        for buf in self._all_buffers:
            if expert_parallel is not None and buf.is_expert_parallel != expert_parallel:
                continue
            for bucket in reversed(buf.buckets):  # forward order: the first layers' bucket first
                bucket.start_param_sync(async_op)
                if not async_op:
                    bucket.finish_param_sync()

    def finish_param_sync(self) -> None:
        for bucket in self._launch_order.buckets:
            bucket.finish_param_sync()

    def broadcast_params(self) -> None:
        """Make every data-parallel rank (of every optimizer instance) start from rank 0's parameters."""
        for buf in self._all_buffers:
            collectives.broadcast(buf.param_data, 0, buf.data_parallel_group)


__all__ = ["DistributedDataParallel", "LateGradientError", "SUPPORTED_PARAM_DTYPES"]
