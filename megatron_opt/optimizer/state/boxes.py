"""Pure index math: a contiguous range of a flattened tensor as rectangular boxes of its shape.

A rank owns a contiguous range [start, end) of each flattened param. To store optimizer state in
the param's own shape (so any reader, at any sharding, can ask for any region), the range is cut
into at most 2 * ndim - 1 boxes, each contiguous in row-major order: a partial leading row, whole
rows, a partial trailing row, recursively.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]  # in the tensor's shape
    sizes: tuple[int, ...]
    flat_start: int  # the box's first element in the flattened tensor

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Boxes covering flat elements [start, end) of a row-major tensor of ``shape``, in order."""
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements")
    if start == end:
        return []
    if not shape:  # a scalar: one element
        return [Box((), (), 0)]
    return _boxes(shape, start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Boxes of flat elements [start, end) of a tensor of ``shape`` (a row of the caller's, which
    prefixes the row index to the offsets and adds the row's start to the flat starts)."""
    if len(shape) == 1:
        return [Box((start,), (end - start,), start)] if end > start else []
    inner = math.prod(shape[1:])
    first_full, last_full = -(-start // inner), end // inner  # rows [first_full, last_full) are whole
    if first_full > last_full:  # inside one row
        row = start // inner
        return _sub_row(shape, row, start - row * inner, end - row * inner)
    out = []
    if start < first_full * inner:
        row = start // inner
        out += _sub_row(shape, row, start - row * inner, inner)
    if last_full > first_full:
        out.append(Box((first_full,) + (0,) * (len(shape) - 1),
                       (last_full - first_full,) + shape[1:], first_full * inner))
    if end > last_full * inner:
        out += _sub_row(shape, last_full, 0, end - last_full * inner)
    return out


def _sub_row(shape: tuple[int, ...], row: int, lo: int, hi: int) -> list[Box]:
    """Elements [lo, hi) of one row (a tensor of shape[1:]), with that row's index fixed."""
    base = row * math.prod(shape[1:])
    return [Box((row,) + b.offsets, (1,) + b.sizes, base + b.flat_start) for b in _boxes(shape[1:], lo, hi)]


__all__ = ["Box", "flat_range_to_boxes"]
