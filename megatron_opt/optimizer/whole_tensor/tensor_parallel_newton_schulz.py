"""Muon's orthogonalisation of TP-split matrices (``muon_tp_mode`` duplicated / distributed), at the homes.

Each TP rank holds a TP-local block of a TP-split param (``tensor_model_parallel``, split along
``partition_dim``). Its home in the data-parallel group (matrix_exchange.MatrixExchange) assembles
the block's update U; the homes of one matrix on the TP ranks of one DP rank form that DP rank's TP
group (the layouts, hence the homes, are the same on every TP rank: checked when the exchange is
built). Per piece (the matrix, or its Q, K and V rows over the local query groups):

* ``duplicated``: the TP ranks all-gather their blocks along ``partition_dim`` (concatenated in TP rank
  order, as megatron-core does: for a strided param such as SwiGLU's fc1 that is a row permutation of
  the model's matrix, to which Newton-Schulz is equivariant), each runs Newton-Schulz on the full matrix
  and keeps its own block, scaled by the FULL shape.
* ``distributed``: Newton-Schulz on the blocks: the Frobenius norm and, every iteration, the Gram matrix
  X X^T (X oriented so that the split dimension is summed over) are all-reduced over the TP group; the
  same result as ``duplicated`` in exact arithmetic, with the full-shape scale.

All homed matrices of one TP group go in one batch: one all-gather (duplicated), or one all-reduce for
the norms and one per iteration (distributed). Every TP rank of one DP rank homes the same matrices, so
every rank joins every collective. ``blockwise`` matrices, and params not split over TP (every TP rank
computes the same, bitwise), never come here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ... import collectives
from ..rules.muon import NS_EPS, QUINTIC, Muon, float32_matmul_precision, newton_schulz, newton_schulz_step


@dataclass(frozen=True)
class TensorSplit:
    """How a Muon matrix is split over tensor parallelism, for the duplicated / distributed modes."""

    partition_dim: int  # 0 (column-parallel: rows split) or 1 (row-parallel: columns split)
    size: int  # TP ranks
    rank: int  # this rank's block
    group: Optional[torch.distributed.ProcessGroup] = field(default=None, compare=False, repr=False)

    def full_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The shape of the matrix whose TP-local block is (rows, cols)."""
        return (rows * self.size, cols) if self.partition_dim == 0 else (rows, cols * self.size)

    def multiple(self) -> tuple[int, int]:
        return (self.size, 1) if self.partition_dim == 0 else (1, self.size)


def partition_dim_of(param: torch.Tensor) -> Optional[int]:
    """The dimension along which megatron-core splits a 2-D param over tensor parallelism (its
    ``tensor_model_parallel`` and ``partition_dim`` attributes, which it sets at TP 1 too); None when it is not split
    (partition_dim -1 is megatron-core's "not split")."""
    dim = getattr(param, "partition_dim", -1)
    return int(dim) if getattr(param, "tensor_model_parallel", False) and dim in (0, 1) else None


def tensor_split_of(param: torch.Tensor, group: Optional[torch.distributed.ProcessGroup],
                    tp_mode: str) -> Optional[TensorSplit]:
    """The split of a TP-split 2-D param orthogonalised across TP (``tp_mode`` duplicated or distributed);
    None when it is orthogonalised locally (blockwise, not split over TP, or one TP rank). ``group``: the
    shard's ``tensor_parallel_group`` (the expert TP group for expert buckets)."""
    dim = partition_dim_of(param)
    if tp_mode == "blockwise" or group is None or dim is None or collectives.world_size(group) == 1:
        return None
    return TensorSplit(dim, collectives.world_size(group), collectives.rank(group), group)


def own_block(full: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """This TP rank's block of a full matrix (megatron-core: chunk along partition_dim, own rank's)."""
    return full.chunk(split.size, dim=split.partition_dim)[split.rank]


def orthogonalize_split(rule: Muon, items: Sequence[tuple[torch.Tensor, Optional[Sequence[int]], TensorSplit]]
                        ) -> list[torch.Tensor]:
    """O for each (TP-local block of U, QKV split, TensorSplit) of one TP group, in the rule's TP mode
    (a collective over the group: every rank of it calls it with the same matrices, in the same order)."""
    if not items:
        return []
    pieces = [rule.split_pieces(u, qkv) for u, qkv, _ in items]
    flat = [(p, split) for ps, (_, _, split) in zip(pieces, items) for p in ps]
    if rule.tp_mode == "duplicated":
        outs = _duplicated(rule, flat)
    elif rule.tp_mode == "distributed":
        outs = _distributed(rule, flat)
    else:
        raise ValueError(f"orthogonalize_split: tp_mode {rule.tp_mode!r} orthogonalises locally")
    result, at = [], 0
    for (u, qkv, _), ps in zip(items, pieces):
        result.append(rule.join_pieces(outs[at:at + len(ps)], u, qkv))
        at += len(ps)
    return result


def _duplicated(rule: Muon, pieces: list[tuple[torch.Tensor, TensorSplit]]) -> list[torch.Tensor]:
    group_split = pieces[0][1]
    send = torch.cat([p.reshape(-1) for p, _ in pieces])
    gathered = torch.empty(group_split.size * send.numel(), dtype=send.dtype, device=send.device)
    collectives.all_gather(gathered, send, group_split.group, async_op=False)
    blocks = gathered.view(group_split.size, -1)
    outs, at = [], 0
    for p, split in pieces:
        n = p.numel()
        full = torch.cat([blocks[t, at:at + n].view(p.shape) for t in range(split.size)], dim=split.partition_dim)
        at += n
        orth = newton_schulz(full, rule.num_ns_steps, rule.fp32_matmul_prec) * rule.scale(*split.full_shape(*p.shape))
        outs.append(own_block(orth, split))
    return outs


def reduce_over_tensor_parallel(flat: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """The sum over the TP group of ``flat`` (the distributed mode's norms and Gram matrices), reduced
    in at least fp32 (gloo has no bf16 sum; with two ranks the rounding is the same)."""
    wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    collectives.all_reduce(wide, split.group)
    return wide.to(flat.dtype)


def reduce_gram(flat: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """The Gram matrices of one iteration (flat, concatenated), summed over the TP group."""
    return reduce_over_tensor_parallel(flat, split)


def _distributed(rule: Muon, pieces: list[tuple[torch.Tensor, TensorSplit]]) -> list[torch.Tensor]:
    group_split = pieces[0][1]
    # Orient each block so that the split dimension is the one X X^T sums over: rows split -> X = U^T.
    xs = [p.T if split.partition_dim == 0 else p for p, split in pieces]
    squares = reduce_over_tensor_parallel(torch.stack([(x * x).sum() for x in xs]), group_split)
    xs = [x / s.sqrt().clamp_min(NS_EPS) for x, s in zip(xs, squares)]
    precision = rule.fp32_matmul_prec
    if precision == "medium":
        xs = [x.to(torch.bfloat16) if x.dtype == torch.float32 else x for x in xs]
    with float32_matmul_precision(precision):
        for i in range(rule.num_ns_steps):
            a, b, c = QUINTIC[i % len(QUINTIC)]
            grams = [x @ x.T for x in xs]
            summed = reduce_gram(torch.cat([g.reshape(-1) for g in grams]), group_split)
            at, nxt = 0, []
            for x, g in zip(xs, grams):
                gram = summed[at:at + g.numel()].view(g.shape)
                at += g.numel()
                nxt.append(newton_schulz_step(x, gram, a, b, c))
            xs = nxt
    outs = []
    for (p, split), x in zip(pieces, xs):
        x = x.to(p.dtype)
        outs.append((x.T if split.partition_dim == 0 else x) * rule.scale(*split.full_shape(*p.shape)))
    return outs


__all__ = ["TensorSplit", "partition_dim_of", "tensor_split_of", "orthogonalize_split", "own_block", "reduce_gram",
           "reduce_over_tensor_parallel"]
