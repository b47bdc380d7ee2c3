"""Buffer layout range math (megatron_opt.distributed.layout) and the piece table (megatron_opt.ops.piece_table).

Semantics follow Megatron-LM's ``_compute_per_buffer_param_layout`` / ``_build_model_gbuf_range``
(reference notes, section 2.1): params in reverse registration order, starts padded to 64 elements,
a bucket closes once it reaches ``bucket_size``, rank r owns the r-th equal contiguous shard of every
bucket, and shards ignore param boundaries. One deliberate difference: bucket ends are padded to
lcm(64 * dp, 128) rather than lcm(dp, 128) (and 2**16 with ``pad_for_high_nccl_busbw``), so every shard
start is a multiple of 64 elements at every DP (tests/unit/test_layout_alignment.py checks real shapes).
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_opt.distributed.layout import (
    BUCKET_ALIGN,
    PARAM_ALIGN,
    BufferLayout,
    Range,
    bucket_alignment,
    build_buffer_layout,
)
from megatron_opt.ops.piece_table import PieceTable, full_table

SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------------------------------
# Strategies and helpers
# --------------------------------------------------------------------------------------------------


@st.composite
def layout_inputs(draw, allow_busbw: bool = True):
    numels = draw(st.lists(st.integers(1, 5000), min_size=1, max_size=40))
    shard_count = draw(st.integers(1, 8))
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 20000)))
    # own_bucket may be shorter than numels (the rest default to False).
    own = draw(st.lists(st.booleans(), min_size=0, max_size=len(numels)))
    busbw = draw(st.booleans()) if allow_busbw else False
    return numels, shard_count, bucket_size, own, busbw


def _build(inputs) -> tuple[BufferLayout, list[bool]]:
    numels, shard_count, bucket_size, own, busbw = inputs
    layout = build_buffer_layout(
        numels, shard_count, bucket_size=bucket_size, pad_for_high_nccl_busbw=busbw, own_bucket=own
    )
    own_full = list(own) + [False] * (len(numels) - len(own))
    return layout, own_full


def _members_in_buffer_order(layout: BufferLayout, bucket_index: int) -> list[int]:
    return sorted(layout.buckets[bucket_index].param_indices, key=lambda i: layout.param_ranges[i].start)


def _round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


# --------------------------------------------------------------------------------------------------
# Properties of build_buffer_layout
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(layout_inputs())
def test_every_param_element_owned_exactly_once_and_pieces_reassemble(inputs):
    layout, _ = _build(inputs)
    numels = inputs[0]
    shard_count = layout.shard_count
    pieces_by_param: dict[int, list] = {i: [] for i in range(len(numels))}
    for b, bucket in enumerate(layout.buckets):
        shard_size = bucket.range.size // shard_count
        for rank in range(shard_count):
            shard = bucket.shard_range(rank, shard_count)
            assert shard.size == shard_size
            pieces = layout.shard_pieces(b, rank)
            # pieces are in buffer order and disjoint
            for p, q in zip(pieces, pieces[1:]):
                assert p.buffer_range.end <= q.buffer_range.start
            for piece in pieces:
                i = piece.param_index
                assert layout.param_bucket[i] == b
                assert piece.buffer_range.size > 0
                # the three coordinate systems describe the same elements
                assert piece.buffer_range.size == piece.param_range.size == piece.shard_range.size
                assert piece.buffer_range.start >= shard.start and piece.buffer_range.end <= shard.end
                assert piece.shard_range.start == piece.buffer_range.start - shard.start
                assert 0 <= piece.shard_range.start and piece.shard_range.end <= shard_size
                assert piece.param_range.start == piece.buffer_range.start - layout.param_ranges[i].start
                assert 0 <= piece.param_range.start and piece.param_range.end <= numels[i]
                pieces_by_param[i].append((rank, piece))
    for i, n in enumerate(numels):
        ranges = sorted((p.param_range.start, p.param_range.end) for _, p in pieces_by_param[i])
        assert ranges, f"param {i} owned by no rank"
        # Tiles [0, n) exactly: no gap (every element owned) and no overlap (owned only once).
        assert ranges[0][0] == 0
        assert ranges[-1][1] == n
        for (_, e), (s, _) in zip(ranges, ranges[1:]):
            assert e == s
        # a param has at most one piece per rank
        ranks = [r for r, _ in pieces_by_param[i]]
        assert len(ranks) == len(set(ranks))


@SETTINGS
@given(layout_inputs(allow_busbw=False))
def test_pieces_reassemble_param_data(inputs):
    """Data-level check: scatter params into a buffer, cut it into shards, rebuild params from pieces."""
    layout, _ = _build(inputs)
    numels = inputs[0]
    params = []
    offset = 0
    buffer = torch.full((layout.numel,), -1, dtype=torch.int64)
    for i, n in enumerate(numels):
        p = torch.arange(offset, offset + n, dtype=torch.int64)
        offset += n
        params.append(p)
        r = layout.param_ranges[i]
        buffer[r.start : r.end] = p
    rebuilt = [torch.full((n,), -2, dtype=torch.int64) for n in numels]
    hits = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for b, bucket in enumerate(layout.buckets):
        for rank in range(layout.shard_count):
            s = bucket.shard_range(rank, layout.shard_count)
            shard = buffer[s.start : s.end]  # what this rank holds after a reduce-scatter
            for piece in layout.shard_pieces(b, rank):
                pr, sr = piece.param_range, piece.shard_range
                rebuilt[piece.param_index][pr.start : pr.end] = shard[sr.start : sr.end]
                hits[piece.param_index][pr.start : pr.end] += 1
    for i in range(len(numels)):
        assert torch.equal(hits[i], torch.ones_like(hits[i])), f"param {i}: element ownership counts {hits[i]}"
        assert torch.equal(rebuilt[i], params[i])
    # Everything outside the params is padding and was never written.
    covered = torch.zeros(layout.numel, dtype=torch.bool)
    for r in layout.param_ranges:
        covered[r.start : r.end] = True
    assert bool((buffer[~covered] == -1).all())


@SETTINGS
@given(layout_inputs())
def test_buckets_contiguous_ordered_and_padded(inputs):
    layout, _ = _build(inputs)
    _, shard_count, _, _, busbw = inputs
    assert layout.buckets, "a non-empty param list needs at least one bucket"
    assert layout.buckets[0].range.start == 0
    for k, bucket in enumerate(layout.buckets):
        assert bucket.index == k
        size = bucket.range.size
        assert size > 0
        assert size % shard_count == 0
        assert size % BUCKET_ALIGN == 0
        assert (size // shard_count) % 64 == 0  # shard size, hence every shard start, is 64-aligned
        assert bucket.range.start % 64 == 0
        if busbw:
            assert size % 2**16 == 0
        if k + 1 < len(layout.buckets):
            assert bucket.range.end == layout.buckets[k + 1].range.start
    assert layout.numel == layout.buckets[-1].range.end
    # bucket membership and param_bucket agree; every param is in exactly one bucket
    seen = []
    for k, bucket in enumerate(layout.buckets):
        assert bucket.param_indices
        for i in bucket.param_indices:
            assert layout.param_bucket[i] == k
        seen.extend(bucket.param_indices)
    assert sorted(seen) == list(range(len(inputs[0])))


@SETTINGS
@given(layout_inputs())
def test_param_ranges_disjoint_aligned_inside_bucket_and_padding_minimal(inputs):
    layout, _ = _build(inputs)
    numels, shard_count, _, _, busbw = inputs
    align = bucket_alignment(shard_count, busbw)
    assert layout.numels == tuple(numels)
    for i, n in enumerate(numels):
        r = layout.param_ranges[i]
        assert r.size == n
        bucket = layout.buckets[layout.param_bucket[i]]
        assert bucket.range.start <= r.start and r.end <= bucket.range.end
        assert (r.start - bucket.range.start) % PARAM_ALIGN == 0
        assert r.start % PARAM_ALIGN == 0  # bucket starts are aligned too
    ordered = sorted(layout.param_ranges, key=lambda r: r.start)
    for a, b in zip(ordered, ordered[1:]):
        assert a.end <= b.start, f"overlapping params {a} {b}"
    for k, bucket in enumerate(layout.buckets):
        members = _members_in_buffer_order(layout, k)
        # first param starts the bucket; each next one at the first aligned slot after the previous
        assert layout.param_ranges[members[0]].start == bucket.range.start
        for prev, nxt in zip(members, members[1:]):
            expect = bucket.range.start + _round_up(layout.param_ranges[prev].end - bucket.range.start, PARAM_ALIGN)
            assert layout.param_ranges[nxt].start == expect
        # end padding is the least that makes the bucket divisible by the alignment
        content = layout.param_ranges[members[-1]].end - bucket.range.start
        assert bucket.range.size == _round_up(content, align)


@SETTINGS
@given(layout_inputs())
def test_params_laid_out_in_reverse_registration_order(inputs):
    layout, _ = _build(inputs)
    n = len(inputs[0])
    for i in range(n - 1):
        assert layout.param_ranges[i].start > layout.param_ranges[i + 1].start
        assert layout.param_bucket[i] >= layout.param_bucket[i + 1]
    # the last registered param opens the buffer
    assert layout.param_ranges[n - 1].start == 0
    assert layout.param_bucket[n - 1] == 0


@SETTINGS
@given(layout_inputs())
def test_bucket_closes_once_it_reaches_bucket_size(inputs):
    layout, own = _build(inputs)
    numels, _, bucket_size, _, _ = inputs
    nb = len(layout.buckets)
    for k, bucket in enumerate(layout.buckets):
        members = _members_in_buffer_order(layout, k)
        start = bucket.range.start
        if bucket_size is not None:
            # it did not reach bucket_size before its last member was added
            for i in members[:-1]:
                assert layout.param_ranges[i].end - start < bucket_size
        if k + 1 < nb:
            last = members[-1]
            next_param = last - 1  # backward order: the next param to be laid out
            assert layout.param_bucket[next_param] == k + 1
            reached = bucket_size is not None and layout.param_ranges[last].end - start >= bucket_size
            assert reached or own[last] or own[next_param], (
                f"bucket {k} closed early: content {layout.param_ranges[last].end - start}, bucket_size {bucket_size}"
            )
    if bucket_size is None and not any(own[: len(numels)]):
        assert nb == 1


@SETTINGS
@given(layout_inputs())
def test_own_bucket_params_are_alone(inputs):
    layout, own = _build(inputs)
    for i, flag in enumerate(own):
        if flag:
            assert layout.buckets[layout.param_bucket[i]].param_indices == (i,)


@SETTINGS
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 8))
def test_no_bucket_size_no_own_gives_one_bucket(numels, shard_count):
    layout = build_buffer_layout(numels, shard_count)
    assert len(layout.buckets) == 1
    assert layout.buckets[0].param_indices == tuple(reversed(range(len(numels))))


# --------------------------------------------------------------------------------------------------
# Explicit examples
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shard_count, bucket_numel, expected",
    [
        # numels [112, 7]: param 1 (7) at [0, 7), param 0 (112) at [64, 176).
        (2, 256, {0: [(1, (0, 7), (0, 7)), (0, (64, 128), (0, 64))], 1: [(0, (128, 176), (64, 112))]}),
        (3, 384, {0: [(1, (0, 7), (0, 7)), (0, (64, 128), (0, 64))], 1: [(0, (128, 176), (64, 112))], 2: []}),
        (
            4,
            256,
            {0: [(1, (0, 7), (0, 7))], 1: [(0, (64, 128), (0, 64))], 2: [(0, (128, 176), (64, 112))], 3: []},
        ),
        # lcm(64 * 8, 128) = 512: 176 rounds up to 512, shards of 64 (lcm(8, 128) gave 256 and shards of 32).
        (
            8,
            512,
            {
                0: [(1, (0, 7), (0, 7))],
                1: [(0, (64, 128), (0, 64))],
                2: [(0, (128, 176), (64, 112))],
                **{r: [] for r in range(3, 8)},
            },
        ),
    ],
)
def test_straddling_param_split_across_ranks(shard_count, bucket_numel, expected):
    layout = build_buffer_layout([112, 7], shard_count)
    assert layout.param_ranges == (Range(64, 176), Range(0, 7))
    assert len(layout.buckets) == 1
    assert layout.buckets[0].range == Range(0, bucket_numel)
    assert layout.buckets[0].param_indices == (1, 0)
    shard_size = bucket_numel // shard_count
    for rank in range(shard_count):
        got = [
            (p.param_index, (p.buffer_range.start, p.buffer_range.end), (p.param_range.start, p.param_range.end))
            for p in layout.shard_pieces(0, rank)
        ]
        assert got == expected[rank], f"rank {rank}"
        for p in layout.shard_pieces(0, rank):
            assert p.shard_range == p.buffer_range.shift(-rank * shard_size)
    owners = {r for r in range(shard_count) for p in layout.shard_pieces(0, r) if p.param_index == 0}
    assert len(owners) == 2  # the 112-element param straddles two ranks


def test_bucket_size_splits_and_closes():
    # backward order: 3 (100) -> [0,100) reaches 100 -> close (pad to 128);
    # 2 (50) -> [128,178); 1 (30) -> [192,222) reaches 94 >= 90 -> close (pad to 256); 0 (10) -> [256,266).
    layout = build_buffer_layout([10, 30, 50, 100], 1, bucket_size=90)
    assert [b.range for b in layout.buckets] == [Range(0, 128), Range(128, 256), Range(256, 384)]
    assert [b.param_indices for b in layout.buckets] == [(3,), (2, 1), (0,)]
    assert layout.param_ranges == (Range(256, 266), Range(192, 222), Range(128, 178), Range(0, 100))
    assert layout.param_bucket == (2, 1, 1, 0)
    assert layout.numel == 384


def test_own_bucket_closes_before_and_after():
    layout = build_buffer_layout([5, 5, 5], 2, own_bucket=[False, True, False])
    assert [b.param_indices for b in layout.buckets] == [(2,), (1,), (0,)]
    assert [b.range for b in layout.buckets] == [Range(0, 128), Range(128, 256), Range(256, 384)]


def test_pad_for_high_nccl_busbw():
    layout = build_buffer_layout([1000], 3, pad_for_high_nccl_busbw=True)
    assert layout.buckets[0].range == Range(0, 3 * 2**16)
    assert bucket_alignment(3, True) == 3 * 2**16
    # lcm(64 * dp, 128): 64 * dp when dp is even, 128 * dp when it is odd
    assert bucket_alignment(3) == 384  # lcm(192, 128)
    assert bucket_alignment(8) == 512  # lcm(512, 128); was lcm(8, 128) = 128 (shards of 16)
    assert bucket_alignment(6) == 384  # lcm(384, 128)
    assert bucket_alignment(1) == 128  # lcm(64, 128)
    assert bucket_alignment(2) == 128  # lcm(128, 128)
    assert bucket_alignment(32) == 2048  # was 128: shards of 4 elements, half a bf16 vector
    assert bucket_alignment(256) == 16384  # was 256: shards of 1 element
    assert bucket_alignment(256, True) == 2**16  # 16384 divides 2**16: shards of 256
    assert bucket_alignment(96, True) == 3 * 2**16  # lcm(6144, 128, 2**16): shards of 2048


def test_empty_and_invalid():
    layout = build_buffer_layout([], 4)
    assert layout.numel == 0
    assert layout.buckets == ()
    with pytest.raises(ValueError):
        build_buffer_layout([10], 0)
    with pytest.raises(ValueError):
        build_buffer_layout([10, 0], 2)


def test_range_helpers():
    assert Range(0, 10).intersect(Range(5, 20)) == Range(5, 10)
    assert Range(0, 10).intersect(Range(10, 20)) is None
    assert Range(3, 7).shift(-3) == Range(0, 4)
    assert Range(3, 7).size == 4


# --------------------------------------------------------------------------------------------------
# PieceTable
# --------------------------------------------------------------------------------------------------


def _table(segs, numel, in_norm=None, group=None):
    n = len(segs)
    return PieceTable(
        tuple(s for s, _ in segs),
        tuple(e for _, e in segs),
        tuple(in_norm) if in_norm is not None else (True,) * n,
        tuple(group) if group is not None else (0,) * n,
        numel,
    )


@pytest.mark.parametrize(
    "segs, numel",
    [
        ([(10, 20), (0, 5)], 30),  # unsorted
        ([(0, 10), (5, 15)], 30),  # overlapping
        ([(0, 10), (0, 10)], 30),  # duplicate
        ([(0, 10), (10, 10)], 30),  # empty piece
        ([(5, 3)], 30),  # reversed
        ([(0, 31)], 30),  # past the end
        ([(-1, 5)], 30),  # negative start
    ],
)
def test_piece_table_rejects_bad_pieces(segs, numel):
    with pytest.raises(ValueError):
        _table(segs, numel)


def test_piece_table_rejects_length_mismatch():
    with pytest.raises(ValueError):
        PieceTable((0, 10), (5, 15), (True,), (0, 0), 20)
    with pytest.raises(ValueError):
        PieceTable((0, 10), (5, 15), (True, True), (0,), 20)
    with pytest.raises(ValueError):
        PieceTable((0,), (5, 15), (True, True), (0, 0), 20)


def test_piece_table_accepts_adjacent_and_full():
    t = _table([(0, 10), (10, 30)], 30)
    assert t.num_pieces == 2
    assert t.covered == 30
    assert t.padding_in_span() == 0


def test_piece_table_runs_example():
    t = _table(
        [(0, 5), (10, 15), (20, 25), (30, 35), (40, 50)],
        60,
        in_norm=(True, True, False, True, True),
        group=(0, 0, 1, 1, 0),
    )
    assert t.span() == (0, 50)
    assert t.covered == 30
    assert t.padding_in_span() == 20
    assert t.norm_runs() == [(0, 15), (30, 50)]
    assert t.group_runs() == [(0, 15, 0), (20, 35, 1), (40, 50, 0)]
    assert t.runs((7, 7, 7, 7, 7)) == [(0, 50, 7)]


def test_piece_table_empty_and_full_table():
    e = full_table(0)
    assert e.num_pieces == 0 and e.span() is None and e.padding_in_span() == 0
    assert e.norm_runs() == [] and e.group_runs() == []
    f = full_table(100)
    assert f.span() == (0, 100) and f.covered == 100 and f.padding_in_span() == 0
    assert f.norm_runs() == [(0, 100)] and f.group_runs() == [(0, 100, 0)]
    # a table with no pieces over a non-empty shard is valid (a rank can own only padding)
    t = PieceTable((), (), (), (), 64)
    assert t.span() is None and t.padding_in_span() == 0


@st.composite
def piece_tables(draw):
    n = draw(st.integers(0, 30))
    cursor = draw(st.integers(0, 20))
    starts, ends = [], []
    for _ in range(n):
        s = cursor + draw(st.integers(0, 20))
        e = s + draw(st.integers(1, 50))
        starts.append(s)
        ends.append(e)
        cursor = e
    numel = cursor + draw(st.integers(0, 20))
    in_norm = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    group = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    return PieceTable(tuple(starts), tuple(ends), tuple(in_norm), tuple(group), numel)


def _check_runs(t: PieceTable, key, runs: list[tuple[int, int, object]]) -> None:
    # runs are sorted, disjoint, and neighbours have different keys (maximal)
    for (s0, e0, k0), (s1, e1, k1) in zip(runs, runs[1:]):
        assert e0 <= s1
        assert k0 != k1
    # each piece lies in exactly one run, with its key; run bounds are piece bounds
    for s, e, k in zip(t.starts, t.ends, key):
        containing = [r for r in runs if r[0] <= s and e <= r[1]]
        assert len(containing) == 1 and containing[0][2] == k
    assert {r[0] for r in runs} <= set(t.starts)
    assert {r[1] for r in runs} <= set(t.ends)
    assert len(runs) == (0 if not t.starts else 1 + sum(a != b for a, b in zip(key, key[1:])))


@SETTINGS
@given(piece_tables())
def test_piece_table_runs_properties(t):
    _check_runs(t, t.group, t.group_runs())
    _check_runs(t, t.in_norm, t.runs(t.in_norm))
    norm = t.norm_runs()
    assert norm == [(s, e) for s, e, k in t.runs(t.in_norm) if k]
    # every in-norm element is covered by a norm run; no out-of-norm piece is
    for s, e, k in zip(t.starts, t.ends, t.in_norm):
        inside = any(a <= s and e <= b for a, b in norm)
        assert inside == k
    # padding: span minus covered equals the sum of gaps between consecutive pieces
    gaps = sum(s - e for e, s in zip(t.ends, t.starts[1:]))
    assert t.padding_in_span() == gaps
    assert t.covered == sum(e - s for s, e in zip(t.starts, t.ends))
