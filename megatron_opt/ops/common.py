"""Helpers shared by the torch implementations of the passes (reference and CPU)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from .piece_table import PieceTable

if TYPE_CHECKING:  # op_args imports this module
    from .op_args import ShardOperands, UpdateArgs


def sum_of_squares(grad: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """float64 sum of squares over the runs, accumulated per element in float64 (the reference's
    spec; the CPU backend uses ``blocked_sum_of_squares``)."""
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for s, e in runs:
        total = total + torch.linalg.vector_norm(grad[s:e], dtype=torch.float64).square()
    return total


# One plain fp32 sum of squares drifts with length (5e-3 relative at 50M elements on torch's CPU
# kernel); fp32 sums over blocks of this many elements, added in float64, stay within ~1e-7 at 50M
# elements and cost one fp32 read (30x less than converting every element to float64).
NORM_BLOCK = 1024
# 16-bit grads are widened to fp32 this many elements at a time (the copy stays in cache): torch's
# 16-bit norm rounds each block's result to 16 bits, and a float32 ``dtype=`` argument copies it all.
WIDEN_CHUNK = 1 << 20


def blocked_sum_of_squares(grad: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sum of squares over the runs as fp32 sums of ``NORM_BLOCK``-element blocks added in float64
    (see ``NORM_BLOCK``). A run of finite values whose fp32 squares overflow gives inf: the caller
    checks for that and then takes ``sum_of_squares``."""
    parts = []
    for s, e in runs:
        if grad.dtype == torch.float32:
            parts.append(_blocked(grad[s:e]))
        else:
            parts.extend(_blocked(grad[lo : min(e, lo + WIDEN_CHUNK)].float()) for lo in range(s, e, WIDEN_CHUNK))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    return torch.stack(parts).sum()


def _blocked(x: torch.Tensor) -> torch.Tensor:
    whole = x.numel() // NORM_BLOCK * NORM_BLOCK
    blocks = torch.linalg.vector_norm(x[:whole].view(-1, NORM_BLOCK), dim=1).double().square().sum()
    return blocks + torch.linalg.vector_norm(x[whole:]).double().square()


def count_zeros_in_norm(grad: torch.Tensor, table: PieceTable) -> torch.Tensor:
    """float64 count of the zero elements of the in-norm pieces of a grad whose gaps are zero, on the
    grad's device (no host read). The zero count follows the norm's counting rule (a tensor-parallel
    duplicate or a tied copy counts on one rank only), so that Megatron-LM's num_zeros, like its grad
    norm, counts each logical element once."""
    nonzero = torch.zeros((), dtype=torch.int64, device=grad.device)
    for s, e in table.norm_runs():  # runs may span gaps; the gaps are zero and not in_norm_covered
        nonzero = nonzero + torch.count_nonzero(grad[s:e])
    return (table.in_norm_covered - nonzero).double()


def zero_gaps(grad: torch.Tensor, table: PieceTable) -> torch.Tensor:
    """A copy of ``grad`` with every gap element inside the span set to +0 (``grad`` itself when the
    table has no gaps): flat reductions over runs of it see the piece elements only."""
    idx = table.gap_index(grad.device)
    return grad if idx.numel() == 0 else grad.index_fill(0, idx, 0)


@contextmanager
def gaps_kept(table: PieceTable, *outputs: Optional[torch.Tensor]) -> Iterator[None]:
    """Pass-2 ops write piece elements only. The torch versions update whole runs of pieces (gaps
    included) with a few flat ops; this saves the gap elements of the ``outputs`` (None entries are
    skipped) and puts them back on exit, so each gap element ends bitwise as it was, whatever it
    held. The gaps are few and short: a gather and a scatter of them cost little next to the update.
    Outputs that alias one another (an fp32 master used as param_out) get the same values back."""
    saved = []
    for t in outputs:
        if t is not None:
            idx = table.gap_index(t.device)
            if idx.numel():
                saved.append((t, idx, t.index_select(0, idx)))
    try:
        yield
    finally:
        for t, idx, values in saved:
            t.index_copy_(0, idx, values)


def is_skipped(found_inf: Optional[torch.Tensor]) -> bool:
    """A pass-2 op given a nonzero device flag writes nothing (the host reads it here)."""
    return found_inf is not None and bool(found_inf.item() != 0)


def update_span(shard: "ShardOperands", args: "UpdateArgs") -> Optional[tuple[int, int]]:
    """The [first start, last end) a pass-2 op sweeps on ``shard``, or None when it writes nothing
    (no pieces, or a nonzero ``found_inf``)."""
    span = shard.table.span()
    return None if span is None or is_skipped(args.found_inf) else span
