"""DistributedOptimizer: Megatron-LM's ZeRO-1 optimizer, as one OptimizerLeaf driven by one StepDriver.

Rank r owns a contiguous 1/DP range of every bucket (a param may straddle ranks); the leaf keeps
the fp32 masters and update-rule state of those ranges, the StepDriver runs the step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from .. import collectives
from ..errors import InvalidConfigError
from ..distributed.shard_view import GradSource, stats_span_model_parallel, step_stats_groups
from ..config_conversion import as_optimizer_config
from .grad_scaler import MegatronGradScaler
from .megatron_optimizer import MegatronOptimizer
from .leaf import OptimizerLeaf
from .state.shard_store import ShardStore
from .state.in_memory import STATE_DICT_FORMAT
from .state.view import LeafView, leaf_view
from .step.driver import StepDriver
from .rules.base import Needs, UpdateRule
from .rules.registry import resolve_update_rule
from .whole_tensor.leaf import WholeTensorLeaf


class DistributedOptimizer(MegatronOptimizer):
    """ZeRO-1 optimizer over the grad buffers of one or more DistributedDataParallel chunks.

    Args:
        config: OptimizerConfig (or megatron-core's); its ``optimizer`` names the update rule, any name of
            rules/registry.py's UPDATE_RULES ('adam' = AdamW, 'lion', 'sgd', 'muon' / 'dist_muon'), checked
            against the rule here; Muon needs whole tensors and runs only with ``selects`` (as
            get_megatron_optimizer builds it, with its AdamW companion).
        model_chunks: DistributedDataParallel modules (any shard_view.GradSource) whose buffers this
            optimizer owns.
        param_groups: torch-style groups of *model* params with optional 'wd_mult', 'lr_mult',
            'max_lr', 'min_lr', 'lr', 'weight_decay'. Default: one group with every param.
        grad_scaler: a MegatronGradScaler, or None (bf16 / fp32: non-finite steps still skip).
        expert_parallel: own the expert-parallel buffers (params with allreduce=False) instead of
            the dense ones.
        model_parallel_group: ranks whose shards hold *different* params (TP/PP); the grad stats
            are summed over it too (not needed, and not used, when the chunks were wrapped with
            model-parallel groups: their statistics already sum over every rank).
        tensor_parallel_group: gives the TP rank; params without ``tensor_model_parallel`` count in
            the norm on TP rank 0 only (they are duplicates elsewhere).
        update_rule: overrides the rule the config names (e.g. a custom UpdateRule subclass).
        selects: the params this optimizer owns (None: every param of the chunks' buffers of its
            kind); get_megatron_optimizer splits Muon's matrices from the rest this way. A rule that
            needs whole tensors (Muon) is only accepted with ``selects`` (its companion owns the rest).
    """

    def __init__(
        self,
        config: Any,
        model_chunks: Sequence[GradSource],
        param_groups: Optional[list[dict]] = None,
        grad_scaler: Optional[MegatronGradScaler] = None,
        expert_parallel: bool = False,
        model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        update_rule: Optional[UpdateRule] = None,
        selects: Optional[Callable[[torch.nn.Parameter], bool]] = None,
    ) -> None:
        if not model_chunks:
            raise ValueError("DistributedOptimizer needs at least one DistributedDataParallel model chunk.")
        for chunk in model_chunks:
            if not isinstance(chunk, GradSource):
                raise TypeError(f"model chunks must be megatron_opt.DistributedDataParallel, "
                                f"got {type(chunk).__name__}.")
        config = as_optimizer_config(config)
        self.config = config
        self.is_expert_parallel = expert_parallel
        self.model_parallel_group = model_parallel_group
        rule = resolve_update_rule(config, update_rule, whole_tensors=selects is not None)
        store = ShardStore(
            model_chunks, rule, param_groups,
            default_lr=config.lr, default_weight_decay=config.weight_decay, expert_parallel=expert_parallel,
            tensor_parallel_group=tensor_parallel_group,
            main_params_dtype=config.main_params_dtype,  # fp32 unless use_precision_aware_optimizer (config checks)
            param_remainders=config.uses_param_remainders,
            selects=selects,
        )
        whole = rule.needs is Needs.WHOLE_TENSORS
        # The one leaf: masters, rule state and the calls the driver makes.
        self.leaf = WholeTensorLeaf(store) if whole else OptimizerLeaf(store)
        # Which groups sum the statistics: decided by the shard view from the shards' roles.
        self._driver = StepDriver([self.leaf], config, grad_scaler,
                                  step_stats_groups(self.leaf.stats_roles(), model_parallel_group),
                                  self.leaf.step.device)
        # Over the data-parallel replicas only: model-parallel peers hold other params, so other groups.
        collectives.agree(
            "DistributedOptimizer", _overlap_with_step_error(config, model_chunks), self.leaf.replica_group(),
            fingerprint=self._fingerprint(), error_type=InvalidConfigError,
            fix="Every data-parallel rank must build the optimizer with the same OptimizerConfig, update rule, "
                "param groups and loss scaler.")

    def _fingerprint(self) -> list:
        items: list = [(f"config.{f.name}", repr(getattr(self.config, f.name)))
                       for f in dataclasses.fields(self.config) if f.name != "timers"]
        items.append(("update rule", (self.update_rule.name, repr(self.update_rule.hyperparameters()))))
        items.append(("loss scaler", type(self.grad_scaler).__name__))
        items += [(f"param group {i}", repr(sorted((k, v) for k, v in g.items() if k != "params")))
                  for i, g in enumerate(self.param_groups)]
        return items

    def _leaves(self) -> list[OptimizerLeaf]:
        return [self.leaf]

    @property
    def update_rule(self) -> UpdateRule:
        return self.leaf.rule

    @property
    def step_count(self) -> int:
        """Updates applied so far (skipped steps excluded)."""
        return int(self.leaf.step.item())

    # ----------------------------------------------------------------- the state view (checkpoints, state_dict)
    def state_leaves(self) -> list[LeafView]:
        model_parallel = stats_span_model_parallel(self.leaf.stats_roles(), self.model_parallel_group)
        return [leaf_view(self.leaf, self.model_chunks, model_parallel=model_parallel)]

    def _state_dict_group(self) -> Optional[torch.distributed.ProcessGroup]:
        # The data-parallel group: its ranks end a load in one param all-gather.
        groups = step_stats_groups(self.leaf.stats_roles())
        return groups[0] if groups else None


def _overlap_with_step_error(config: Any, model_chunks: Sequence[GradSource]) -> Optional[str]:
    """overlap_param_gather_with_optimizer_step dispatches async all-gathers that the forward
    pre-hooks wait for, so (as in Megatron-LM) the chunks must be wrapped with overlap_param_gather."""
    if not config.overlap_param_gather_with_optimizer_step:
        return None
    if all(chunk.param_gather.overlap_param_gather for chunk in model_chunks):
        return None
    return ("OptimizerConfig.overlap_param_gather_with_optimizer_step=True needs every model chunk wrapped with "
            "DistributedDataParallelConfig(overlap_param_gather=True) (its forward pre-hooks wait for the "
            "all-gathers the step dispatches); set overlap_param_gather=True, or turn "
            "overlap_param_gather_with_optimizer_step off.")


__all__ = ["DistributedOptimizer", "STATE_DICT_FORMAT"]
