"""OptimizerLeaf: one ShardStore and the calls the step driver makes on it.

Shards that share an unscale factor, dtypes and stats role form one ``LaunchPlan`` with one
``StepPlan`` (built once), so each pass is one call per plan, not one per bucket; the per-group lr
and weight decay live in a device table (``DeviceHyperparams``) updated in place, handed to the rule with
its host values (``ops.LrWdTable``).

The driver calls the leaf protocol (``accumulate_local_stats``, ``stage_hyperparams``,
``apply_update``, ``start_param_sync``, ``clear_model_grads``); the leaf never decides anything on
its own. Checkpoints and Megatron-LM's API read and write the state through the accessors below
(``piece_states``, ``state_tensors``, ...), which state/piece_state.py implements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import ops
from ..distributed.shard_view import GradSource, LocalShard, StatsRole
from .state import piece_state
from .step.grad_multiplier import GradMultiplier
from .state.shard_store import OwnedShard, ShardStore
from .state.piece_state import PieceState
from .rules.base import UpdateRule


@dataclass(frozen=True)
class LaunchPlan:
    """Shards that pass 1 and pass 2 cover in one call each."""

    step_plan: ops.StepPlan
    multiplier: GradMultiplier  # of the shards' one resolved unscale factor (distributed/ keeps it current)
    counts_stats: bool  # the shards' stats role: False where another rank counts these elements


class OptimizerLeaf:
    """The step's side of one ShardStore (the dense or the expert-parallel shards of some model
    chunks): its launch plans, the calls the driver makes, and the accessors of its state."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        # What the store holds, as the driver and the state view read it (the same objects, never copies).
        self.sources: list[GradSource] = store.sources
        self.rule: UpdateRule = store.rule
        self.param_groups: list[dict] = store.param_groups
        self.step: torch.Tensor = store.step  # updates applied so far (an int64 device tensor)
        self.is_expert_parallel: bool = store.is_expert_parallel
        self.selects = store.selects  # which params of its chunks it keeps (None: all of its kind)
        self.backend = ops.resolve_backend(torch.empty(0, device=store.device))
        self.multipliers: list[GradMultiplier] = []  # one per distinct unscale factor, shared by launch plans
        self.launch_plans = self._build_launch_plans()
        self._hyperparams = ops.DeviceHyperparams(len(self.param_groups), store.device)

    def _build_launch_plans(self) -> list[LaunchPlan]:
        members: dict[tuple, list] = {}
        for s in self.store.shards:
            key = (id(s.shard.unscale_factor), s.shard.grad.dtype, None if s.param_out is None else s.param_out.dtype,
                   s.shard.stats_role.counts, s.master.dtype)
            members.setdefault(key, []).append(s)
        names = list(self.rule.state_dtypes())
        by_factor: dict[int, GradMultiplier] = {}
        for group in members.values():
            factor = group[0].shard.unscale_factor
            if id(factor) not in by_factor:
                by_factor[id(factor)] = GradMultiplier(factor)
                self.multipliers.append(by_factor[id(factor)])
        return [
            LaunchPlan(ops.StepPlan(tuple(ops.ShardOperands(s.table, s.shard.grad, s.master,
                                                            tuple(s.state[n] for n in names), s.param_out)
                                          for s in group)),
                       multiplier=by_factor[id(group[0].shard.unscale_factor)],
                       counts_stats=group[0].shard.stats_role.counts)
            for group in members.values()
        ]

    # ----------------------------------------------------------------- declared views (the optimizer, verify mode)
    def stats_roles(self) -> list[StatsRole]:
        """The stats role of every published shard (shard_view.step_stats_groups decides the groups from them)."""
        return [shard.stats_role for _, shard in self.store.published]

    def published_shards(self) -> list[LocalShard]:
        """Every shard the chunks published for this leaf, also those holding no piece on this rank."""
        return [shard for _, shard in self.store.published]

    def owned_shards(self) -> list[OwnedShard]:
        """The optimizer's side of every shard holding pieces on this rank: masters, rule state, pieces."""
        return list(self.store.shards)

    def replica_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The ranks holding replicas of these params (the data-parallel group; None: the default
        group): the ones that must have built this optimizer the same way."""
        for _, shard in self.store.published:
            return shard.data_parallel_group if shard.data_parallel_group is not None else shard.group
        return None

    # ----------------------------------------------------------------- the leaf protocol (StepDriver calls these)
    def accumulate_local_stats(self, stats: torch.Tensor, loss_scale: torch.Tensor, count_zeros: bool) -> None:
        """Pass 1 over every owned shard, one call per launch plan: stats += [non-finite, sum of squares, zeros]."""
        for multiplier in self.multipliers:
            multiplier.stage(loss_scale)
        for lp in self.launch_plans:
            if lp.counts_stats:
                ops.grad_stats(lp.step_plan, lp.multiplier.inv_scale, stats[: ops.NUM_STATS], count_zeros,
                               backend=self.backend)

    def stage_hyperparams(self) -> ops.LrWdTable:
        """Copy the param_groups' lr and weight decay into the device table (only when one changed): the
        table with its host values."""
        return self._hyperparams.update([g["lr"] for g in self.param_groups],
                                        [g["weight_decay"] for g in self.param_groups])

    def apply_update(self, clip_coef: Optional[torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None:
        """Pass 2 over every owned shard with the current param_groups' lr and weight decay; the grads
        are multiplied by this step's 1/loss scale, unscale factor and (if given) the fp32 device
        ``clip_coef``. A device ``found_inf`` (a step decided on the device) writes nothing when set."""
        ops.advance_step(self.step, found_inf, backend=self.backend)  # also on ranks that own nothing
        if not self.launch_plans:
            return
        lr_wd = self.stage_hyperparams()
        for multiplier in self.multipliers:
            multiplier.fold_clip(clip_coef)
        for lp in self.launch_plans:
            self.rule.apply(lp.step_plan, lr_wd=lr_wd, grad_scale=lp.multiplier.update_scale, step=self.step,
                            backend=self.backend, found_inf=found_inf)

    def start_param_sync(self, force_sync: bool = False) -> None:
        """The step's all-gather of this leaf's params: ``force_dispatch=True`` says the caller is the step,
        which dispatches whatever the chunk's ParamGather says a plain call would do."""
        for source in self.sources:
            if source.local_shards(self.is_expert_parallel):
                source.start_param_sync(force_sync=force_sync, force_dispatch=True,
                                        expert_parallel=self.is_expert_parallel)

    def finish_param_sync(self) -> None:
        for source in self.sources:
            source.finish_param_sync()

    def clear_model_grads(self, set_to_none: bool) -> None:
        for _, p in self.store.managed_params().values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ----------------------------------------------------------------- state access (checkpoints, torch.optim's API)
    def piece_states(self) -> list[PieceState]:
        return piece_state.piece_states(self.store)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return piece_state.state_tensors(self.store)

    def state_bytes(self) -> list[tuple[GradSource, str, str, int]]:
        return piece_state.state_bytes(self.store)

    def per_param_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return piece_state.per_param_state(self.store)

    def gather_main_params(self) -> dict[str, torch.Tensor]:
        return piece_state.gather_main_params(self.store)

    def reload_model_params(self) -> None:
        piece_state.reload_model_params(self.store)

    def sync_params_from_masters(self) -> None:
        """Round the masters into the model params and all-gather them (after the masters were set)."""
        piece_state.round_masters_into_params(self.store)
        self.start_param_sync(force_sync=True)
        self.finish_param_sync()


__all__ = ["OptimizerLeaf", "LaunchPlan"]
