"""Pure range math for the contiguous param/grad buffers: no tensors, no process groups.

A buffer holds the params of one (param dtype, grad dtype) pair. Params are laid out in reverse
registration order (the order backward produces their grads), each start aligned to
``param_align`` elements. Buckets are closed once they reach ``bucket_size`` elements, and every
bucket end is padded to a multiple of lcm(64 * shard_count, 128) (see ``bucket_alignment``), so the
bucket splits into ``shard_count`` equal contiguous shards (gloo's reduce-scatter needs equal
chunks) and every shard size, hence every shard start, is a multiple of 64 elements for every
shard count. Shards ignore param boundaries: a param may straddle ranks. ``shard_count`` is the
data-parallel size, or with partial sharding (``num_distributed_optimizer_instances = k``) the size
of one optimizer instance, DP / k (``PartialSharding``).

Why 64: the CUDA kernels take their 16-byte vector path only when every array of a launch has the
same element phase. A 16-byte vector is 4 fp32 or 8 16-bit elements; master weights and moments are
fresh allocations (phase 0), while grad and param shards are views at ``shard.start``. A start that is
a multiple of 64 elements is 128-byte aligned for 16-bit and 256-byte aligned for fp32, so phase 0 for
either. Padding buckets to lcm(shard_count, 128) alone is not enough: a shard start is then only a
multiple of 128 / gcd(DP, 128) elements, which is less than 8 (one 16-bit vector) whenever 32 divides
DP (4 at DP=32, 2 at DP=64, 1 at DP=128 or 256).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import InvalidConfigError

PARAM_ALIGN = 64  # elements; keeps every param start 128-byte aligned for bf16, 256 for fp32
SHARD_ALIGN = 64  # elements; every shard size and start is a multiple (same reason as PARAM_ALIGN)
BUCKET_ALIGN = 128  # elements; every padded bucket size is a multiple


@dataclass(frozen=True)
class Range:
    """Half-open element range [start, end)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Range") -> Optional["Range"]:
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return Range(lo, hi) if lo < hi else None

    def shift(self, by: int) -> "Range":
        return Range(self.start + by, self.end + by)


@dataclass(frozen=True)
class BucketLayout:
    index: int
    range: Range  # in buffer coordinates, padded end
    param_indices: tuple[int, ...]  # indices into the buffer's param list

    def shard_range(self, rank: int, shard_count: int) -> Range:
        """Buffer-coordinate range owned by ``rank`` inside this bucket."""
        size = self.range.size // shard_count
        start = self.range.start + rank * size
        return Range(start, start + size)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one param that falls inside one rank's shard of one bucket."""

    param_index: int
    buffer_range: Range  # in buffer coordinates
    param_range: Range  # in the flattened param's coordinates
    shard_range: Range  # in the shard's own coordinates (0 = first element of the shard)


@dataclass(frozen=True)
class BufferLayout:
    numels: tuple[int, ...]  # per param, in registration order
    param_ranges: tuple[Range, ...]  # per param, buffer coordinates
    param_bucket: tuple[int, ...]  # per param, its bucket index
    buckets: tuple[BucketLayout, ...]
    shard_count: int

    @property
    def numel(self) -> int:
        return self.buckets[-1].range.end if self.buckets else 0

    def shard_pieces(self, bucket_index: int, rank: int) -> list[ShardPiece]:
        """Param pieces owned by ``rank`` in one bucket, in buffer order."""
        bucket = self.buckets[bucket_index]
        shard = bucket.shard_range(rank, self.shard_count)
        pieces = []
        for i in sorted(bucket.param_indices, key=lambda j: self.param_ranges[j].start):
            overlap = self.param_ranges[i].intersect(shard)
            if overlap is None:
                continue
            p0 = self.param_ranges[i].start
            pieces.append(
                ShardPiece(
                    param_index=i,
                    buffer_range=overlap,
                    param_range=overlap.shift(-p0),
                    shard_range=overlap.shift(-shard.start),
                )
            )
        return pieces


@dataclass(frozen=True)
class PartialSharding:
    """How ``num_instances`` optimizer instances split ``dp_size`` data-parallel ranks (pure rank math).

    As megatron-core's ``initialize_model_parallel(num_distributed_optimizer_instances=k)``: instance
    i is the consecutive block of data-parallel ranks ``[i*s, (i+1)*s)``, ``s = dp_size / k``, and
    shards every bucket over its ``s`` ranks (``shard_count``). The ranks holding the same shard in
    each instance (``shard_rank`` j: ranks ``j, j+s, j+2s, ...``) form the inter-instance group that
    all-reduces that shard. Ranks here are positions in the (sorted) data-parallel group.
    """

    dp_size: int
    num_instances: int

    @property
    def shard_count(self) -> int:
        """Shards per bucket: the size of one instance. The layout must be sized by this, not by
        dp_size, or the trailing shards would belong to no rank (Megatron-LM PR #6048)."""
        return self.dp_size // self.num_instances

    def instance_of(self, dp_rank: int) -> int:
        return dp_rank // self.shard_count

    def shard_rank_of(self, dp_rank: int) -> int:
        """The shard this rank owns in every bucket (its rank in its instance)."""
        return dp_rank % self.shard_count

    def instance_ranks(self, instance: int) -> list[int]:
        """The data-parallel ranks of one instance (the intra-instance group), in shard order."""
        return list(range(instance * self.shard_count, (instance + 1) * self.shard_count))

    def replica_ranks(self, shard_rank: int) -> list[int]:
        """The data-parallel ranks that hold shard ``shard_rank``, one per instance (the inter-instance group)."""
        return list(range(shard_rank, self.dp_size, self.shard_count))


def partial_sharding(dp_size: int, num_instances: int) -> PartialSharding:
    """The instance split of ``dp_size`` ranks; InvalidConfigError unless ``num_instances`` divides it."""
    if dp_size < 1:
        raise ValueError(f"the data-parallel size must be >= 1, got {dp_size}")
    if num_instances < 1 or dp_size % num_instances:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise InvalidConfigError(
            f"DistributedDataParallelConfig.num_distributed_optimizer_instances={num_instances} does not divide the "
            f"data-parallel size {dp_size}: each optimizer instance shards over dp_size / "
            f"num_distributed_optimizer_instances ranks. Use one of {divisors}, or change the number of ranks.")
    return PartialSharding(dp_size, num_instances)


def bucket_alignment(shard_count: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """Every bucket's padded size is a multiple of this: lcm(64 * shard_count, 128), and 2**16 with
    ``pad_for_high_nccl_busbw``.

    The bucket then splits into ``shard_count`` equal shards whose size is a multiple of
    ``SHARD_ALIGN`` (64) elements. Bucket starts are the previous bucket's padded end, so they and
    every shard start (bucket start + rank * shard size) are multiples of 64 elements too, for every
    shard count. The waste is less than one alignment unit per bucket (64 * shard_count elements when
    shard_count is even, 128 * shard_count when it is odd).
    """
    base = math.lcm(SHARD_ALIGN * shard_count, BUCKET_ALIGN)
    return math.lcm(base, 2**16) if pad_for_high_nccl_busbw else base


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def build_buffer_layout(
    numels: Sequence[int],
    shard_count: int,
    bucket_size: Optional[int] = None,
    param_align: int = PARAM_ALIGN,
    pad_for_high_nccl_busbw: bool = False,
    own_bucket: Sequence[bool] = (),
) -> BufferLayout:
    """Lay out params (given in registration order) into buckets of at least ``bucket_size`` elements.

    ``own_bucket[i]`` puts param i alone in a bucket (Megatron does this for shared embeddings).
    """
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    if any(n <= 0 for n in numels):
        raise ValueError("every param in a buffer must have at least one element")
    align = bucket_alignment(shard_count, pad_for_high_nccl_busbw)
    own = list(own_bucket) + [False] * (len(numels) - len(own_bucket))
    ranges: list[Optional[Range]] = [None] * len(numels)
    bucket_of = [0] * len(numels)
    buckets: list[BucketLayout] = []
    cursor, bucket_start, members = 0, 0, []

    def close_bucket() -> None:
        nonlocal cursor, bucket_start, members
        if not members:
            return
        end = bucket_start + _round_up(cursor - bucket_start, align)
        buckets.append(BucketLayout(len(buckets), Range(bucket_start, end), tuple(members)))
        cursor = bucket_start = end
        members = []

    for i in reversed(range(len(numels))):  # backward order
        if own[i]:
            close_bucket()
        start = bucket_start + _round_up(cursor - bucket_start, param_align) if members else cursor
        ranges[i] = Range(start, start + numels[i])
        bucket_of[i] = len(buckets)
        members.append(i)
        cursor = start + numels[i]
        if own[i] or (bucket_size is not None and cursor - bucket_start >= bucket_size):
            close_bucket()
    close_bucket()
    return BufferLayout(
        numels=tuple(numels),
        param_ranges=tuple(ranges),  # type: ignore[arg-type]
        param_bucket=tuple(bucket_of),
        buckets=tuple(buckets),
        shard_count=shard_count,
    )
