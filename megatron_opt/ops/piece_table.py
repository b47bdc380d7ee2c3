"""The piece table: where the params lie inside one rank's flat shard of one bucket.

Built once when the optimizer is constructed. Gaps between pieces are bucket padding. The ops never
count a gap element in pass 1 and never write one in pass 2, whatever the gaps hold; the torch
implementations still sweep whole runs of pieces (gaps included) for speed, and use ``gap_index``
to leave the gaps out of the result (ops/common.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class PieceTable:
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    in_norm: tuple[bool, ...]  # False for shared / tensor-parallel-duplicate params
    group: tuple[int, ...]  # param-group index of each piece (selects lr and weight decay)
    numel: int  # size of the flat shard
    _derived: dict = field(default_factory=dict, compare=False, repr=False)  # memo(): {kind: {key: value}}

    def __post_init__(self) -> None:
        n = len(self.starts)
        if not (len(self.ends) == len(self.in_norm) == len(self.group) == n):
            raise ValueError("PieceTable fields must have one entry per piece")
        prev_end = 0
        for s, e in zip(self.starts, self.ends):
            if not (prev_end <= s < e <= self.numel):
                raise ValueError(f"pieces must be sorted, non-empty, disjoint and inside [0, {self.numel})")
            prev_end = e

    @property
    def num_pieces(self) -> int:
        return len(self.starts)

    @property
    def covered(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))

    def span(self) -> Optional[tuple[int, int]]:
        return (self.starts[0], self.ends[-1]) if self.starts else None

    def padding_in_span(self) -> int:
        span = self.span()
        return 0 if span is None else (span[1] - span[0]) - self.covered

    def runs(self, key: tuple) -> list[tuple[int, int, object]]:
        """Maximal runs of consecutive pieces with equal key (gaps between them are included)."""
        out: list[list] = []
        for s, e, k in zip(self.starts, self.ends, key):
            if out and out[-1][2] == k:
                out[-1][1] = e
            else:
                out.append([s, e, k])
        return [tuple(r) for r in out]  # type: ignore[misc]

    def norm_runs(self) -> list[tuple[int, int]]:
        return [(s, e) for s, e, k in self.runs(self.in_norm) if k]

    @property
    def in_norm_covered(self) -> int:
        """Elements of the in-norm pieces (gaps excluded)."""
        return sum(e - s for s, e, k in zip(self.starts, self.ends, self.in_norm) if k)

    def group_runs(self) -> list[tuple[int, int, int]]:
        return self.runs(self.group)  # type: ignore[return-value]

    def memo(self, kind: str, key: Hashable, build: Callable[[], T], max_entries: Optional[int] = None) -> T:
        """``build()``, made once per (kind, key) and kept with the table (device copies, plans built
        from it). ``max_entries`` bounds the entries of one kind; the oldest goes first."""
        entries = self._derived.setdefault(kind, {})
        if key not in entries:
            if max_entries is not None and len(entries) >= max_entries:
                entries.pop(next(iter(entries)))
            entries[key] = build()
        return entries[key]

    def gap_index(self, device: torch.device) -> torch.Tensor:
        """int64 positions (shard coordinates) of the gap elements inside the span, i.e. of every
        element of [first start, last end) outside the pieces, ascending (built once per device)."""
        def build() -> torch.Tensor:
            lo = torch.tensor(self.ends[:-1], dtype=torch.int64)
            lens = torch.tensor(self.starts[1:], dtype=torch.int64) - lo
            offsets = torch.cumsum(lens, 0) - lens  # where each gap begins in the list of gap elements
            idx = torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(offsets - lo, lens)
            return idx.to(device)

        return self.memo("gap_index", str(device), build)


def full_table(numel: int) -> PieceTable:
    """One piece covering the whole shard, counted in the norm, group 0 (handy in tests)."""
    if numel == 0:
        return PieceTable((), (), (), (), 0)
    return PieceTable((0,), (numel,), (True,), (0,), numel)
