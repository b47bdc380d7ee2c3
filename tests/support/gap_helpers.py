"""Padding-gap helpers shared by the ops tests: piece masks, bit views and gap garbage."""
from __future__ import annotations

import math

import torch

from megatron_opt.ops.piece_table import PieceTable


def piece_mask(table: PieceTable, device="cpu") -> torch.Tensor:
    mask = torch.zeros(table.numel, dtype=torch.bool, device=device)
    for s, e in zip(table.starts, table.ends):
        mask[s:e] = True
    return mask


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (an integer view): compares NaN payloads and -0.0 exactly."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def with_gap_garbage(t: torch.Tensor, table: PieceTable, seed: int, kind: str = "bits") -> torch.Tensor:
    """A copy of ``t`` whose elements outside the pieces hold garbage. kind="bits": random bit
    patterns (NaNs with payloads, infs, huge, tiny and negative values) after a planted inf, -inf,
    NaN, -0.0, +0.0, the dtype's max and a subnormal; kind="zeros": alternating -0.0 and +0.0."""
    gap = ~piece_mask(table, t.device)
    k = int(gap.sum())
    if kind == "zeros":
        garbage = torch.zeros(k, dtype=t.dtype)
        garbage[::2] = -0.0
    else:
        gen = torch.Generator().manual_seed(seed)
        half = 1 << (8 * t.element_size() - 1)
        garbage = torch.randint(-half, half, (k,), generator=gen, dtype=torch.int64)
        garbage = garbage.to(_INT_OF_SIZE[t.element_size()]).view(t.dtype)
        fi = torch.finfo(t.dtype)
        planted = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 0.0, fi.max, fi.smallest_normal / 4],
                               dtype=t.dtype)[:k]
        garbage[: planted.numel()] = planted
    out = t.clone()
    out[gap] = garbage.to(t.device)
    return out


def assert_gaps_unchanged(before, after, gap: torch.Tensor, names, who: str) -> None:
    for b, a, name in zip(before, after, names):
        if b is not None:
            assert torch.equal(as_bits(a)[gap], as_bits(b)[gap]), f"{who}: {name} written in a padding gap"


def assert_gap_run(names, before, grad, clean, dirty, reference, gap: torch.Tensor, piece: torch.Tensor) -> None:
    """A pass-2 run with garbage in the gaps: neither the kernel (``dirty``) nor the reference wrote a
    gap element, the grad (``before[0]`` is its snapshot, ``before[1:]`` the outputs') was not written,
    and the kernel's piece elements equal those of the run without garbage (``clean``). Output lists
    follow ``names``; None entries (an absent state or param_out) are skipped."""
    assert_gaps_unchanged(before[1:], dirty, gap, names, "kernel")
    assert_gaps_unchanged(before[1:], reference, gap, names, "reference")
    assert torch.equal(as_bits(grad), as_bits(before[0])), "grad written"
    for c, d, name in zip(clean, dirty, names):
        if c is not None:
            assert torch.equal(as_bits(d)[piece], as_bits(c)[piece]), \
                f"kernel: {name} pieces differ from the zero-gap run"


def pieces_table(lens: list[int], gaps: list[int], groups: int = 3, lead: int = 0) -> PieceTable:
    """Pieces of the given lengths separated by the (cycled) gaps; every 4th piece out of the norm."""
    starts, ends, pos = [], [], lead
    for i, n in enumerate(lens):
        starts.append(pos)
        ends.append(pos + n)
        pos += n + gaps[i % len(gaps)]
    k = len(lens)
    return PieceTable(tuple(starts), tuple(ends), tuple(i % 4 != 3 for i in range(k)),
                      tuple(i % groups for i in range(k)), pos)


def gapped_bounds(n: int) -> tuple[list[int], list[int]]:
    """Piece (starts, ends) over n elements with gaps (and touching pieces), a misaligned first
    start and odd lengths, scaled with n: the layout the kernel gap tests share."""
    lens = [5, 1, 17, 3, 250, 64, 9, 1031]
    gaps = [3, 0, 2, 7, 64, 1, 0, 13]
    scale = max(1, n // 4000)
    starts, ends = [], []
    pos, k = min(3, n - 1), 0
    while pos < n:
        e = min(n, pos + lens[k % len(lens)] * scale)
        starts.append(pos)
        ends.append(e)
        pos = e + gaps[k % len(gaps)]
        k += 1
    return starts, ends


def many_groups_case(n: int = 20000, ng: int = 100) -> tuple[PieceTable, list[float], list[float]]:
    """(table, lr, wd) with more param groups than fit in a kernel's arguments, so the lr/wd table
    is uploaded to the device: one piece per group, lr and wd varying across groups."""
    starts = tuple(range(0, n, n // ng))
    ends = tuple(s + n // ng - 3 for s in starts)
    table = PieceTable(starts, ends, (True,) * ng, tuple(range(ng)), n)
    return table, [1e-3 * (1 + i % 7) for i in range(ng)], [0.01 * (i % 3) for i in range(ng)]
