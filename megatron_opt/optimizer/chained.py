"""ChainedOptimizer: dense and expert-parallel DistributedOptimizers stepped as one.

The chain's one StepDriver drives every child's leaf: their local stats go into one vector,
reduced with one all-reduce over a group that covers every rank holding any shard (the world by
default), so there is one global norm, one clip coefficient, one skip decision and one loss-scaler
update (docs/contract.md rules 2-3). A child cannot be stepped behind the chain's back.

With ``overlap_param_gather_with_optimizer_step`` the first child's param all-gather is dispatched
(asynchronously) as soon as its update is applied on every rank, before the other children update.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..distributed.shard_view import chain_stats_groups
from .distrib_optimizer import DistributedOptimizer
from .megatron_optimizer import MegatronOptimizer
from .leaf import OptimizerLeaf
from .state.view import LeafView
from .step.driver import StepDriver


class ChainedOptimizer(MegatronOptimizer):
    def __init__(
        self,
        chained_optimizers: Sequence[DistributedOptimizer],
        grad_stats_group: Optional[torch.distributed.ProcessGroup] = None,
        early_children: Optional[int] = None,
    ) -> None:
        """``early_children``: with overlap_param_gather_with_optimizer_step, how many leading children
        hold the first model chunk's dense params (default 1; 2 for Muon: its Muon and AdamW children
        split that chunk's buffers and share its all-gather)."""
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one child optimizer.")
        if any(c.chained_into is not None for c in chained_optimizers):
            raise ValueError("an optimizer can belong to one ChainedOptimizer only.")
        scalers = {id(c.grad_scaler) for c in chained_optimizers}
        if len(scalers) != 1:
            raise ValueError("all children of a ChainedOptimizer must share one grad scaler (or all have none): "
                             "separate scalers would unscale children with different factors.")
        configs = {(c.config.clip_grad, c.config.log_num_zeros_in_grad, c.config.grad_norm_skip_threshold)
                   for c in chained_optimizers}
        if len(configs) != 1:
            raise ValueError("children of a ChainedOptimizer must agree on clip_grad, log_num_zeros_in_grad "
                             "and grad_norm_skip_threshold (they share one norm and one decision).")
        self.chained_optimizers = list(chained_optimizers)
        self.config = self.chained_optimizers[0].config
        self.grad_stats_group = grad_stats_group
        device = self.chained_optimizers[0].leaf.step.device
        scaler = self.chained_optimizers[0].grad_scaler
        # Megatron-LM's overlap_param_gather_with_optimizer_step: the first child(ren) (the first model
        # chunk's dense params) all-gather its params while the other children update theirs.
        early = (early_children or 1) if self.config.overlap_param_gather_with_optimizer_step else 0
        self._driver = StepDriver(self._leaves(), self.config, scaler, chain_stats_groups(grad_stats_group), device,
                                  early_param_sync=early)
        for child in self.chained_optimizers:
            child.join_chain(self)

    def _leaves(self) -> list[OptimizerLeaf]:
        return [c.leaf for c in self.chained_optimizers]

    # ----------------------------------------------------------------- the state view (checkpoints, state_dict)
    def state_leaves(self) -> list[LeafView]:
        """The children's leaves, in chain order (state_dict() and checkpoints cover the whole chain)."""
        return [leaf for c in self.chained_optimizers for leaf in c.state_leaves()]

    def _state_dict_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self._driver.stats_groups[0]
