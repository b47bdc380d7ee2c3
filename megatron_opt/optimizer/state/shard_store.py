"""The optimizer's state for a set of published shards: masters, update-rule state and param groups.

For each ``LocalShard`` (this rank's range of one bucket) that holds pieces, an ``OwnedShard``:
  * ``master``: fp32. A detached fp32 clone for bf16/fp16 params; for fp32 params a detached view
    of the param buffer, so the update lands in the model param with no copy. With
    ``main_params_dtype=float16`` an fp16 copy, with ``param_remainders`` the int16 remainder of the
    bf16 param (ops/precision.py);
  * the update rule's state tensors (AdamW's moments, SGD's momentum, Lion's exp_avg), owned
    elements only;
  * a PieceTable: where each param piece lies, whether it counts in the norm, its param group;
  * per piece, the view of the master that ``param_groups`` hold.
A store with ``selects`` (Muon's split of one buffer between two stores) holds one OwnedShard per
maximal contiguous run of selected pieces: ``shard`` is then the published shard NARROWED to the run
(grad and param views over it, piece shard ranges re-based to it, ``offset`` where it starts), so
masters and rule state exist for the selected elements only and every consumer (kernels, verify,
state access) keeps reading ``shard_range`` in the OwnedShard's own coordinates.
Every tensor in ``param_groups`` is a leaf view of a master (docs/contract.md rule 6). The store
allocates and describes; it runs nothing (the leaf steps it, piece_state reads and writes it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ...distributed.shard_view import GradSource, LocalShard, ShardPiece, with_tensor_parallel_rank
from ...ops import precision
from ...ops.piece_table import PieceTable
from ..build.param_groups import group_weight_decay
from ..rules.base import UpdateRule

_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "allreduce",
                   "sequence_parallel", "grad_norm_group")


@dataclass
class OwnedShard:
    """The optimizer's side of one LocalShard."""

    shard: LocalShard
    source: GradSource
    table: PieceTable
    master: torch.Tensor
    param_out: Optional[torch.Tensor]  # None when master aliases the fp32 param buffer
    state: dict[str, torch.Tensor]  # the update rule's tensors, by name
    main_params: tuple[torch.Tensor, ...]  # per piece: the leaf view of master in param_groups
    offset: int = 0  # where ``shard`` starts in the published shard (a narrowed run with ``selects``)


class ShardStore:
    """Masters, rule state and param groups for the dense (or expert-parallel) shards of some chunks."""

    def __init__(
        self,
        sources: Sequence[GradSource],
        rule: UpdateRule,
        param_groups: Optional[list[dict]],
        *,
        default_lr: float,
        default_weight_decay: float,
        expert_parallel: bool = False,
        tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        main_params_dtype: torch.dtype = torch.float32,
        param_remainders: bool = False,
        selects: Optional[Callable[[torch.nn.Parameter], bool]] = None,
    ) -> None:
        """``selects``: the params this store owns (None: every param of the shards); the shards it
        publishes to its leaf then hold only those params' pieces (the others are gaps to it), so two
        stores with complementary predicates split the same buffers (Muon's matrices and the rest)."""
        self.sources = list(sources)
        self.rule = rule
        self.main_params_dtype = main_params_dtype
        self.param_remainders = param_remainders
        self.is_expert_parallel = expert_parallel
        # Every published shard of the chunks, also those holding no piece on this rank.
        self.published = [(src, s if selects is None else _restricted(s, selects))
                          for src in self.sources for s in src.local_shards(expert_parallel)]
        self.selects = selects
        self.device = self.published[0][1].grad.device if self.published else torch.device("cpu")
        self.step = torch.zeros(1, dtype=torch.int64, device=self.device)  # updates applied so far
        self.param_groups = self._build_param_groups(param_groups, default_lr, default_weight_decay)
        # The shards' stats roles carry the TP ranks DistributedDataParallel knows; the older
        # tensor_parallel_group keyword is translated into them by the shard view.
        self.shards = self._build_shards(tensor_parallel_group)

    def managed_params(self) -> dict[int, tuple[str, torch.nn.Parameter]]:
        """id(param) -> (name, param) for every param of the published shards."""
        return {id(p): (s.names[i], p) for _, s in self.published for i, p in s.params.items()
                if self.selects is None or self.selects(p)}

    def _build_param_groups(self, groups: Optional[list[dict]], lr: float, weight_decay: float) -> list[dict]:
        managed = self.managed_params()
        if groups is None:
            groups = [{"params": [p for _, p in managed.values()]}]
        self._group_of: dict[int, int] = {}
        out = []
        for gi, group in enumerate(groups):
            for p in group["params"]:
                if id(p) not in managed:
                    raise ValueError(
                        f"param group {gi} holds a param (shape {tuple(p.shape)}) that is not in this optimizer's "
                        f"buffers: it has requires_grad=False, belongs to no model chunk, or is "
                        f"{'dense' if self.is_expert_parallel else 'expert-parallel'}."
                    )
                if id(p) in self._group_of:
                    raise ValueError(f"a param (shape {tuple(p.shape)}) appears in param groups "
                                     f"{self._group_of[id(p)]} and {gi}.")
                self._group_of[id(p)] = gi
            options = {k: v for k, v in group.items() if k != "params"}
            options.setdefault("lr", lr)
            options.setdefault("weight_decay", group_weight_decay(weight_decay, options))
            out.append({"params": [], **options})
        missing = [name for pid, (name, _) in managed.items() if pid not in self._group_of]
        if missing:
            raise ValueError(f"params missing from every param group: {missing[:5]}; "
                             f"give every trainable param a group.")
        return out

    def _build_shards(self, tensor_parallel_group: Optional[torch.distributed.ProcessGroup]) -> list[OwnedShard]:
        shards = []
        for source, published in self.published:
            for offset, shard in _owned_views(published, whole=self.selects is None):
                shards.append(self._owned_shard(source, shard, offset, tensor_parallel_group))
        owned = {id(s.shard.params[pc.param_index]) for s in shards for pc in s.shard.pieces}
        # (with ``selects``, another store holds the other params: leave their main_param alone)
        for _, p in self.managed_params().values():
            if id(p) not in owned:
                p.main_param, p.main_param_sharded = None, True
        return shards

    def _owned_shard(self, source: GradSource, shard: LocalShard, offset: int,
                     tensor_parallel_group: Optional[torch.distributed.ProcessGroup]) -> OwnedShard:
        params = [shard.params[pc.param_index] for pc in shard.pieces]
        role = with_tensor_parallel_rank(shard.stats_role, tensor_parallel_group)
        table = PieceTable(
            starts=tuple(pc.shard_range.start for pc in shard.pieces),
            ends=tuple(pc.shard_range.end for pc in shard.pieces),
            in_norm=tuple(role.counts_in_norm(p) for p in params),
            group=tuple(self._group_of[id(p)] for p in params),
            numel=shard.numel,
        )
        master, param_out = self._new_master(shard.param)
        # What param_groups hold: views of the master; with remainders (int16, not a value) views
        # of the bf16 param shard, which is the master rounded.
        main_source = shard.param.detach() if precision.is_remainder(master) else master
        mains = []
        for pc, p in zip(shard.pieces, params):
            main = main_source[pc.shard_range.start : pc.shard_range.end]  # a leaf: no autograd history
            for attr in _PARALLEL_ATTRS:
                if hasattr(p, attr):
                    setattr(main, attr, getattr(p, attr))
            p.main_param, p.main_param_sharded = main, True
            self.param_groups[self._group_of[id(p)]]["params"].append(main)
            mains.append(main)
        return OwnedShard(shard, source, table, master, param_out, self.rule.init_state(master), tuple(mains),
                          offset)

    def _new_master(self, param: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(master, param_out) for a param shard. fp32 params: the param itself (updates land in the
        model). bf16 params with remainders: an int16 remainder, zero since the param is exactly the
        master at first. Otherwise a copy in main_params_dtype (fp32, or fp16)."""
        if param.dtype == torch.float32:
            return param.detach(), None
        if self.param_remainders and param.dtype == torch.bfloat16:
            return torch.zeros(param.shape, dtype=torch.int16, device=param.device), param
        return param.detach().to(self.main_params_dtype, copy=True), param


def _restricted(shard: LocalShard, selects: Callable[[torch.nn.Parameter], bool]) -> LocalShard:
    """``shard`` with only the pieces of the params ``selects`` keeps (the same flat views)."""
    return dataclasses.replace(shard, pieces=tuple(pc for pc in shard.pieces if selects(shard.params[pc.param_index])))


def _owned_views(shard: LocalShard, whole: bool) -> list[tuple[int, LocalShard]]:
    """(offset, view) of what a store owns of ``shard``: the whole shard (``whole``: a store without
    ``selects``, gaps and padding included, as always), else one narrowed view per maximal run of
    pieces that touch each other, so a piece's neighbours from the other store, and the padding between
    pieces, get no master and no state here."""
    if not shard.pieces:
        return []
    if whole:
        return [(0, shard)]
    runs: list[list] = []
    for pc in shard.pieces:
        if runs and runs[-1][-1].shard_range.end == pc.shard_range.start:
            runs[-1].append(pc)
        else:
            runs.append([pc])
    return [(run[0].shard_range.start, _narrowed(shard, run)) for run in runs]


def _narrowed(shard: LocalShard, run: Sequence[ShardPiece]) -> LocalShard:
    """``shard`` over [first piece start, last piece end) only, its pieces' shard ranges re-based to it."""
    lo, hi = run[0].shard_range.start, run[-1].shard_range.end
    pieces = tuple(dataclasses.replace(pc, shard_range=pc.shard_range.shift(-lo)) for pc in run)
    return dataclasses.replace(shard, grad=shard.grad[lo:hi], param=shard.param[lo:hi], pieces=pieces)


def master_values(s: OwnedShard) -> torch.Tensor:
    """A shard's masters as fp32 values (a view for fp32 masters, else a new tensor)."""
    return precision.load_master(s.master, s.param_out)


__all__ = ["OwnedShard", "ShardStore", "master_values"]
