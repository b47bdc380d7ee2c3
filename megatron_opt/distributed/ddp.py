"""DistributedDataParallel: grad buffers, backward hooks, bucket reduction and param all-gather.

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
import weakref
from typing import Any, Iterator, Optional, Union, overload

import torch

from ..config import DistributedDataParallelConfig
from ..errors import StepOrderError, UnsupportedConfigError
from .. import collectives
from .buffers import Bucket, LateGradientError, ParamAndGradBuffer
from .ddp_call import check_instance_groups, global_ranks, instance_groups, parse_ddp_call
from .layout import build_buffer_layout, partial_sharding
from .normalisation import GradNormalisation, loss_divisor_factor
from .shard_view import LocalShard
from .parallel_groups import ModelParallelGroups
from .stats_role import resolve_stats_role

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grad_accumulated_hook(ddp: "weakref.ref[DistributedDataParallel]"):
    """The param's post-accumulate-grad hook, holding the wrapper weakly: a strong reference (a bound
    method) makes param -> hook -> wrapper -> module -> param a cycle through autograd's C++ hook
    storage, which Python's collector cannot see, so a dropped wrapper, its model, grad buffers and
    process groups were never freed."""
    def hook(param: torch.nn.Parameter) -> None:
        wrapper = ddp()
        if wrapper is not None:
            wrapper._on_grad_accumulated(param)
    return hook


class DistributedDataParallel(torch.nn.Module):
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
        module = call.module
        self.module = module
        self.config = call.transformer_config  # megatron-core's DDP carries the TransformerConfig too
        self.ddp_config = call.ddp_config
        self.disable_bucketing = call.disable_bucketing
        data_parallel_group, expert_data_parallel_group = call.data_parallel_group, call.expert_data_parallel_group
        self.model_parallel_groups = call.model_parallel
        self.data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group or data_parallel_group
        self._check_membership(data_parallel_group, "data_parallel_group")
        self._check_membership(expert_data_parallel_group, "expert_data_parallel_group")
        self.dp_size = collectives.world_size(data_parallel_group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        local_error = None
        try:
            self._check_params(named)
        except ValueError as exc:
            local_error = str(exc)
        # One collective: a bad param on one rank, or ranks that wrap different models or configs,
        # raise on every rank here instead of hanging or training different params later. With model
        # parallelism the replicas compare fingerprints and then every rank of the model learns the outcome.
        def agree_over_replicas() -> None:
            collectives.agree(
                "DistributedDataParallel", local_error, data_parallel_group, fingerprint=self._fingerprint(named),
                error_type=ValueError,
                fix="Every data-parallel rank must wrap the same model (same param names, order, shapes, dtypes and "
                    "requires_grad) with the same DistributedDataParallelConfig.")
        if self.model_parallel_groups.is_model_parallel:
            collectives.raise_together(agree_over_replicas, self.model_parallel_groups.grad_stats,
                                       "DistributedDataParallel", ValueError)
        else:
            agree_over_replicas()
        # The ranks agree on the config, the DP size and whether expert params can be partially
        # sharded, so the checks below raise on every rank or on none.
        self.num_distributed_optimizer_instances = self.ddp_config.num_distributed_optimizer_instances
        self.intra_instance_group, self.inter_instance_group = self._instance_groups(call, named)
        self._built_distributed = torch.distributed.is_initialized()
        self._all_buffers = self._build_buffers(named)
        self._buffer_of = {id(p): buf for buf in self._all_buffers for p in buf.params}
        self._step_id = 0  # advanced by zero_grad_buffer(): lets the optimizer tell steps apart
        self._grads_received = 0
        self._local_shards: Optional[list[LocalShard]] = None
        self._sync_enabled = True
        self._launch_cursor = 0
        self._inter_cursor = 0  # partial sharding: buckets whose inter-instance all-reduce was launched
        self._buckets = [b for buf in self._all_buffers for b in buf.buckets]
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=named[0][1].device)
        self._normalisation = GradNormalisation(1.0 if call.grad_scale_starts_at_one else 1.0 / self.dp_size,
                                                named[0][1].device)
        self.force_all_reduce = False  # Megatron-LM sets it for a step whose main grads it saves whole
        # Set by get_megatron_optimizer on the first chunk when OptimizerConfig's field of the same
        # name is on: the optimizer dispatches this chunk's param all-gather inside its step, so a
        # plain start_param_sync() from a training loop or schedule must not dispatch it again.
        self.overlap_param_gather_with_optimizer_step = False
        self._storage = {id(p): (p.data_ptr(), p.dtype) for _, p in named}
        for _, p in named:
            p._megatron_opt_wrapped = True  # a second wrapper would fight over the same params
            p.register_post_accumulate_grad_hook(_grad_accumulated_hook(weakref.ref(self)))
        self._param_wait_hooks: list = []
        if self.ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # ----------------------------------------------------------------- construction
    @staticmethod
    def _check_membership(group: Optional[torch.distributed.ProcessGroup], what: str) -> None:
        if group is not None and torch.distributed.is_initialized() and torch.distributed.get_rank(group) < 0:
            raise ValueError(f"DistributedDataParallel: this rank ({torch.distributed.get_rank()}) is not a member of "
                             f"the {what} it was given; pass the group that contains this rank.")

    def _fingerprint(self, named: list) -> list:
        items: list = [(f"trainable param {i}", (n, tuple(p.shape), str(p.dtype))) for i, (n, p) in enumerate(named)]
        items.append(("number of trainable params", len(named)))
        items += [(f"ddp_config.{f.name}", getattr(self.ddp_config, f.name))
                  for f in dataclasses.fields(self.ddp_config)]
        items.append(("data-parallel size", self.dp_size))
        items.append(("model-parallel sizes", self.model_parallel_groups.sizes()))
        if self.ddp_config.num_distributed_optimizer_instances > 1:
            items.append(("expert params share the data-parallel group", self._experts_share_dp_group(named)))
        return items

    def _experts_share_dp_group(self, named: list) -> bool:
        """True when there are no expert-parallel params, or their data-parallel group spans the same
        ranks as the dense one (then partial sharding splits both the same way)."""
        if all(getattr(p, "allreduce", True) for _, p in named):
            return True
        return sorted(global_ranks(self.expert_data_parallel_group)) == sorted(global_ranks(self.data_parallel_group))

    def _instance_groups(self, call: Any, named: list) -> tuple[Any, Any]:
        """(intra-instance, inter-instance) groups: (the data-parallel group, None) with one instance."""
        k = self.ddp_config.num_distributed_optimizer_instances
        if k == 1:
            return self.data_parallel_group, None
        partial_sharding(self.dp_size, k)  # InvalidConfigError unless k divides DP (the same on every rank)
        if not self._experts_share_dp_group(named):
            raise UnsupportedConfigError(
                f"DistributedDataParallelConfig.num_distributed_optimizer_instances={k} with expert-parallel params "
                f"(allreduce=False) whose expert_data_parallel_group differs from the data-parallel group: partial "
                f"sharding of a separate expert data-parallel group is not implemented. Use "
                f"num_distributed_optimizer_instances=1, or expert_data_parallel_group = data_parallel_group.")
        intra, inter = call.intra_instance_group, call.inter_instance_group
        if intra is None:
            intra, inter = instance_groups(self.data_parallel_group, k)
        check_instance_groups(self.data_parallel_group, intra, inter, k)
        return intra, inter

    @staticmethod
    def _check_params(named: list) -> None:
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter with requires_grad=True.")
        empty = [n for n, p in named if p.numel() == 0]
        if empty:
            raise ValueError(f"DistributedDataParallel: param '{empty[0]}' has no elements, so it cannot live in a "
                             f"gradient buffer; freeze it (requires_grad=False) or remove it from the module.")
        wrapped = [n for n, p in named if getattr(p, "_megatron_opt_wrapped", False)]
        if wrapped:
            raise ValueError(f"DistributedDataParallel: param '{wrapped[0]}' is already wrapped by another "
                             f"DistributedDataParallel; wrap each module once (two wrappers would each re-point "
                             f"the param into their own buffer).")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"DistributedDataParallel: all trainable params must be on one device, got {devices}.")
        for name, p in named:
            if p.dtype not in SUPPORTED_PARAM_DTYPES:
                raise ValueError(
                    f"param '{name}' has dtype {p.dtype}; megatron_opt buffers hold float32, bfloat16 or "
                    f"float16 params. Cast the module (e.g. module.to(torch.bfloat16)) or freeze the param "
                    f"(requires_grad=False)."
                )

    def _build_buffers(self, named: list) -> list[ParamAndGradBuffer]:
        cfg = self.ddp_config
        groups: dict[tuple, list] = {}
        for name, p in named:
            grad_dtype = torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype
            is_expert = not getattr(p, "allreduce", True)
            groups.setdefault((p.dtype, grad_dtype, is_expert), []).append((name, p))
        bucket_size = cfg.bucket_size
        if bucket_size is None and cfg.overlap_grad_reduce:
            bucket_size = max(40_000_000, 1_000_000 * self.dp_size)  # Megatron-LM's default
        if self.disable_bucketing or self.model_parallel_groups.pipeline_parallel_rank > 0:
            # megatron-core's disable_bucketing, and its rule for pipeline stages after the first (their
            # gradient reduction is off the critical path): one bucket per buffer.
            bucket_size = None
        buffers = []
        for (_, grad_dtype, is_expert), members in groups.items():
            full_group = self.expert_data_parallel_group if is_expert else self.data_parallel_group
            # Partial sharding: shard over one instance (the layout is sized by it, Megatron-LM PR #6048)
            # and all-reduce each shard across instances. Experts then share the dense groups.
            group = self.intra_instance_group if self.inter_instance_group is not None else full_group
            shard_count = collectives.world_size(group) if cfg.use_distributed_optimizer else 1
            params = [p for _, p in members]
            layout = build_buffer_layout(
                [p.numel() for p in params],
                shard_count,
                bucket_size=bucket_size,
                pad_for_high_nccl_busbw=cfg.pad_buckets_for_high_nccl_busbw,
                own_bucket=[getattr(p, "shared_embedding", False) for p in params],
            )
            buffers.append(
                ParamAndGradBuffer(
                    params, [n for n, _ in members], layout, grad_dtype, group,
                    reduce_scatter=cfg.use_distributed_optimizer, is_expert_parallel=is_expert,
                    inter_group=self.inter_instance_group, data_parallel_group=full_group,
                )
            )
        return buffers

    # ----------------------------------------------------------------- forward pre-hooks (overlap_param_gather)
    def enable_forward_pre_hook(self) -> None:
        """Make each submodule's forward wait for the all-gather of its params' buckets (installed at
        construction with overlap_param_gather; Megatron-LM removes them around evaluation and saves)."""
        if not self.ddp_config.overlap_param_gather:
            raise StepOrderError("enable_forward_pre_hook() needs DistributedDataParallelConfig.overlap_param_gather=True "
                                 "(without it the param all-gather is synchronous and there is nothing to wait for).")
        if self._param_wait_hooks:
            raise StepOrderError("enable_forward_pre_hook(): the forward pre-hooks are already enabled; call "
                                 "disable_forward_pre_hook() first.")
        for module in self.module.modules():
            buckets: dict[int, Bucket] = {}
            for p in module.parameters(recurse=False):
                if id(p) in self._buffer_of:
                    bucket = self._buffer_of[id(p)].bucket_of(p)
                    buckets[id(bucket)] = bucket
            if buckets:
                self._param_wait_hooks.append(
                    module.register_forward_pre_hook(self._make_param_wait_hook(list(buckets.values()))))

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; with ``param_sync`` first finish every param all-gather, so the
        module holds the updated params without them."""
        if not self.ddp_config.overlap_param_gather:
            raise StepOrderError("disable_forward_pre_hook() needs DistributedDataParallelConfig.overlap_param_gather=True.")
        for handle in self._param_wait_hooks:
            handle.remove()
        self._param_wait_hooks = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    @property
    def remove_forward_pre_hook_handles(self) -> list:
        """The installed forward pre-hook handles (empty when disabled); Megatron-LM reads its length."""
        return list(self._param_wait_hooks)

    @staticmethod
    def _make_param_wait_hook(buckets: list[Bucket]):
        def hook(module, args):
            for bucket in buckets:
                bucket.finish_param_sync()
        return hook

    # ----------------------------------------------------------------- the optimizer's view (shard_view.GradSource)
    def local_shards(self, expert_parallel: Optional[bool] = None) -> list[LocalShard]:
        """This rank's shard of every bucket, in buffer and bucket order (dense or expert only if asked)."""
        if self._local_shards is None:
            self._local_shards = [self._publish(bi, buf, bucket) for bi, buf in enumerate(self._all_buffers)
                                  for bucket in buf.buckets]
        return [s for s in self._local_shards if expert_parallel is None or s.is_expert_parallel == expert_parallel]

    def _publish(self, buffer_index: int, buf: ParamAndGradBuffer, bucket: Bucket) -> LocalShard:
        members = {buf.param_index[id(p)]: p for p in bucket.params}
        sharded = buf.reduce_scatter and buf.shard_count > 1
        instance_count = collectives.world_size(buf.inter_group) if buf.inter_group is not None else 1
        instance_rank = collectives.rank(buf.inter_group) if buf.inter_group is not None else 0
        return LocalShard.make(
            params=members, names={i: buf.names[i] for i in members},
            grad=bucket.grad_shard, param=bucket.param_shard,
            pieces=tuple(buf.layout.shard_pieces(bucket.index, buf.rank)),
            group=buf.group, sharded=sharded,
            is_expert_parallel=buf.is_expert_parallel, buffer_index=buffer_index, bucket_index=bucket.index,
            rank=buf.rank, shard_count=buf.shard_count,
            unscale_factor=self._normalisation.unscale_factor(buf.grad_prescale),
            stats_role=resolve_stats_role(buf.group, sharded, buf.data_parallel_group, instance_rank, instance_count,
                                          self.model_parallel_groups),
            grad_prescale=buf.grad_prescale,
            data_parallel_group=buf.data_parallel_group, inter_instance_group=buf.inter_group,
            instance_count=instance_count, instance_rank=instance_rank,
            tensor_parallel_group=self._tensor_parallel_group(buf.is_expert_parallel),
        )

    def _tensor_parallel_group(self, expert: bool) -> Optional[torch.distributed.ProcessGroup]:
        groups = self.model_parallel_groups
        group = groups.expert_tensor if expert and groups.expert_tensor is not None else groups.tensor
        return group if group is not None and collectives.world_size(group) > 1 else None

    @property
    def step_id(self) -> int:
        """Advanced by every zero_grad_buffer(): the gradients in the buffers belong to this step."""
        return self._step_id

    @property
    def grads_received(self) -> int:
        """Gradients accumulated since zero_grad_buffer() (0 means no backward ran this step)."""
        return self._grads_received

    # ----------------------------------------------------------------- forward / state
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's checkpoint state dict (its own state_dict_for_save_checkpoint when it has
        one, as megatron-core's modules do), without this wrapper's 'module.' prefix."""
        inner = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if callable(inner):
            return inner(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """The wrapped module's megatron-core sharded state dict (Megatron-LM's torch_dist model checkpoint)."""
        inner = getattr(self.module, "sharded_state_dict", None)
        if not callable(inner):
            raise UnsupportedConfigError(
                f"sharded_state_dict(): the wrapped {type(self.module).__name__} has no sharded_state_dict (only "
                f"megatron-core modules do). Save with megatron_opt.checkpoint.save, or Megatron-LM's "
                f"--ckpt-format torch.")
        return inner(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    def set_is_first_microbatch(self) -> None:
        """Tell the wrapped modules a new step's first micro-batch starts (Transformer Engine refreshes
        its fp8 weight caches on it); megatron-core's modules decide themselves whether it matters."""
        inner = getattr(self.module, "set_is_first_microbatch", None)
        if callable(inner):
            inner()
            return
        for m in self.module.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True

    @property
    def buffers(self) -> list[ParamAndGradBuffer]:  # type: ignore[override]  (megatron-core's name)
        """The dense (non-expert) param and grad buffers."""
        return [b for b in self._all_buffers if not b.is_expert_parallel]

    @property
    def expert_parallel_buffers(self) -> list[ParamAndGradBuffer]:
        """The expert-parallel buffers (params with ``allreduce == False``)."""
        return [b for b in self._all_buffers if b.is_expert_parallel]

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        raise UnsupportedConfigError(
            "offload_grad_buffers(): megatron_opt does not free its grad buffers between steps (the optimizer's "
            "step plans point into them); run without Megatron-LM's grad-buffer offloading.")

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        raise UnsupportedConfigError("restore_grad_buffers(): grad-buffer offloading is not supported by megatron_opt.")

    # ----------------------------------------------------------------- gradients
    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        if getattr(param, "grad_added_to_main_grad", False):
            # A fused weight-gradient kernel (gradient_accumulation_fusion: Transformer Engine, apex)
            # already accumulated into main_grad; autograd's grad is a placeholder.
            self._accumulate(param, None)
        elif grad is not None:
            self.add_grad(param, grad)

    def add_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` into ``param.main_grad`` (in the buffer dtype) and mark the param ready.

        The backward hooks call this; code that computes weight gradients outside autograd (deferred
        wgrads) must call it too, before the last micro-batch's grad sync.
        """
        self._accumulate(param, grad)

    def _accumulate(self, param: torch.nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        buf = self._buffer_of.get(id(param))
        if buf is None:
            raise ValueError("add_grad: this param is not managed by this DistributedDataParallel "
                             "(it has requires_grad=False or belongs to another module).")
        bucket = buf.bucket_of(param)
        if bucket.launched:
            raise LateGradientError(
                f"gradient for param '{buf.name_of(param)}' arrived after its bucket {bucket.index} was "
                f"launched for reduction, so it would be lost (rule 7 of docs/contract.md). Flush deferred weight "
                f"gradients before finish_grad_sync(), and call zero_grad_buffer() before a new step's backward."
            )
        if grad is not None:
            param.main_grad.add_(grad)  # accumulate in the buffer dtype, then nothing is replaced
        self._grads_received += 1
        if self._sync_enabled and self.ddp_config.overlap_grad_reduce:
            bucket.mark_ready(param)
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order so every rank issues its collectives in the same order,
        # even when a param's grad is missing on some ranks (it then waits for finish_grad_sync).
        while self._launch_cursor < len(self._buckets):
            bucket = self._buckets[self._launch_cursor]
            if not bucket.all_ready:
                break
            self._launch(bucket, async_op=True)
        self._launch_inter_syncs()

    def _launch_inter_syncs(self) -> None:
        """Partial sharding: launch the inter-instance all-reduce of every launched bucket whose
        reduce-scatter has finished, strictly in bucket order (an unfinished one stops the scan)."""
        if self.inter_instance_group is None:
            return
        while self._inter_cursor < self._launch_cursor:
            if not self._buckets[self._inter_cursor].start_inter_sync(block=False):
                return
            self._inter_cursor += 1

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        if self.ddp_config.check_for_nan_in_grad:
            self._nonfinite += torch.isfinite(bucket.grad_data).logical_not_().sum()
        bucket.start_grad_sync(async_op, all_reduce=self.force_all_reduce)
        self._launch_cursor += 1  # buckets are launched strictly in order

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside accumulate only; the one after it (the last) triggers the reduction."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous  # nested no_sync() blocks leave sync off until the outermost ends

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every bucket not yet launched. Positional arguments (megatron-core's
        interleaved schedules pass the chunk's params) are accepted and ignored."""
        for bucket in self._buckets[self._launch_cursor :]:
            self._launch(bucket, async_op=self.ddp_config.overlap_grad_reduce)
        self._launch_inter_syncs()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Launch every bucket not yet launched (unused params contribute zeros) and wait for all.

        ``force_all_reduce`` (megatron-core's): all-reduce instead of reduce-scatter the buckets not
        yet launched, so every rank's ``main_grad`` holds the whole reduced gradient (Megatron-LM
        saves gradients that way); the optimizer reads its shard of it either way.
        """
        previous = self.force_all_reduce
        self.force_all_reduce = previous or bool(force_all_reduce)
        try:
            self.start_grad_sync()
        finally:
            self.force_all_reduce = previous
        for bucket in self._buckets:
            bucket.finish_grad_sync()
        if self.ddp_config.check_for_nan_in_grad:
            flag = self._nonfinite.clone()
            collectives.all_reduce(flag, self._failure_group())
            if int(flag.item()) > 0:  # every rank sees the same reduced count and raises together
                raise RuntimeError(
                    f"check_for_nan_in_grad: {int(flag.item())} non-finite gradient elements found before "
                    f"the data-parallel reduction. Inspect the loss and the inputs of this step."
                )

    def _failure_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self.agreement_groups[-1]

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
        if not self._built_distributed and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise StepOrderError("DistributedDataParallel was built before init_process_group(), so its buffers are "
                                 "not sharded or reduced over the data-parallel ranks; wrap the model after "
                                 "torch.distributed.init_process_group().")
        fix = ("Make such changes before wrapping (cast, load and freeze first), or copy values in place "
               "(param.data.copy_(...), load_state_dict without assign=True).")
        trainable = 0
        for name, p in self.module.named_parameters():
            expected = self._storage.get(id(p))
            if expected is None:
                if p.requires_grad:
                    raise ValueError(f"param '{name}' is not the param that was wrapped: it was replaced (e.g. "
                                     f"load_state_dict(assign=True), a new nn.Parameter) or became trainable after "
                                     f"wrapping, so it is not in megatron_opt's buffers and would never be updated. {fix}")
                continue
            trainable += 1
            if not p.requires_grad:
                raise ValueError(f"param '{name}' had requires_grad set to False after wrapping; it is still in the "
                                 f"buffers and the optimizer would keep updating it. {fix}")
            if (p.data_ptr(), p.dtype) != expected:
                raise ValueError(f"param '{name}' no longer lives in megatron_opt's buffer (its storage or dtype "
                                 f"changed after wrapping: now {p.dtype}), so training would not change it. {fix}")
        if trainable != len(self._storage):
            raise ValueError(f"{len(self._storage) - trainable} wrapped param(s) are no longer in the module. {fix}")

    def zero_grad_buffer(self) -> None:
        """Start a new step: zero every grad buffer, reset bucket state and the scale factor."""
        self.check_params_unchanged()
        for buf in self._all_buffers:
            buf.zero_grad()
            for p in buf.params:
                if getattr(p, "grad_added_to_main_grad", False):
                    p.grad_added_to_main_grad = False
        self._launch_cursor = 0
        self._inter_cursor = 0
        self._nonfinite.zero_()
        self._normalisation.reset()
        self._grads_received = 0
        self._step_id += 1

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
        if self.overlap_param_gather_with_optimizer_step and not (force_dispatch or force_sync):
            return
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        for buf in self._all_buffers:
            if expert_parallel is not None and buf.is_expert_parallel != expert_parallel:
                continue
            for bucket in reversed(buf.buckets):  # forward order: the first layers' bucket first
                bucket.start_param_sync(async_op)
                if not async_op:
                    bucket.finish_param_sync()

    def finish_param_sync(self) -> None:
        for bucket in self._buckets:
            bucket.finish_param_sync()

    def broadcast_params(self) -> None:
        """Make every data-parallel rank (of every optimizer instance) start from rank 0's parameters."""
        for buf in self._all_buffers:
            collectives.broadcast(buf.param_data, 0, buf.data_parallel_group)
