"""DistributedOptimizer: fp32 master weights and Adam/SGD state for this rank's shard of each bucket.

Rank r owns a contiguous 1/DP range of every bucket (a param may straddle ranks). For each owned
range (a "shard") it keeps:
  * master: fp32. A detached fp32 clone for bf16/fp16 params; for fp32 params a detached view of
    the param buffer, so the update lands in the model param with no copy.
  * exp_avg, exp_avg_sq (AdamW) or momentum_buffer (SGD): fp32, owned elements only.
  * a PieceTable saying where each param piece lies, whether it counts in the norm, its group.
Every tensor in ``param_groups`` is a leaf view of a master (CONTRACT rule 6).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .. import ops
from ..config import OptimizerConfig
from ..distributed import collectives
from ..distributed.buffers import Bucket, ParamAndGradBuffer
from ..distributed.ddp import DistributedDataParallel
from ..ops.piece_table import PieceTable
from .grad_scaler import MegatronGradScaler
from .step_machine import StepMachine

STATE_DICT_FORMAT = "megatron_opt.DistributedOptimizer/1"
_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "allreduce",
                   "sequence_parallel", "grad_norm_group")


@dataclass
class _Piece:
    model_param: torch.nn.Parameter
    main_param: torch.Tensor  # leaf view of the shard's master


@dataclass
class _Shard:
    chunk: DistributedDataParallel
    buffer: ParamAndGradBuffer
    bucket: Bucket
    table: PieceTable
    master: torch.Tensor
    param_out: Optional[torch.Tensor]  # None when master aliases the fp32 param buffer
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    momentum_buffer: Optional[torch.Tensor]
    pieces: list[_Piece]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        names = ("master", "exp_avg", "exp_avg_sq", "momentum_buffer")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def _tp_rank(group: Optional[torch.distributed.ProcessGroup]) -> int:
    return collectives.rank(group) if group is not None else 0


class DistributedOptimizer(StepMachine):
    """ZeRO-1 optimizer over the grad buffers of one or more DistributedDataParallel chunks.

    Args:
        config: OptimizerConfig (optimizer 'adam' = AdamW, or 'sgd').
        model_chunks: DistributedDataParallel modules whose buffers this optimizer owns.
        param_groups: torch-style groups of *model* params with optional 'wd_mult', 'lr_mult',
            'max_lr', 'min_lr', 'lr', 'weight_decay'. Default: one group with every param.
        grad_scaler: a MegatronGradScaler, or None (bf16 / fp32: non-finite steps still skip).
        expert_parallel: own the expert-parallel buffers (params with allreduce=False) instead of
            the dense ones.
        model_parallel_group: ranks whose shards hold *different* params (TP/PP); the grad stats
            are summed over it too.
        tensor_parallel_group: gives the TP rank; params without ``tensor_model_parallel`` count in
            the norm on TP rank 0 only (they are duplicates elsewhere).
    """

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks: Sequence[DistributedDataParallel],
        param_groups: Optional[list[dict]] = None,
        grad_scaler: Optional[MegatronGradScaler] = None,
        expert_parallel: bool = False,
        model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        if not model_chunks:
            raise ValueError("DistributedOptimizer needs at least one DistributedDataParallel model chunk.")
        for chunk in model_chunks:
            if not isinstance(chunk, DistributedDataParallel):
                raise TypeError(f"model chunks must be megatron_opt.DistributedDataParallel, got {type(chunk).__name__}.")
        self.config = config
        self.model_chunks = list(model_chunks)
        self.grad_scaler = grad_scaler
        self.is_expert_parallel = expert_parallel
        self.model_parallel_group = model_parallel_group
        self._buffers = [(c, b) for c in self.model_chunks for b in c.buffers if b.is_expert_parallel == expert_parallel]
        device = self._buffers[0][1].grad_data.device if self._buffers else torch.device("cpu")
        self._init_step_machine(device)
        self._step = torch.zeros(1, dtype=torch.int64, device=device)
        self.param_groups = self._build_param_groups(param_groups)
        self._shards = self._build_shards(_tp_rank(tensor_parallel_group))
        self._inv_scale: dict[int, torch.Tensor] = {}

    # ----------------------------------------------------------------- construction
    def _build_param_groups(self, groups: Optional[list[dict]]) -> list[dict]:
        managed = {id(p): p for _, buf in self._buffers for p in buf.params}
        if groups is None:
            groups = [{"params": list(managed.values())}]
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
                    raise ValueError(f"a param (shape {tuple(p.shape)}) appears in param groups {self._group_of[id(p)]} and {gi}.")
                self._group_of[id(p)] = gi
            options = {k: v for k, v in group.items() if k != "params"}
            options.setdefault("lr", self.config.lr)
            options.setdefault("weight_decay", self.config.weight_decay * options.get("wd_mult", 1.0))
            out.append({"params": [], **options})
        missing = [buf.name_of(p) for _, buf in self._buffers for p in buf.params if id(p) not in self._group_of]
        if missing:
            raise ValueError(f"params missing from every param group: {missing[:5]}; give every trainable param a group.")
        return out

    def _build_shards(self, tp_rank: int) -> list[_Shard]:
        adam = self.config.optimizer == "adam"
        shards = []
        for chunk, buf in self._buffers:
            for bucket in buf.buckets:
                pieces = buf.layout.shard_pieces(bucket.index, buf.rank)
                if not pieces:
                    continue
                params = [buf.params[pc.param_index] for pc in pieces]
                table = PieceTable(
                    starts=tuple(pc.shard_range.start for pc in pieces),
                    ends=tuple(pc.shard_range.end for pc in pieces),
                    in_norm=tuple(self._counts_in_norm(p, tp_rank) for p in params),
                    group=tuple(self._group_of[id(p)] for p in params),
                    numel=bucket.grad_shard.numel(),
                )
                if buf.param_dtype == torch.float32:
                    master, param_out = bucket.param_shard.detach(), None  # alias: updates land in the model
                else:
                    master, param_out = bucket.param_shard.detach().to(torch.float32, copy=True), bucket.param_shard
                momentum = None if adam or self.config.sgd_momentum == 0 else torch.zeros_like(master)
                shard = _Shard(
                    chunk=chunk, buffer=buf, bucket=bucket, table=table, master=master, param_out=param_out,
                    exp_avg=torch.zeros_like(master) if adam else None,
                    exp_avg_sq=torch.zeros_like(master) if adam else None,
                    momentum_buffer=momentum, pieces=[],
                )
                for pc, p in zip(pieces, params):
                    main = master[pc.shard_range.start : pc.shard_range.end]  # a leaf: master has no autograd history
                    for attr in _PARALLEL_ATTRS:
                        if hasattr(p, attr):
                            setattr(main, attr, getattr(p, attr))
                    p.main_param, p.main_param_sharded = main, True
                    shard.pieces.append(_Piece(p, main))
                    self.param_groups[self._group_of[id(p)]]["params"].append(main)
                shards.append(shard)
        owned = {id(pc.model_param) for s in shards for pc in s.pieces}
        for _, buf in self._buffers:
            for p in buf.params:
                if id(p) not in owned:
                    p.main_param, p.main_param_sharded = None, True
        return shards

    @staticmethod
    def _counts_in_norm(p: torch.nn.Parameter, tp_rank: int) -> bool:
        if getattr(p, "shared", False):
            return False
        return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0

    # ----------------------------------------------------------------- StepMachine hooks
    def _children(self) -> list["DistributedOptimizer"]:
        return [self]

    def _stats_groups(self) -> list:
        groups = []
        if any(buf.reduce_scatter for _, buf in self._buffers):
            groups.append(self._buffers[0][1].group)
        if self.model_parallel_group is not None:
            groups.append(self.model_parallel_group)
        return groups

    def _accumulate_local_stats(self, stats: torch.Tensor, loss_scale: torch.Tensor) -> None:
        self._inv_scale = {id(c): c.grad_scale_factor / loss_scale for c in self.model_chunks}
        count_zeros = bool(self.config.log_num_zeros_in_grad)
        for s in self._shards:
            ops.grad_stats(s.bucket.grad_shard, s.table, self._inv_scale[id(s.chunk)], stats[: ops.NUM_STATS], count_zeros)

    def _apply_update(self, clip_coef: float) -> None:
        if not self._shards:
            return
        ops.advance_step(self._step)
        lr = [float(g["lr"]) for g in self.param_groups]
        wd = [float(g["weight_decay"]) for g in self.param_groups]
        cfg = self.config
        for s in self._shards:
            grad_scale = self._inv_scale[id(s.chunk)] * clip_coef
            if cfg.optimizer == "adam":
                ops.adamw_step(s.bucket.grad_shard, s.master, s.exp_avg, s.exp_avg_sq, s.param_out, s.table,
                               lr=lr, weight_decay=wd, grad_scale=grad_scale, step=self._step,
                               beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, eps=cfg.adam_eps)
            else:
                ops.sgd_step(s.bucket.grad_shard, s.master, s.momentum_buffer, s.param_out, s.table,
                             lr=lr, weight_decay=wd, grad_scale=grad_scale, momentum=cfg.sgd_momentum)

    def _sync_params(self) -> None:
        for chunk in self.model_chunks:
            mine = [buf for c, buf in self._buffers if c is chunk]
            if mine:
                chunk.start_param_sync(buffers=mine)

    # ----------------------------------------------------------------- Megatron-LM accessors
    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per main param: views of the flat optimizer state, as torch.optim exposes it."""
        out = {}
        for s in self._shards:
            for pc, start, end in zip(s.pieces, s.table.starts, s.table.ends):
                entry: dict[str, Any] = {"step": self._step}
                for name in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    t = getattr(s, name)
                    if t is not None:
                        entry[name] = t[start:end]
                out[pc.main_param] = entry
        return out

    @property
    def step_count(self) -> int:
        return int(self._step.item())

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def reload_model_params(self) -> None:
        """Re-copy the model params (e.g. after loading a model checkpoint) into the fp32 masters."""
        for s in self._shards:
            if s.param_out is not None:
                s.master.copy_(s.param_out)

    # ----------------------------------------------------------------- checkpointing (same DP size)
    def _fingerprint(self) -> dict:
        return {
            "optimizer": self.config.optimizer,
            "shards": [
                {
                    "param_dtype": str(s.buffer.param_dtype),
                    "grad_dtype": str(s.buffer.grad_dtype),
                    "bucket_params": [tuple(p.shape) for p in s.bucket.params],
                    "shard_count": s.buffer.shard_count,
                    "rank": s.buffer.rank,
                    "numel": s.table.numel,
                }
                for s in self._shards
            ],
        }

    def state_dict(self) -> dict:
        return {
            "format": STATE_DICT_FORMAT,
            "fingerprint": self._fingerprint(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "step": self.step_count,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "shards": [{k: v.detach().cpu().clone() for k, v in s.state_tensors().items()} for s in self._shards],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's shard state; every rank must call it (it ends with a param all-gather)."""
        self._check_loadable(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self._step.fill_(int(state_dict["step"]))
        for s, saved in zip(self._shards, state_dict["shards"]):
            for name, t in s.state_tensors().items():
                t.copy_(saved[name])
            if s.param_out is not None:
                s.param_out.copy_(s.master)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._sync_params()
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def _check_loadable(self, state_dict: dict) -> None:
        fix = "Load a checkpoint saved by this model with the same data-parallel size and precision."
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(f"not a megatron_opt DistributedOptimizer state_dict (format "
                             f"{state_dict.get('format') if isinstance(state_dict, dict) else type(state_dict)}). {fix}")
        mine, theirs = self._fingerprint(), state_dict["fingerprint"]
        if mine["optimizer"] != theirs["optimizer"]:
            raise ValueError(f"state_dict is for optimizer '{theirs['optimizer']}', this one is "
                             f"'{mine['optimizer']}'. {fix}")
        if len(mine["shards"]) != len(theirs["shards"]):
            raise ValueError(f"state_dict has {len(theirs['shards'])} shards on this rank, this optimizer has "
                             f"{len(mine['shards'])}: the model or the data-parallel size differs. {fix}")
        for i, (a, b) in enumerate(zip(mine["shards"], theirs["shards"])):
            for key in a:
                if a[key] != b[key]:
                    raise ValueError(f"state_dict does not match this optimizer: shard {i} {key} is {b[key]!r} in "
                                     f"the checkpoint but {a[key]!r} here. {fix}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, this optimizer has "
                             f"{len(self.param_groups)}. {fix}")
