"""Contiguous param and grad storage for the params of one (param dtype, grad dtype) pair.

After construction every param's ``.data`` is a view into ``param_data`` and ``param.main_grad``
is a view into ``grad_data``. Buckets are the unit of communication; each carries its own
launch state so a gradient arriving after its bucket was sent is caught, not lost.

With partial sharding (``inter_group`` set) a bucket's gradient reduction is two collectives: the
reduce-scatter over ``group`` (one optimizer instance), then the all-reduce of this rank's shard over
``inter_group`` (the ranks holding the same shard in the other instances). The all-reduce may only
start once the reduce-scatter has finished, and the bucket's gradients are ready only when both have;
the param all-gather stays within ``group``.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import collectives
from ..host_reduction import ReceiveSlots, abandon, finish_if_done, receive_numel
from ..errors import LateGradientError  # noqa: F401  (defined in errors.py; still importable from here)
from .layout import BufferLayout, Range
from .normalisation import reduce_prescale


class Bucket:
    def __init__(self, buffer: "ParamAndGradBuffer", index: int, rng: Range, params: list[torch.nn.Parameter]):
        self.buffer = buffer
        self.index = index
        self.range = rng
        self.params = params
        self.param_data = buffer.param_data[rng.start : rng.end]
        self.grad_data = buffer.grad_data[rng.start : rng.end]
        shard = buffer.layout.buckets[index].shard_range(buffer.rank, buffer.shard_count)
        self.grad_shard = buffer.grad_data[shard.start : shard.end]
        self.param_shard = buffer.param_data[shard.start : shard.end]
        self._pending: set[int] = set()
        self.grad_handle = None  # the reduction over the buffer's group (one instance)
        self.inter_handle = None  # the all-reduce over the inter-instance group, once launched
        self._inter_target: Optional[torch.Tensor] = None  # what the inter all-reduce still has to reduce
        self.param_handle = None
        self.reset()

    @property
    def launched(self) -> bool:
        return self.grad_handle is not None

    def reset(self) -> None:
        # A host reduction still pending (a step that failed before finish_grad_sync) must not write its
        # sum into the next step's gradients when its receive slot is next needed.
        abandon(self.grad_handle)
        abandon(self.inter_handle)
        self._pending = {id(p) for p in self.params}
        self.grad_handle = None
        self.inter_handle = None
        self._inter_target = None

    @property
    def all_ready(self) -> bool:
        return not self._pending

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Record that ``param``'s last gradient of the step is in (see ``all_ready``)."""
        self._pending.discard(id(param))

    def start_grad_sync(self, async_op: bool, all_reduce: bool = False) -> None:
        """Launch this bucket's reduction; ``all_reduce`` replaces the reduce-scatter with an all-reduce
        (the shard then holds the same sum, and so does the rest of the bucket)."""
        if self.launched:
            return
        if self.buffer.grad_prescale != 1.0:
            self.grad_data.mul_(self.buffer.grad_prescale)
        # Partial sharding on CUDA with overlap: both collectives go on a side stream, the all-reduce
        # right behind the reduce-scatter (as Megatron-LM does), so every rank launches them in the same
        # global order (RS b0, AR b0, RS b1, ...) whatever the timing, and the compute stream does not
        # wait. The side stream first waits for the compute stream, where the gradients were accumulated
        # and pre-scaled (Megatron-LM #3670: a reduction that does not wait for them reads stale values).
        stream = self.buffer.communication_stream() if async_op else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.buffer.reduce_scatter and not all_reduce:
                self.grad_handle = collectives.reduce_scatter(self.grad_data, self.grad_shard, self.buffer.group,
                                                              async_op, self.buffer.receive_slots)
                target = self.grad_shard
            else:
                self.grad_handle = collectives.all_reduce(self.grad_data, self.buffer.group, async_op=async_op)
                target = self.grad_data  # force_all_reduce: every rank holds the whole bucket, so reduce all of it
            if self.buffer.inter_group is not None:
                self._inter_target = target
                if not async_op or stream is not None:
                    self.start_inter_sync(block=True)

    def start_inter_sync(self, block: bool) -> bool:
        """Launch the inter-instance all-reduce of this bucket once its intra-instance reduction has
        finished (``block``: wait for it; else only if it already has). True when nothing is left to
        launch. On the CPU (gloo) the caller polls launched buckets in bucket order, so every member of
        an inter-instance group issues the all-reduces in the same order while the backward goes on."""
        if self._inter_target is None:
            return True
        if not block:
            done = getattr(self.grad_handle, "is_completed", None)
            if done is None or not done():
                return False
        # The all-reduce must read the reduce-scatter's result: wait for it first (gloo: the host
        # waits; CUDA: the current stream waits, and the all-reduce is issued behind it).
        self._wait_grad_handle()
        target, self._inter_target = self._inter_target, None
        slots = self.buffer.inter_slots if target is self.grad_shard else None  # force_all_reduce: whole bucket
        self.inter_handle = collectives.all_reduce(target, self.buffer.inter_group, async_op=True, slots=slots)
        return True

    def finish_grad_sync_if_arrived(self) -> None:
        """On the CPU: finish a launched reduction whose data has arrived (its sum now, while the
        backward goes on, not at its end). Partial sharding polls through ``start_inter_sync``."""
        if self.buffer.inter_group is None and finish_if_done(self.grad_handle):
            self.grad_handle = collectives.DONE

    def finish_grad_sync(self) -> None:
        self.start_grad_sync(async_op=False)
        if self.buffer.inter_group is None:
            self._wait_grad_handle()
            return
        self.start_inter_sync(block=True)
        handle, self.inter_handle = self.inter_handle, collectives.DONE
        handle.wait()

    def _wait_grad_handle(self) -> None:
        # Wait once, then forget the handle: on gloo a second wait() of an async reduce-scatter copies
        # its result into the shard again, undoing what was done to main_grad in between (megatron-core's
        # finalize_model_grads sums sequence-parallel grads over TP and all-reduces the tied embedding in
        # place, and the optimizer then calls finish_grad_sync once more).
        handle, self.grad_handle = self.grad_handle, collectives.DONE
        handle.wait()

    def start_param_sync(self, async_op: bool) -> None:
        if self.buffer.shard_count == 1:
            return  # every rank updated the whole bucket itself
        # An all-gather still in flight (dispatched by the step, then a forced sync before the next
        # forward) is waited first: a dropped handle would leave it writing the buffer unobserved.
        self.finish_param_sync()
        self.param_handle = collectives.all_gather(self.param_data, self.param_shard, self.buffer.group, async_op)

    def finish_param_sync(self) -> None:
        if self.param_handle is not None:
            handle, self.param_handle = self.param_handle, None
            handle.wait()


class ParamAndGradBuffer:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        layout: BufferLayout,
        grad_dtype: torch.dtype,
        group: Optional[torch.distributed.ProcessGroup],
        reduce_scatter: bool,
        is_expert_parallel: bool = False,
        inter_group: Optional[torch.distributed.ProcessGroup] = None,
        data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        """``group``: the ranks that shard this buffer (reduce-scatter and all-gather); with partial
        sharding, one optimizer instance. ``inter_group``: the ranks holding the same shard in the
        other instances (None without partial sharding). ``data_parallel_group``: every rank whose
        gradient enters the sum (the group itself without partial sharding)."""
        if len(params) != len(layout.numels):
            raise ValueError("layout and params disagree")
        self.params = params
        self.names = names
        self.layout = layout
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.group = group
        self.inter_group = inter_group
        self.data_parallel_group = group if inter_group is None else data_parallel_group
        self.reduce_scatter = reduce_scatter
        self.is_expert_parallel = is_expert_parallel
        self.shard_count = layout.shard_count
        self.rank = collectives.rank(group) if reduce_scatter else 0
        # The sum runs over the whole data-parallel group, every instance included; 16-bit buckets are
        # pre-scaled by 1/ranks before it (normalisation.py, which also undoes it in the unscale factor).
        ranks = collectives.world_size(group) * (collectives.world_size(inter_group) if inter_group is not None else 1)
        self.reduce_ranks = ranks
        self.grad_prescale = reduce_prescale(grad_dtype, ranks)
        device = params[0].device
        self.param_data = torch.zeros(layout.numel, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(layout.numel, dtype=grad_dtype, device=device)
        self.param_index = {id(p): i for i, p in enumerate(params)}
        for i, p in enumerate(params):
            rng = layout.param_ranges[i]
            view = self.param_data[rng.start : rng.end]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(p.shape)
            p.main_grad = self.grad_data[rng.start : rng.end].view(p.shape)
        self._stream: Optional[torch.cuda.Stream] = None
        # The host reduce-scatter's receive space (CPU, sharded): two slots sized for the largest bucket, reused.
        largest = max(b.range.end - b.range.start for b in layout.buckets)
        self.receive_slots: Optional[ReceiveSlots] = None
        if reduce_scatter and self.shard_count > 1 and device.type == "cpu":
            self.receive_slots = ReceiveSlots(receive_numel(largest, self.shard_count, self.rank), grad_dtype)
        # ... and the inter-instance all-reduce's (partial sharding): every instance's copy of one shard.
        self.inter_slots: Optional[ReceiveSlots] = None
        if reduce_scatter and inter_group is not None and device.type == "cpu":
            self.inter_slots = ReceiveSlots(collectives.world_size(inter_group) * (largest // self.shard_count),
                                            grad_dtype)
        self.buckets = [
            Bucket(self, b.index, b.range, [params[i] for i in b.param_indices]) for b in layout.buckets
        ]

    def communication_stream(self) -> Optional["torch.cuda.Stream"]:
        """The side stream of the overlapped two-step gradient reduction (partial sharding on CUDA), else None."""
        if self.inter_group is None or self.grad_data.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.grad_data.device)
        return self._stream

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self.buckets[self.layout.param_bucket[self.param_index[id(param)]]]

    def name_of(self, param: torch.nn.Parameter) -> str:
        return self.names[self.param_index[id(param)]]

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
