"""Home ranks for Muon matrices: which data-parallel rank runs each matrix's Newton-Schulz.

Element-range ZeRO-1 gives each DP rank element ranges of the flat buffers, so a Muon matrix may straddle
ranks. Newton-Schulz needs the whole matrix: one rank (its home) receives the other owners' pieces of the
update, orthogonalises, and sends each owner its slice back. A matrix wholly owned by one rank moves
nothing. This module chooses the homes from the layout alone (no processes): every rank computes the same
answer from the same placements.

The choice is greedy: matrices one at a time, each to the owning rank with the least summed Newton-Schulz
cost so far (ties: the rank owning most of the matrix, which moves the fewest elements, then the lowest rank).
Only owners are candidates (unless the rule asks for ``anywhere``), so a home never receives a piece it
already holds. Two orders are tried and the
one with the smaller busiest rank kept (then the fewer elements moved): largest cost first (the classic
greedy), and fewest owners first, then largest cost. The second matters on real layouts: a matrix wholly
inside one rank's shard has no choice, and when many of them sit on one rank (every ``linear_proj`` of a
GPT lands on the same rank of its bucket) largest-first has already given that rank big matrices it did not
have to take. Each greedy answer is then refined by moving matrices off the busiest rank to another owner
while that lowers the busiest load. On a 24-layer GPT (hidden 2048) at DP 2-16 the result is within 1.2x of
the mean (docs/benchmarks.md, "Muon on the element-range layout").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class MatrixPlacement:
    """One Muon matrix as the element-range layout places it.

    ``shape``: (rows, cols) of the tensor the rule orthogonalises (TP-local under TP).
    ``owned``: elements of this matrix each DP rank owns, indexed by DP rank (sums to rows*cols).
    ``pieces``: independent Newton-Schulz problems inside it (3 with split QKV: Q, K, V apart).
    """

    shape: tuple[int, int]
    owned: tuple[int, ...]
    pieces: int = 1

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or any(int(d) != d or d < 1 for d in self.shape):
            raise ValueError(f"MatrixPlacement.shape must be two positive ints (rows, cols), got {self.shape!r}")
        if not self.owned:
            raise ValueError("MatrixPlacement.owned is empty: it needs one count per DP rank")
        if any(int(n) != n or n < 0 for n in self.owned):
            raise ValueError(f"MatrixPlacement.owned must be non-negative ints, got {self.owned!r}")
        numel = self.shape[0] * self.shape[1]
        if sum(self.owned) != numel:
            raise ValueError(
                f"MatrixPlacement.owned sums to {sum(self.owned)}, not rows*cols = {numel} for shape {self.shape}"
            )
        if int(self.pieces) != self.pieces or self.pieces < 1:
            raise ValueError(f"MatrixPlacement.pieces must be a positive int, got {self.pieces!r}")

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def owners(self) -> tuple[int, ...]:
        """The DP ranks that own at least one element, in rank order."""
        return tuple(rank for rank, n in enumerate(self.owned) if n > 0)


def newton_schulz_cost(shape: tuple[int, int], steps: int = 5) -> float:
    """Multiply-adds of ``steps`` quintic Newton-Schulz iterations on a (rows, cols) matrix.

    Per iteration with s = min(rows, cols), l = max: A = X X^T (s*s*l), B = b*A + c*A A (s^3),
    X = a*X + B X (s*s*l): about s^2 * (2l + s).
    """
    if len(shape) != 2 or not shape[0] > 0 or not shape[1] > 0:
        raise ValueError(f"newton_schulz_cost: shape must be two positive sizes (rows, cols), got {shape!r}")
    if steps < 0:
        raise ValueError(f"newton_schulz_cost: steps must be >= 0, got {steps}")
    s, l = min(shape), max(shape)
    return float(steps) * s * s * (2 * l + s)


def placement_cost(placement: MatrixPlacement, steps: int = 5) -> float:
    """Newton-Schulz cost of one placement, its pieces taken as equal row blocks.

    Exact for split QKV with as many query groups as heads (Q, K and V the same size); with fewer
    query groups Q is larger than K and V and this is an estimate, which is all the balance needs.
    """
    rows, cols = placement.shape
    return placement.pieces * newton_schulz_cost((rows / placement.pieces, cols), steps)


def assign_homes(placements: Sequence[MatrixPlacement], dp_size: int, steps: int = 5,
                 cost: Optional[Callable[[MatrixPlacement], float]] = None, anywhere: bool = False) -> list[int]:
    """Home DP rank per matrix (same order as ``placements``); deterministic from its arguments. ``cost``: the
    rule's cost of one placement (a whole-tensor rule's ``home_cost``); default Newton-Schulz's of ``steps``.
    ``anywhere``: every rank of the group is a candidate, not only the matrix's owners (a rule whose per-matrix
    work and state are heavy next to moving the matrix, SOAP's: on a 24-layer GPT at DP 8 owners-only leaves its
    busiest home 1.27x (SwiGLU: 1.63x) the mean, anywhere 1.02x, for 1.4x the exchange's bytes); ties still go to
    the rank owning most of it."""
    if dp_size < 1:
        raise ValueError(f"assign_homes: dp_size must be >= 1, got {dp_size}")
    for index, placement in enumerate(placements):
        if len(placement.owned) != dp_size:
            raise ValueError(
                f"assign_homes: placement {index} has owned counts for {len(placement.owned)} ranks, "
                f"dp_size is {dp_size}"
            )
    costs = [cost(p) if cost is not None else placement_cost(p, steps) for p in placements]
    owners = [tuple(range(dp_size)) if anywhere else p.owners() for p in placements]
    # Equal keys keep their given order, so the answer is a function of the input alone.
    largest_first = sorted(range(len(placements)), key=lambda i: (-costs[i], i))
    fewest_owners_first = sorted(range(len(placements)), key=lambda i: (len(owners[i]), -costs[i], i))
    candidates = [_refine(placements, owners, costs, _greedy(placements, owners, costs, order, dp_size), dp_size)
                  for order in (largest_first, fewest_owners_first)]
    return min(candidates, key=lambda homes: (max(_loads(costs, homes, dp_size), default=0.0),
                                              traffic_elements(placements, homes)))


def _greedy(placements: Sequence[MatrixPlacement], owners: Sequence[tuple[int, ...]], costs: Sequence[float],
            order: Sequence[int], dp_size: int) -> list[int]:
    """Homes given one at a time in ``order``, each to its least loaded owner."""
    load = [0.0] * dp_size
    homes = [0] * len(placements)
    for i in order:
        owned = placements[i].owned
        home = min(owners[i], key=lambda r: (load[r], -owned[r], r))
        homes[i] = home
        load[home] += costs[i]
    return homes


def _refine(placements: Sequence[MatrixPlacement], owners: Sequence[tuple[int, ...]], costs: Sequence[float],
            homes: list[int], dp_size: int) -> list[int]:
    """Move matrices off the busiest rank while a move lowers it below where it was (each move strictly
    lowers the sum of squared loads, so this ends); the move chosen leaves the smallest larger load."""
    load = _loads(costs, homes, dp_size)
    for _ in range(len(placements) * dp_size):
        busiest = max(range(dp_size), key=lambda r: (load[r], -r))
        best = None
        for i, home in enumerate(homes):
            if home != busiest:
                continue
            for r in owners[i]:
                move = (load[r] + costs[i], -placements[i].owned[r], i, r)
                if r != busiest and move[0] < load[busiest] and (best is None or move < best):
                    best = move
        if best is None:
            break
        _, _, i, r = best
        load[busiest] -= costs[i]
        load[r] += costs[i]
        homes[i] = r
    return homes


def _loads(costs: Sequence[float], homes: Sequence[int], dp_size: int) -> list[float]:
    load = [0.0] * dp_size
    for cost, home in zip(costs, homes):
        load[home] += cost
    return load


def rank_costs(placements: Sequence[MatrixPlacement], homes: Sequence[int], dp_size: int,
               steps: int = 5) -> list[float]:
    """Summed Newton-Schulz cost per DP rank for these homes."""
    _check_homes(placements, homes)
    return _loads([placement_cost(p, steps) for p in placements], homes, dp_size)


def traffic_elements(placements: Sequence[MatrixPlacement], homes: Sequence[int]) -> int:
    """Elements sent per step: every non-home owner's piece to the home, and the same slice back."""
    _check_homes(placements, homes)
    return sum(2 * (p.numel - p.owned[home]) for p, home in zip(placements, homes))


def _check_homes(placements: Sequence[MatrixPlacement], homes: Sequence[int]) -> None:
    if len(homes) != len(placements):
        raise ValueError(f"{len(homes)} homes for {len(placements)} placements")
    for index, (placement, home) in enumerate(zip(placements, homes)):
        if not 0 <= home < len(placement.owned):
            raise ValueError(f"home {home} of placement {index} is not a DP rank (dp_size {len(placement.owned)})")


__all__ = [
    "MatrixPlacement",
    "assign_homes",
    "newton_schulz_cost",
    "placement_cost",
    "rank_costs",
    "traffic_elements",
]
