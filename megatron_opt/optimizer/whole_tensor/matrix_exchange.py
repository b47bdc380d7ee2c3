"""The whole-tensor stage of a step: gather each matrix to its home rank, orthogonalise it there, and
return every owner its slice (docs/design.md, "Rules that need whole tensors").

Element-range ownership stays as it is: a rank owns ranges of the flat buffers, and a matrix may
straddle ranks. Each matrix has one home in the data-parallel group (homes.assign_homes, from
the layout, the same on every rank); a matrix wholly inside one rank's ranges moves nothing. One
step is two ``all_to_all_single`` calls over the group (the owners' pieces to the homes, the homes'
slices back), whose split sizes are fixed when the stage is built, and issued by every rank whether
or not it sends anything, so no rank waits on a collective another rank skips. A failure while a
home orthogonalises is held until both collectives ran, then raised (the step driver agrees on it).

Under tensor parallelism each TP rank runs its own exchange over its own data-parallel group, on its
TP-local blocks. The layouts are the same on every TP rank, so a matrix's home DP rank is too (checked
over the TP group when the exchange is built): the homes of one matrix form a TP group, and the
``orthogonalize`` callable may run TP collectives among them (whole_tensor/tensor_parallel_newton_schulz.py), in
matrix order, every TP rank of the home with the same matrices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ... import collectives
from ...distributed.shard_view import LocalShard
from ...errors import InvalidConfigError, UnsupportedConfigError
from .homes import MatrixPlacement, assign_homes
from .tensor_parallel_newton_schulz import TensorSplit

MatrixKey = tuple[int, int, int, int]  # (model chunk, buffer, bucket, param index): the same on every rank
# Every homed matrix's O from its U (TP-local block), in matrix order: a collective over the TP group
# for matrices orthogonalised across TP.
Orthogonalize = Callable[[Sequence[tuple[torch.Tensor, "Matrix"]]], list[torch.Tensor]]
TensorSplitOf = Callable[[torch.nn.Parameter, LocalShard], Optional[TensorSplit]]


@dataclass(frozen=True)
class Matrix:
    """One whole-tensor param as the layout places it."""

    key: MatrixKey
    name: str
    shape: tuple[int, int]
    ranges: tuple[tuple[int, int], ...]  # per DP rank: the flat param range it owns ((0, 0): none)
    home: int
    qkv_split: Optional[tuple[int, ...]] = None
    tensor_split: Optional[TensorSplit] = None  # orthogonalised across TP (None: on the local block alone)

    def owned(self, rank: int) -> int:
        start, end = self.ranges[rank]
        return end - start


def piece_key(chunk: int, shard: LocalShard, param_index: int) -> MatrixKey:
    return (chunk, shard.buffer_index, shard.bucket_index, param_index)


class MatrixExchange:
    """The matrices of some published shards, their homes, and the per-step exchange."""

    def __init__(self, shards: Sequence[tuple[int, LocalShard]], selects: Callable[[torch.nn.Parameter], bool],
                 qkv_split_of: Callable[[str, torch.nn.Parameter], Optional[tuple[int, ...]]],
                 pieces_of: Callable[[tuple[int, int], Optional[tuple[int, ...]]], int],
                 cost_of: Callable[[MatrixPlacement], float], tensor_split_of: Optional[TensorSplitOf] = None,
                 homes_anywhere: bool = False) -> None:
        """``shards``: (model chunk index, shard) for every published shard (also those holding no piece
        here); ``selects``: which params are matrices of this stage; ``cost_of``: the rule's cost of a
        matrix's update at its home (the balance of the homes); ``tensor_split_of``: which are
        orthogonalised across tensor parallelism, and how (None: none); ``homes_anywhere``: any rank of the group
        may be a matrix's home, not only its owners (``homes.assign_homes``)."""
        # One exchange runs over one data-parallel group: the dense or the expert one (get_megatron_optimizer
        # gives each its own leaf), with partial sharding one optimizer instance of it (the instances hold
        # bitwise-equal gradients, so each computes the same update). Chunks may hold equal groups apart.
        groups = {tuple(collectives.global_ranks(s.group)) for _, s in shards if s.sharded}
        if len(groups) > 1:
            raise UnsupportedConfigError(f"one whole-tensor stage over shards of several data-parallel groups "
                                         f"{sorted(groups)}: give dense and expert-parallel params separate "
                                         f"optimizers (get_megatron_optimizer does).")
        self.group = shards[0][1].group if shards else None
        self.sharded = any(s.sharded for _, s in shards)
        self.size = collectives.world_size(self.group) if self.sharded else 1
        self.rank = shards[0][1].rank if (shards and self.sharded) else 0
        mine: dict[MatrixKey, tuple[int, int]] = {}
        described: dict[MatrixKey, tuple[str, torch.nn.Parameter]] = {}
        tensor_splits: dict[MatrixKey, Optional[TensorSplit]] = {}
        for chunk, s in shards:
            for i in sorted(s.params):
                if selects(s.params[i]):
                    described[piece_key(chunk, s, i)] = (s.names[i], s.params[i])
                    tensor_splits[piece_key(chunk, s, i)] = tensor_split_of(s.params[i], s) if tensor_split_of else None
            for pc in s.pieces:
                mine[piece_key(chunk, s, pc.param_index)] = (pc.param_range.start, pc.param_range.end)
        keys = sorted(described)
        failure: Optional[BaseException] = None
        try:  # (a param's QKV split may be refused on one rank only: every rank raises together below)
            splits = [qkv_split_of(*described[k]) for k in keys]
        except Exception as exc:  # noqa: BLE001
            failure, splits = exc, []
        # Which rank owns which range: every rank reports its own, once (the layout is the same everywhere).
        mine_ranges = [mine.get(k, (0, 0)) for k in keys]
        if self.sharded:
            everyone = collectives.agree("the whole-tensor stage's matrices", failure, self.group,
                                         payload=mine_ranges, error_type=InvalidConfigError)
        elif failure is not None:
            raise failure
        else:
            everyone = [mine_ranges]
        shapes = [tuple(described[k][1].shape) for k in keys]
        placements = [MatrixPlacement(shape=shape, owned=tuple(e - s for s, e in (r[j] for r in everyone)),
                                      pieces=pieces_of(shape, split))
                      for j, (shape, split) in enumerate(zip(shapes, splits))]
        homes = assign_homes(placements, self.size, cost=cost_of, anywhere=homes_anywhere) if placements else []
        self.matrices = [Matrix(k, described[k][0], shapes[j], tuple(r[j] for r in everyone), homes[j], splits[j],
                                tensor_splits[k]) for j, k in enumerate(keys)]
        self._check_tensor_parallel_peers()
        r = self.rank
        self._sent = [m for m in self.matrices if m.home != r and m.owned(r)]  # my pieces, to their homes
        self._homed = [m for m in self.matrices if m.home == r]
        self.input_splits = [sum(m.owned(r) for m in self._sent if m.home == d) for d in range(self.size)]
        self.output_splits = [sum(m.owned(s) for m in self._homed) if s != r else 0 for s in range(self.size)]
        # The same on every rank: whether any rank other than a matrix's home owns part of it (else the step
        # moves nothing). With homes anywhere a matrix wholly on one rank may be homed on another.
        self.moves = any(rg[1] > rg[0] for m in self.matrices for s, rg in enumerate(m.ranges) if s != m.home)

    @property
    def homed(self) -> list[Matrix]:
        """The matrices whose home is this rank, in matrix order."""
        return list(self._homed)

    def run(self, directions: dict[MatrixKey, torch.Tensor], orthogonalize: Orthogonalize,
            device: torch.device, dtype: torch.dtype = torch.float32) -> dict[MatrixKey, torch.Tensor]:
        """This rank's slices of every matrix's orthogonalised update, from this rank's slices of the
        update directions (``directions``: flat, ``dtype`` (fp32; float64 in verify mode), keyed by
        matrix). Every rank of the group calls it."""
        r = self.rank
        received = self._exchange(self._pack_to_homes(directions, device, dtype), self.output_splits,
                                  self.input_splits, device, dtype)
        out: dict[MatrixKey, torch.Tensor] = {}
        returned: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        failure: Optional[BaseException] = None
        offsets = self._offsets(self.output_splits)
        fulls = []
        for m in self._homed:
            full = torch.zeros(m.shape[0] * m.shape[1], dtype=dtype, device=device)
            for s, (start, end) in enumerate(m.ranges):
                if end <= start:
                    continue
                if s == r:
                    full[start:end] = directions[m.key]
                else:
                    full[start:end] = received[offsets[s]:offsets[s] + end - start]
                    offsets[s] += end - start
            fulls.append(full)
        try:
            fulls = [o.reshape(-1) for o in orthogonalize([(f.view(m.shape), m) for f, m in zip(fulls, self._homed)])]
        except Exception as exc:  # noqa: BLE001  (raised after the return trip, on every rank by the driver)
            failure = exc
        for m, full in zip(self._homed, fulls):
            for s, (start, end) in enumerate(m.ranges):
                if end > start:
                    if s == r:
                        out[m.key] = full[start:end]
                    else:
                        returned[s].append(full[start:end])
        back = self._exchange(_concat(returned, device, dtype), self.input_splits, self.output_splits, device, dtype)
        back_offsets = self._offsets(self.input_splits)  # grouped by home, in matrix order within each
        for m in self._sent:
            n = m.owned(r)
            out[m.key] = back[back_offsets[m.home]:back_offsets[m.home] + n]
            back_offsets[m.home] += n
        if failure is not None:
            raise failure
        return out

    def _check_tensor_parallel_peers(self) -> None:
        """The TP ranks holding blocks of the same matrices must agree on them and on their homes (the
        TP collectives of the duplicated / distributed modes run among the homes): one agree per TP group."""
        by_group: dict[int, list[Matrix]] = {}
        for m in self.matrices:
            if m.tensor_split is not None:
                by_group.setdefault(id(m.tensor_split.group), []).append(m)
        for ms in by_group.values():
            collectives.agree("the whole-tensor stage's TP-split matrices", None, ms[0].tensor_split.group,
                              fingerprint=[(m.name, (m.key, m.shape, m.home, m.tensor_split.partition_dim,
                                                     m.tensor_split.size)) for m in ms],
                              error_type=InvalidConfigError,
                              fix="the tensor-parallel ranks must hold the same model split the same way, with "
                                  "the same data-parallel layout (bucket sizes, padding).")

    def _pack_to_homes(self, directions: dict[MatrixKey, torch.Tensor], device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
        per_dest: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        for m in self._sent:
            per_dest[m.home].append(directions[m.key])
        return _concat(per_dest, device, dtype)

    def _exchange(self, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        if self.moves:
            collectives.all_to_all(recv, send, recv_splits, send_splits, self.group)
        return recv

    @staticmethod
    def _offsets(splits: Sequence[int]) -> list[int]:
        out, total = [], 0
        for n in splits:
            out.append(total)
            total += n
        return out


def _concat(per_rank: list[list[torch.Tensor]], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    parts = [t.to(dtype) for ts in per_rank for t in ts]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


__all__ = ["MatrixExchange", "Matrix", "MatrixKey", "piece_key"]
