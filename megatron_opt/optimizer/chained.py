"""ChainedOptimizer: dense and expert-parallel DistributedOptimizers stepped as one.

The children's local stats go into one vector, reduced with one all-reduce over a group that
covers every rank holding any shard (the world by default), so there is one global norm, one
clip coefficient and one skip decision, and one loss scaler updated once (CONTRACT rules 2-3).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .distrib_optimizer import DistributedOptimizer
from .step_machine import StepMachine


class ChainedOptimizer(StepMachine):
    def __init__(
        self,
        chained_optimizers: Sequence[DistributedOptimizer],
        grad_stats_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one child optimizer.")
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
        self.grad_scaler = self.chained_optimizers[0].grad_scaler
        self.grad_stats_group = grad_stats_group
        self._init_step_machine(self.chained_optimizers[0]._one.device)

    def _children(self) -> list[DistributedOptimizer]:
        return self.chained_optimizers

    def _stats_groups(self) -> list:
        return [self.grad_stats_group]

    @property
    def model_chunks(self) -> list:
        return self._model_chunks()

    @property
    def param_groups(self) -> list[dict]:
        return [g for c in self.chained_optimizers for g in c.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for c in self.chained_optimizers for k, v in c.state.items()}

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for c in self.chained_optimizers for p in c.get_parameters()]

    def reload_model_params(self) -> None:
        for c in self.chained_optimizers:
            c.reload_model_params()

    def state_dict(self) -> dict:
        return {"chained": [c.state_dict() for c in self.chained_optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("chained") if isinstance(state_dict, dict) else None
        if saved is None or len(saved) != len(self.chained_optimizers):
            raise ValueError(f"ChainedOptimizer.load_state_dict: expected {len(self.chained_optimizers)} child "
                             f"state dicts under 'chained'. Load a checkpoint saved by the same model setup.")
        for c, sd in zip(self.chained_optimizers, saved):  # check all before changing any
            c._check_loadable(sd)
        for c, sd in zip(self.chained_optimizers, saved):
            c.load_state_dict(sd)
