"""Per-rank numbers of a distributed benchmark: their max and min over ranks, printed as a range."""
from __future__ import annotations

import torch
import torch.distributed as dist


def max_min_over_ranks(values: list[float], device: torch.device = torch.device("cpu")
                       ) -> tuple[list[float], list[float]]:
    """(max over ranks, min over ranks) of each value."""
    hi = torch.tensor(values, dtype=torch.float64, device=device)
    neg_lo = -hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(neg_lo, op=dist.ReduceOp.MAX)
    return hi.tolist(), (-neg_lo).tolist()


def fmt_range(hi: float, lo: float, digits: int) -> str:
    """'lo–hi' over ranks, or one number when both print alike."""
    a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return b if a == b else f"{a}–{b}"
