"""The gradient buffers of one model chunk and the order their buckets are reduced in.

``build_buffers`` groups the trainable params into ``ParamAndGradBuffer``s by (param dtype, grad
dtype, expert-parallel) and sizes their buckets (Megatron-LM's rules). ``BucketLaunchOrder`` is the
reduction's per-step state: buckets are launched strictly in bucket order, so every rank issues its
collectives in the same order even when a param's gradient is missing on some ranks (that bucket then
waits for finish_grad_sync()); with partial sharding each launched bucket's inter-instance all-reduce
follows in the same order. It also keeps the non-finite count of ``check_for_nan_in_grad``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import collectives
from ..config import DistributedDataParallelConfig
from .buffers import Bucket, ParamAndGradBuffer
from .layout import build_buffer_layout

NamedParams = list[tuple[str, torch.nn.Parameter]]


def bucket_size_of(cfg: DistributedDataParallelConfig, dp_size: int, one_bucket: bool) -> Optional[int]:
    """Elements per bucket (None: one bucket per buffer). ``one_bucket``: megatron-core's
    disable_bucketing, and its rule for pipeline stages after the first (their gradient reduction is
    off the critical path)."""
    if one_bucket:
        return None
    if cfg.bucket_size is None and cfg.overlap_grad_reduce:
        return max(40_000_000, 1_000_000 * dp_size)  # Megatron-LM's default
    return cfg.bucket_size


def build_buffers(named: NamedParams, cfg: DistributedDataParallelConfig, bucket_size: Optional[int],
                  data_parallel_group: Optional[torch.distributed.ProcessGroup],
                  expert_data_parallel_group: Optional[torch.distributed.ProcessGroup],
                  intra_instance_group: Optional[torch.distributed.ProcessGroup],
                  inter_instance_group: Optional[torch.distributed.ProcessGroup]) -> list[ParamAndGradBuffer]:
    """One buffer per (param dtype, grad dtype, expert-parallel), in the order the params first show them."""
    groups: dict[tuple, NamedParams] = {}
    for name, p in named:
        grad_dtype = torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype
        is_expert = not getattr(p, "allreduce", True)
        groups.setdefault((p.dtype, grad_dtype, is_expert), []).append((name, p))
    buffers = []
    for (_, grad_dtype, is_expert), members in groups.items():
        full_group = expert_data_parallel_group if is_expert else data_parallel_group
        # Partial sharding: shard over one instance (the layout is sized by it, Megatron-LM PR #6048)
        # and all-reduce each shard across instances. Experts then share the dense groups.
        group = intra_instance_group if inter_instance_group is not None else full_group
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
                inter_group=inter_instance_group, data_parallel_group=full_group,
            )
        )
    return buffers


class BucketLaunchOrder:
    """Which buckets of a chunk were launched this step, strictly in bucket order."""

    def __init__(self, buckets: list[Bucket], partial_sharding: bool, check_for_nan: bool,
                 device: torch.device) -> None:
        self.buckets = buckets
        self.partial_sharding = partial_sharding
        self.check_for_nan = check_for_nan
        self.launched = 0  # buckets [0, launched) were launched
        self.inter_launched = 0  # partial sharding: buckets whose inter-instance all-reduce was launched
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.launched = 0
        self.inter_launched = 0
        self.nonfinite.zero_()

    def launch_ready(self, all_reduce: bool) -> None:
        """Launch (asynchronously) every bucket, in order, up to the first one still waiting for a gradient."""
        while self.launched < len(self.buckets):
            bucket = self.buckets[self.launched]
            if not bucket.all_ready:
                break
            self._launch(bucket, async_op=True, all_reduce=all_reduce)
        for bucket in self.buckets[: self.launched]:
            bucket.finish_grad_sync_if_arrived()
        self._launch_inter_syncs()

    def launch_rest(self, async_op: bool, all_reduce: bool) -> None:
        """Launch every bucket not launched yet (unused params contribute zeros)."""
        for bucket in self.buckets[self.launched :]:
            self._launch(bucket, async_op=async_op, all_reduce=all_reduce)
        self._launch_inter_syncs()

    def wait_all(self) -> None:
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def _launch(self, bucket: Bucket, async_op: bool, all_reduce: bool) -> None:
        if self.check_for_nan:
            self.nonfinite += nonfinite_probe(bucket.grad_data)
        bucket.start_grad_sync(async_op, all_reduce=all_reduce)
        self.launched += 1

    def _launch_inter_syncs(self) -> None:
        """Partial sharding: launch the inter-instance all-reduce of every launched bucket whose
        reduce-scatter has finished, strictly in bucket order (an unfinished one stops the scan)."""
        if not self.partial_sharding:
            return
        while self.inter_launched < self.launched:
            if not self.buckets[self.inter_launched].start_inter_sync(block=False):
                return
            self.inter_launched += 1

    def raise_if_nonfinite(self, group: Optional[torch.distributed.ProcessGroup]) -> None:
        """check_for_nan_in_grad: sum this step's non-finite counts over ``group`` and raise on every
        rank together when any rank saw one."""
        flag = self.nonfinite.clone()
        collectives.all_reduce(flag, group)
        if int(flag.item()) > 0:  # every rank sees the same reduced count and raises together
            what = ("non-finite gradient elements" if self.nonfinite.device.type == "cpu"
                    else "gradient buckets with non-finite values")
            raise RuntimeError(
                f"check_for_nan_in_grad: {int(flag.item())} {what} found before the data-parallel "
                f"reduction. Inspect the loss and the inputs of this step."
            )


def nonfinite_probe(grad: torch.Tensor) -> torch.Tensor:
    """check_for_nan_in_grad's test of one bucket before its reduction, as one plain sum (NaN and inf
    propagate through it): the number of non-finite elements on CPU, where a host read is free and
    the exact count is taken only when the sum is not finite (it also is when finite values overflow
    it); on CUDA, with no host read, 1 when the sum is not finite, else 0. megatron-core's check is a
    norm, whose squares overflow long before a sum does."""
    if grad.device.type == "cpu":
        if math.isfinite(float(grad.sum())):
            return torch.zeros((), dtype=torch.int64)
        return torch.isfinite(grad).logical_not_().sum()
    return grad.sum(dtype=torch.float32).isfinite().logical_not_().to(torch.int64)


__all__ = ["build_buffers", "bucket_size_of", "BucketLaunchOrder", "nonfinite_probe"]
