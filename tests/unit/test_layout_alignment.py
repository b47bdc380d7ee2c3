"""Every shard start is a multiple of 64 elements at every DP size (issue #13, item 1).

The CUDA kernels take their 16-byte vector path only when all arrays of a launch share one element
phase. Master weights and moments are fresh allocations (phase 0); grad and param shards are views at
``shard.start``. A 16-byte vector is 4 fp32 or 8 16-bit elements, so a shard start that is a multiple
of 64 elements keeps both at phase 0. With the old padding rule (buckets padded to lcm(DP, 128)) a
shard start was only a multiple of 128 / gcd(DP, 128) elements: 4 at DP=32, 1 at DP=128.

Pure range math over real model shapes, every DP from 1 to 256, Megatron-LM's bucket rule
``max(40M, 1M * DP)`` and a small bucket size that makes hundreds of buckets.
"""
from __future__ import annotations

import math

import pytest

from megatron_opt.distributed.layout import BufferLayout, Range, bucket_alignment, build_buffer_layout

DP_SIZES = range(1, 257)
SHARD_START_ALIGN = 64  # elements


def _gpt_numels(hidden: int = 2560, layers: int = 32, vocab: int = 50304) -> list[int]:
    """GPT (tied embeddings, biases, layernorms), params in registration order."""
    h, ffn = hidden, 4 * hidden
    numels = [vocab * h]  # word embedding (vocab already padded to a multiple of 128)
    for _ in range(layers):
        numels += [h, h]  # input layernorm weight, bias
        numels += [3 * h * h, 3 * h]  # qkv weight [3h, h], bias
        numels += [h * h, h]  # attention proj weight [h, h], bias
        numels += [h, h]  # pre-mlp layernorm weight, bias
        numels += [ffn * h, ffn]  # fc1 weight [4h, h], bias
        numels += [h * ffn, h]  # fc2 weight [h, 4h], bias
    numels += [h, h]  # final layernorm weight, bias
    return numels


def _llama_numels(hidden: int = 4096, layers: int = 8, ffn: int = 11008, vocab: int = 32000) -> list[int]:
    """Llama-style (no biases, RMSNorm weights, fused SwiGLU fc1, untied output layer), registration order."""
    h = hidden
    numels = [vocab * h]  # word embedding
    for _ in range(layers):
        numels += [h]  # input RMSNorm weight
        numels += [3 * h * h]  # qkv weight [3h, h]
        numels += [h * h]  # attention proj weight [h, h]
        numels += [h]  # pre-mlp RMSNorm weight
        numels += [2 * ffn * h]  # fc1 weight [2 * ffn, h] (gate and up projections)
        numels += [h * ffn]  # fc2 weight [h, ffn]
    numels += [h]  # final RMSNorm weight
    numels += [vocab * h]  # output layer (untied)
    return numels


MODELS = {"gpt-2.7b": _gpt_numels(), "llama-8-layers": _llama_numels()}
BUCKET_RULES = {
    "megatron": lambda dp: max(40_000_000, 1_000_000 * dp),
    "1M": lambda dp: 1_000_000,
}


def _check_layout(layout: BufferLayout, dp: int, align: int) -> None:
    """``align`` is the bucket alignment in force; the end padding of a bucket must stay below it."""
    assert layout.buckets
    assert layout.buckets[0].range.start == 0
    for prev, nxt in zip(layout.buckets, layout.buckets[1:]):
        assert prev.range.end == nxt.range.start  # bucket starts are padded ends: 64-aligned as well
    for bucket in layout.buckets:
        shard_size = bucket.range.size // dp
        assert shard_size * dp == bucket.range.size
        assert shard_size % SHARD_START_ALIGN == 0, f"dp={dp} bucket {bucket.index}: shard size {shard_size}"
        assert bucket.range.size % align == 0
        # every rank's shard start: bucket start + r * shard size (BucketLayout.shard_range's rule, checked
        # against the helper at a few ranks; calling it for all ~33k (dp, rank) pairs per bucket is too slow)
        starts = range(bucket.range.start, bucket.range.end, shard_size)
        assert len(starts) == dp
        for r in {0, 1 % dp, dp // 2, dp - 1}:
            assert bucket.shard_range(r, dp) == Range(starts[r], starts[r] + shard_size)
        bad = [r for r, s in enumerate(starts) if s % SHARD_START_ALIGN]
        assert not bad, f"dp={dp} bucket {bucket.index}: ranks {bad[:8]} start off a 64-element boundary"
        # bounded waste: the end padding is less than one alignment unit
        content_end = max(layout.param_ranges[i].end for i in bucket.param_indices)
        padding = bucket.range.end - content_end
        assert 0 <= padding < align, f"dp={dp} bucket {bucket.index}: padding {padding} >= {align}"


def test_bucket_alignment_rule():
    for dp in DP_SIZES:
        assert bucket_alignment(dp) == math.lcm(64 * dp, 128)
        assert bucket_alignment(dp, pad_for_high_nccl_busbw=True) == math.lcm(64 * dp, 128, 2**16)


@pytest.mark.parametrize("rule", sorted(BUCKET_RULES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_shard_starts_are_64_element_aligned_at_every_dp(model, rule):
    numels = MODELS[model]
    for dp in DP_SIZES:
        bucket_size = BUCKET_RULES[rule](dp)
        layout = build_buffer_layout(numels, dp, bucket_size=bucket_size)
        align = bucket_alignment(dp)
        _check_layout(layout, dp, align)
        # every param of at least bucket_size elements closes a bucket (with 1M: every weight matrix)
        assert len(layout.buckets) >= sum(n >= bucket_size for n in numels)
        if rule == "1M":
            assert len(layout.buckets) > 30  # many buckets really exist
        assert layout.numel == layout.buckets[-1].range.end


@pytest.mark.parametrize("model", sorted(MODELS))
def test_shard_starts_aligned_with_high_nccl_busbw_padding(model):
    numels = MODELS[model]
    for dp in (1, 3, 7, 32, 96, 128, 255, 256):
        align = bucket_alignment(dp, pad_for_high_nccl_busbw=True)
        layout = build_buffer_layout(
            numels, dp, bucket_size=max(40_000_000, 1_000_000 * dp), pad_for_high_nccl_busbw=True
        )
        _check_layout(layout, dp, align)


def test_shard_pieces_of_a_high_dp_layout_start_on_shard_boundaries():
    """The pieces a rank gets are in its shard's coordinates; the shard's buffer start is 64-aligned."""
    dp = 96
    layout = build_buffer_layout(_llama_numels(layers=1), dp, bucket_size=1_000_000)
    for b, bucket in enumerate(layout.buckets):
        for rank in (0, 1, dp // 2, dp - 1):
            shard = bucket.shard_range(rank, dp)
            assert shard.start % SHARD_START_ALIGN == 0
            for piece in layout.shard_pieces(b, rank):
                assert piece.buffer_range.start - piece.shard_range.start == shard.start
