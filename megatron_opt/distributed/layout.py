"""Pure range math for the contiguous param/grad buffers: no tensors, no process groups.

A buffer holds the params of one (param dtype, grad dtype) pair. Params are laid out in reverse
registration order (the order backward produces their grads), each start aligned to
``param_align`` elements. Buckets are closed once they reach ``bucket_size`` elements, and every
bucket end is padded to a multiple of lcm(64 * shard_count, 128) (see ``bucket_alignment``), so the
bucket splits into ``shard_count`` equal contiguous shards (gloo's reduce-scatter needs equal
chunks) and every shard size, hence every shard start, is a multiple of 64 elements for every
shard count. Shards ignore param boundaries: a param may straddle ranks.

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
