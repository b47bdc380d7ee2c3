"""ShardGroup: the leaf of the optimizer: masters and update-rule state for a set of published shards.

For each ``LocalShard`` (this rank's range of one bucket) it keeps:
  * ``master``: fp32. A detached fp32 clone for bf16/fp16 params; for fp32 params a detached view
    of the param buffer, so the update lands in the model param with no copy;
  * the update rule's state tensors (AdamW's moments, SGD's momentum, Lion's exp_avg), owned
    elements only;
  * a PieceTable: where each param piece lies, whether it counts in the norm, its param group.
Shards that share a grad source, pre-scale and dtypes form one launch group with one ``StepPlan``
(built once), so each pass is one call per group, not one per bucket; the per-group lr and weight
decay live in a device table (``DeviceHyperparams``) updated in place.
Every tensor in ``param_groups`` is a leaf view of a master (docs/contract.md rule 6).

The step driver calls the leaf protocol (``accumulate_local_stats``, ``apply_update``,
``start_param_sync``); the leaf never decides anything on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from .. import collectives, ops
from ..distributed.shard_view import GradSource, LocalShard, assemble_full_tensors
from ..ops import precision
from ..ops.piece_table import PieceTable
from .update_rules import UpdateRule

_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "allreduce",
                   "sequence_parallel", "grad_norm_group")


@dataclass
class ShardState:
    """The optimizer's side of one LocalShard."""

    shard: LocalShard
    source: GradSource
    table: PieceTable
    master: torch.Tensor
    param_out: Optional[torch.Tensor]  # None when master aliases the fp32 param buffer
    state: dict[str, torch.Tensor]
    main_params: tuple[torch.Tensor, ...]  # per piece: the leaf view of master in param_groups


@dataclass(frozen=True)
class LaunchGroup:
    """Shards that pass 1 and pass 2 cover in one call each."""

    plan: ops.StepPlan
    scale_key: tuple  # (id(source), grad_prescale): selects the inverse grad scale
    counts_stats: bool  # False on DP ranks > 0 when the grads are not sharded (see _counts_stats)


@dataclass(frozen=True)
class PieceState:
    """One owned param piece with its optimizer state: views over the piece's elements.

    ``tensors['master']`` is the master's storage (fp32, fp16, or an int16 remainder of the bf16
    param); ``values`` / ``write`` read and store masters as fp32 values whatever the storage, and
    the update rule's state in its own dtype (``write`` converts)."""

    source: GradSource
    name: str
    param: torch.nn.Parameter
    param_start: int  # where the piece starts in the flattened param
    tensors: dict[str, torch.Tensor]  # 'master' and the update rule's state, 1-D views
    param_view: Optional[torch.Tensor] = None  # the piece of the model-dtype param shard (16-bit params)

    def value_dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name == "master" else self.tensors[name].dtype

    def values(self, name: str) -> torch.Tensor:
        if name == "master":
            return precision.load_master(self.tensors[name], self.param_view)
        return self.tensors[name]

    def write(self, name: str, values: torch.Tensor) -> None:
        target = self.tensors[name]
        if name == "master" and target.dtype != torch.float32:
            precision.store_master(values.to(device=target.device, dtype=torch.float32), target, self.param_view)
        else:
            target.copy_(values)


def _tp_rank(group: Optional[torch.distributed.ProcessGroup]) -> int:
    return collectives.rank(group) if group is not None else 0


def counts_in_norm(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """Shared params count once; tensor-parallel duplicates count on TP rank 0 only."""
    if getattr(p, "shared", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


class ShardGroup:
    """Masters and state for the dense (or expert-parallel) shards of some model chunks."""

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
    ) -> None:
        self.sources = list(sources)
        self.rule = rule
        self.main_params_dtype = main_params_dtype
        self.param_remainders = param_remainders
        self.is_expert_parallel = expert_parallel
        self._shards_in = [(src, s) for src in self.sources for s in src.local_shards(expert_parallel)]
        device = self._shards_in[0][1].grad.device if self._shards_in else torch.device("cpu")
        self.backend = ops.resolve_backend(torch.empty(0, device=device))
        self.step = torch.zeros(1, dtype=torch.int64, device=device)  # updates applied so far
        self.param_groups = self._build_param_groups(param_groups, default_lr, default_weight_decay)
        self.shards = self._build_shards(_tp_rank(tensor_parallel_group))
        self.launch_groups = self._build_launch_groups()
        self._hyperparams = ops.DeviceHyperparams(len(self.param_groups), device)
        self._inv_scale: dict[tuple, torch.Tensor] = {}

    # ----------------------------------------------------------------- construction
    def _managed(self) -> dict[int, tuple[str, torch.nn.Parameter]]:
        return {id(p): (s.names[i], p) for _, s in self._shards_in for i, p in s.params.items()}

    def _build_param_groups(self, groups: Optional[list[dict]], lr: float, weight_decay: float) -> list[dict]:
        managed = self._managed()
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
                    raise ValueError(f"a param (shape {tuple(p.shape)}) appears in param groups {self._group_of[id(p)]} and {gi}.")
                self._group_of[id(p)] = gi
            options = {k: v for k, v in group.items() if k != "params"}
            options.setdefault("lr", lr)
            options.setdefault("weight_decay", weight_decay * options.get("wd_mult", 1.0))
            out.append({"params": [], **options})
        missing = [name for pid, (name, _) in managed.items() if pid not in self._group_of]
        if missing:
            raise ValueError(f"params missing from every param group: {missing[:5]}; give every trainable param a group.")
        return out

    def _build_shards(self, tp_rank: int) -> list[ShardState]:
        shards = []
        for source, shard in self._shards_in:
            if not shard.pieces:
                continue
            params = [shard.params[pc.param_index] for pc in shard.pieces]
            table = PieceTable(
                starts=tuple(pc.shard_range.start for pc in shard.pieces),
                ends=tuple(pc.shard_range.end for pc in shard.pieces),
                in_norm=tuple(counts_in_norm(p, tp_rank) for p in params),
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
            shards.append(ShardState(shard, source, table, master, param_out, self.rule.init_state(master),
                                     tuple(mains)))
        owned = {id(s.shard.params[pc.param_index]) for s in shards for pc in s.shard.pieces}
        for _, p in self._managed().values():
            if id(p) not in owned:
                p.main_param, p.main_param_sharded = None, True
        return shards

    def _new_master(self, param: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(master, param_out) for a param shard. fp32 params: the param itself (updates land in the
        model). bf16 params with remainders: an int16 remainder, zero since the param is exactly the
        master at first. Otherwise a copy in main_params_dtype (fp32, or fp16)."""
        if param.dtype == torch.float32:
            return param.detach(), None
        if self.param_remainders and param.dtype == torch.bfloat16:
            return torch.zeros(param.shape, dtype=torch.int16, device=param.device), param
        return param.detach().to(self.main_params_dtype, copy=True), param

    def _master_values(self, s: ShardState) -> torch.Tensor:
        """The shard's masters as fp32 values (a view for fp32 masters, else a new tensor)."""
        return precision.load_master(s.master, s.param_out)

    def _build_launch_groups(self) -> list[LaunchGroup]:
        members: dict[tuple, list[ShardState]] = {}
        for s in self.shards:
            key = (id(s.source), s.shard.grad_prescale, s.shard.grad.dtype,
                   None if s.param_out is None else s.param_out.dtype, self._counts_stats(s.shard), s.master.dtype)
            members.setdefault(key, []).append(s)
        names = list(self.rule.state_dtypes())
        return [
            LaunchGroup(ops.StepPlan(tuple(ops.ShardOperands(s.table, s.shard.grad, s.master,
                                                             tuple(s.state[n] for n in names), s.param_out)
                                           for s in group)),
                        scale_key=key[:2], counts_stats=key[4])
            for key, group in members.items()
        ]

    # ----------------------------------------------------------------- the leaf protocol (StepDriver calls these)
    def stats_groups(self) -> list[Optional[torch.distributed.ProcessGroup]]:
        """The data-parallel group the statistics are summed over ([] for one rank; [None] is the
        default group). Without sharding every rank holds the same all-reduced gradients, so only
        rank 0 of the group counts them (see _counts_stats) and the sum is still one copy; the
        reduction then also makes a missing backward on one rank known to all."""
        for _, shard in self._shards_in:
            # Partial sharding: a shard group is one instance; the decision must cover every
            # data-parallel rank (only instance 0 counts gradient elements, see _counts_stats).
            group = shard.data_parallel_group if shard.instance_count > 1 else shard.group
            if collectives.world_size(group) > 1:
                return [group]
        return []

    @staticmethod
    def _counts_stats(shard: LocalShard) -> bool:
        """Whether this rank's shard adds to the gradient statistics: every element counts once over
        the group they are summed over (only instance 0 with partial sharding; only rank 0 when the
        grads are all-reduced rather than sharded)."""
        if shard.instance_rank != 0:
            return False
        return shard.sharded or collectives.rank(shard.group) == 0

    def has_shards(self) -> bool:
        return bool(self._shards_in)

    def accumulate_local_stats(self, stats: torch.Tensor, loss_scale: torch.Tensor, count_zeros: bool) -> None:
        """Pass 1 over every owned shard, one call per launch group: stats += [non-finite, sum of squares, zeros]."""
        self._inv_scale = {}
        for s in self.shards:
            key = (id(s.source), s.shard.grad_prescale)
            if key not in self._inv_scale:
                inv = s.source.grad_scale_factor / loss_scale
                self._inv_scale[key] = inv if s.shard.grad_prescale == 1.0 else inv / s.shard.grad_prescale
        for lg in self.launch_groups:
            if lg.counts_stats:
                ops.grad_stats_planned(lg.plan, self._inv_scale[lg.scale_key], stats[: ops.NUM_STATS], count_zeros,
                                       backend=self.backend)

    def stage_hyperparams(self) -> torch.Tensor:
        """Copy the param_groups' lr and weight decay into the device table (only when one changed)."""
        return self._hyperparams.update([g["lr"] for g in self.param_groups],
                                        [g["weight_decay"] for g in self.param_groups])

    def apply_update(self, clip_coef: Union[float, torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None:
        """Pass 2 over every owned shard with the current param_groups' lr and weight decay. A device
        ``clip_coef`` and ``found_inf`` (a step decided on the device) keep the step free of host syncs."""
        ops.advance_step(self.step, found_inf, backend=self.backend)  # also on ranks that own nothing
        if not self.launch_groups:
            return
        lr_wd = self.stage_hyperparams()
        for lg in self.launch_groups:
            inv = self._inv_scale[lg.scale_key]
            if isinstance(clip_coef, torch.Tensor):  # fp32 inv * fp32 clip: the same rounding as the kernels'
                grad_scale, coef = inv * clip_coef, 1.0
            else:
                grad_scale, coef = inv, clip_coef
            self.rule.apply(lg.plan, lr_wd=lr_wd, grad_scale=grad_scale, clip_coef=coef, step=self.step,
                            backend=self.backend, found_inf=found_inf)

    def start_param_sync(self, force_sync: bool = False) -> None:
        for source in self.sources:
            if source.local_shards(self.is_expert_parallel):
                source.start_param_sync(force_sync=force_sync, force_dispatch=True,
                                        expert_parallel=self.is_expert_parallel)

    def finish_param_sync(self) -> None:
        for source in self.sources:
            source.finish_param_sync()

    def clear_model_grads(self, set_to_none: bool) -> None:
        for _, p in self._managed().values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ----------------------------------------------------------------- accessors
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state (views, not copies): masters, rule state and the step counter."""
        out = {"step": self.step}
        for i, s in enumerate(self.shards):
            out[f"shard{i}.master"] = s.master
            for name, t in s.state.items():
                out[f"shard{i}.{name}"] = t
        return out

    def per_param_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per main param: views of the flat optimizer state, as torch.optim exposes it."""
        out = {}
        for s in self.shards:
            for main, start, end in zip(s.main_params, s.table.starts, s.table.ends):
                entry: dict[str, Any] = {"step": self.step}
                entry.update({name: t[start:end] for name, t in s.state.items()})
                out[main] = entry
        return out

    def piece_states(self) -> list[PieceState]:
        out = []
        for s in self.shards:
            tensors = {"master": s.master, **s.state}
            for pc in s.shard.pieces:
                lo, hi = pc.shard_range.start, pc.shard_range.end
                out.append(PieceState(s.source, s.shard.names[pc.param_index], s.shard.params[pc.param_index],
                                      pc.param_range.start, {k: t[lo:hi] for k, t in tensors.items()},
                                      None if s.param_out is None else s.param_out[lo:hi]))
        return out

    def sync_params_from_masters(self) -> None:
        """Round the masters into the model params and all-gather them (after the masters were set).
        With remainders the param already is the master's high half."""
        for s in self.shards:
            if s.param_out is not None and not precision.is_remainder(s.master):
                s.param_out.copy_(s.master)
        self.start_param_sync(force_sync=True)
        self.finish_param_sync()

    def gather_main_params(self) -> dict[str, torch.Tensor]:
        """Every param's fp32 master by name, assembled from all ranks (a collective over the DP group)."""
        masters = {(id(s.source), s.shard.buffer_index, s.shard.bucket_index): self._master_values(s)
                   for s in self.shards}

        def master_of(src: GradSource, shard: LocalShard) -> torch.Tensor:
            key = (id(src), shard.buffer_index, shard.bucket_index)
            return masters.get(key, torch.zeros(shard.numel, dtype=torch.float32, device=shard.grad.device))

        out: dict[str, torch.Tensor] = {}
        for src in self.sources:
            out.update(assemble_full_tensors(src.local_shards(self.is_expert_parallel),
                                             lambda shard, src=src: master_of(src, shard)))
        return out

    def reload_model_params(self) -> None:
        """Re-copy the model params (e.g. after loading a model checkpoint) into the fp32 masters."""
        for s in self.shards:
            if precision.is_remainder(s.master):
                s.master.zero_()  # the master is exactly the bf16 param
            elif s.param_out is not None:
                s.master.copy_(s.param_out)

    # ----------------------------------------------------------------- state dict (same DP size)
    def fingerprint(self) -> dict:
        return {
            "optimizer": self.rule.name,
            "shards": [
                {
                    "param_dtype": str(s.shard.param.dtype),
                    "grad_dtype": str(s.shard.grad.dtype),
                    "bucket_params": [tuple(p.shape) for p in s.shard.params.values()],
                    "shard_count": s.shard.shard_count,
                    "rank": s.shard.rank,
                    "numel": s.table.numel,
                }
                for s in self.shards
            ],
        }

    def state_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint(),
            "update_rule": {"name": self.rule.name, "hyperparameters": self.rule.hyperparameters()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "step": int(self.step.item()),
            # Masters as fp32 values and state in its own dtype: a load converts into whatever this
            # optimizer keeps (fp32 <-> 16-bit moments, remainders).
            "shards": [{"master": self._master_values(s).detach().cpu().clone(),
                        **{k: v.detach().cpu().clone() for k, v in s.state.items()}} for s in self.shards],
        }

    def check_loadable(self, state_dict: dict, fix: str) -> None:
        mine, theirs = self.fingerprint(), state_dict["fingerprint"]
        if mine["optimizer"] != theirs["optimizer"]:
            raise ValueError(f"state_dict is for optimizer '{theirs['optimizer']}', this one is "
                             f"'{mine['optimizer']}'. {fix}")
        counts = {s["shard_count"] for s in mine["shards"]}, {s["shard_count"] for s in theirs["shards"]}
        if counts[0] and counts[1] and counts[0] != counts[1]:
            raise ValueError(f"state_dict was saved with the optimizer sharded over {sorted(counts[1])} ranks, this one "
                             f"is sharded over {sorted(counts[0])}: a state_dict holds one rank's shard and cannot "
                             f"change data-parallel size. Use megatron_opt.checkpoint.save/load, which store the "
                             f"state per parameter and reshard.")
        if len(mine["shards"]) != len(theirs["shards"]):
            raise ValueError(f"state_dict has {len(theirs['shards'])} shards on this rank, this optimizer has "
                             f"{len(mine['shards'])}: the model or the data-parallel size differs. {fix}")
        for i, (a, b) in enumerate(zip(mine["shards"], theirs["shards"])):
            for key in a:
                if a[key] != b[key]:
                    raise ValueError(f"state_dict does not match this optimizer: shard {i} {key} is {b[key]!r} in "
                                     f"the checkpoint but {a[key]!r} here. {fix}")
        for i, saved in enumerate(state_dict["shards"]):
            for name, t in saved.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    raise ValueError(f"state_dict shard {i} '{name}' holds non-finite values; refusing to load it "
                                     f"(the next step would write NaN into the params). {fix}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, this optimizer has "
                             f"{len(self.param_groups)}. {fix}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the state (checked first by check_loadable); the caller then syncs params."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.step.fill_(int(state_dict["step"]))
        for s, saved in zip(self.shards, state_dict["shards"]):
            master = saved["master"].to(device=s.shard.grad.device, dtype=torch.float32)
            for name, t in s.state.items():
                t.copy_(saved[name])  # converts fp32 <-> 16-bit
            if s.master.dtype == torch.float32:
                s.master.copy_(master)
                if s.param_out is not None:
                    s.param_out.copy_(master)
            else:
                precision.store_master(master, s.master, s.param_out)


__all__ = ["ShardGroup", "ShardState", "LaunchGroup", "PieceState", "counts_in_norm"]
