"""MegatronOptimizer: Megatron-LM's optimizer interface, as a thin face over a StepDriver and its leaves.

DistributedOptimizer and ChainedOptimizer are both this face. Once a DistributedOptimizer is put
into a ChainedOptimizer, its driver is the chain's: reading it (step_state, skipped_steps, the loss
scale) shows the chain's values, and stepping it on its own raises StepOrderError.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import collectives
from ..errors import StepOrderError, UnsupportedConfigError
from .state import in_memory as in_memory_state
from .grad_scaler import MegatronGradScaler
from .leaf import OptimizerLeaf
from .state.piece_state import GAPS, PieceState
from .step.driver import SkipReason, StepDriver, StepState
from .verify.step_verifier import VerifyReport
from .state.view import LeafView, param_key


class MegatronOptimizer:
    config: Any
    _driver: StepDriver
    _chained_into: Optional["MegatronOptimizer"] = None

    # ----------------------------------------------------------------- for subclasses
    def _leaves(self) -> list[OptimizerLeaf]:
        raise NotImplementedError

    def join_chain(self, chain: "MegatronOptimizer") -> None:
        """Hand this optimizer's step to ``chain`` (ChainedOptimizer calls this once per child)."""
        if self._chained_into is not None:
            raise ValueError("an optimizer can belong to one ChainedOptimizer only.")
        self._driver, self._chained_into = chain.step_driver, chain

    @property
    def chained_into(self) -> Optional["MegatronOptimizer"]:
        """The ChainedOptimizer that steps this one, or None."""
        return self._chained_into

    @property
    def step_driver(self) -> StepDriver:
        """The StepDriver that steps this optimizer's leaves (a chained child's is the chain's)."""
        return self._driver

    def _stepping_driver(self, what: str) -> StepDriver:
        if self._chained_into is not None:
            raise StepOrderError(
                f"{type(self).__name__}.{what} was called on a child of a ChainedOptimizer; the chain owns the "
                f"step (one norm, one skip decision, one loss-scaler update): call the ChainedOptimizer's {what}."
            )
        return self._driver

    # ----------------------------------------------------------------- the step (Megatron-LM's split API)
    def prepare_grads(self) -> bool:
        """Pass 1 and the global decision. Returns found_inf (True: this step must be skipped)."""
        return self._stepping_driver("prepare_grads()").prepare_grads()

    def get_grad_norm(self) -> float:
        """The unscaled global gradient norm, before clipping, identical on every rank."""
        return self._stepping_driver("get_grad_norm()").get_grad_norm()

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip by the global norm. No pass over the grads: the coefficient rides in pass 2's scalar."""
        return self._stepping_driver("clip_grad_norm()").clip_grad_norm(clip_grad)

    def count_zeros(self) -> Optional[int]:
        """Zero gradient elements over all ranks; None unless config.log_num_zeros_in_grad."""
        return self._stepping_driver("count_zeros()").count_zeros()

    def step_with_ready_grads(self) -> bool:
        """Pass 2 on every leaf and the param all-gather; False (and no change) when the step skips."""
        return self._stepping_driver("step_with_ready_grads()").step_with_ready_grads()

    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """Run the whole update once. Returns (success, grad_norm, num_zeros); (False, None, None) on a skip."""
        return self._stepping_driver("step()").step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model-param .grad (the DDP buffer is zeroed by zero_grad_buffer()) and start a new step."""
        self._stepping_driver("zero_grad()").zero_grad(set_to_none)

    # ----------------------------------------------------------------- read-only state of the step
    @property
    def grad_scaler(self) -> Optional[MegatronGradScaler]:
        """The one loss scaler of the step (a chain's children report the chain's)."""
        return self._driver.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Optional[MegatronGradScaler]) -> None:
        self._driver.grad_scaler = scaler

    def get_loss_scale(self) -> torch.Tensor:
        return self._driver.get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale().to(loss.dtype)

    @property
    def step_state(self) -> StepState:
        return self._driver.state

    @property
    def skipped_steps(self) -> int:
        return self._driver.skipped_steps

    @property
    def last_skip_reason(self) -> Optional[SkipReason]:
        return self._driver.last_skip_reason

    @property
    def verify_report(self) -> Optional[VerifyReport]:
        """Verify mode (OptimizerConfig.verify_interval): the step() calls so far, the one verified last
        (``last_verified_step``, counted from 1) and its findings; None when verify mode is off. A
        chained child reports the chain's."""
        return self._driver.verify_report

    @property
    def model_chunks(self) -> list:
        return list(self._driver.sources)

    # ----------------------------------------------------------------- params and state
    @property
    def param_groups(self) -> list[dict]:
        return [g for leaf in self._leaves() for g in leaf.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per main param: views of the flat optimizer state, as torch.optim exposes it."""
        return {k: v for leaf in self._leaves() for k, v in leaf.per_param_state().items()}

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def local_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state tensors by name (views: masters, update-rule state, step counters)."""
        leaves = self._leaves()
        return {f"{i}.{k}" if len(leaves) > 1 else k: v
                for i, leaf in enumerate(leaves) for k, v in leaf.state_tensors().items()}

    def state_memory(self) -> dict[str, dict[str, int]]:
        """This rank's optimizer memory: {state name ('master', 'exp_avg', 'momentum_buffer', ...):
        {param key (as in state_dict() and checkpoints): bytes}}, plus the key piece_state.GAPS for
        allocated elements that no param covers. Masters that are the fp32 params themselves count 0."""
        chunks = self.model_chunks
        out: dict[str, dict[str, int]] = {}
        for leaf in self._leaves():
            for source, name, state, nbytes in leaf.state_bytes():
                key = name if name == GAPS else param_key(next(i for i, c in enumerate(chunks) if c is source),
                                                          name, len(chunks))
                per_key = out.setdefault(state, {})
                per_key[key] = per_key.get(key, 0) + nbytes
        return out

    def gather_main_params(self) -> dict[str, torch.Tensor]:
        """Every trainable param's fp32 master by name, in its shape, identical on all ranks.

        A collective (like DTensor's full_tensor()): every rank of the data-parallel group must call it.
        """
        out: dict[str, torch.Tensor] = {}
        for leaf in self._leaves():
            out.update(leaf.gather_main_params())
        return out

    def piece_states(self) -> list[PieceState]:
        """This rank's owned param pieces, each with views of its master and update-rule state
        (what megatron_opt.checkpoint saves in model space and writes back on load)."""
        return [ps for leaf in self._leaves() for ps in leaf.piece_states()]

    def scalar_state(self) -> dict[str, Any]:
        """Everything but the per-element tensors: param-group hyperparameters, update counts, the
        loss scaler and the update rules (identical on every rank)."""
        leaves = self._leaves()
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "steps": [int(leaf.step.item()) for leaf in leaves],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "update_rules": [{"name": leaf.rule.name, "hyperparameters": leaf.rule.hyperparameters()} for leaf in leaves],
            "skipped_steps": self.skipped_steps,
        }

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore what scalar_state() returned (call check happens in megatron_opt.checkpoint)."""
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        for leaf, step in zip(self._leaves(), state["steps"]):
            leaf.step.fill_(int(step))
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self._driver.skipped_steps = int(state.get("skipped_steps", 0))

    def sync_params_from_masters(self) -> None:
        """After the masters were written (a checkpoint load): round them into the model params and
        all-gather. A collective."""
        for leaf in self._leaves():
            leaf.sync_params_from_masters()

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        """Re-copy the model params (e.g. after loading a model checkpoint) into the fp32 masters.

        Megatron-LM's ``state_dict`` form (masters taken from a checkpoint's model state,
        ``--load-main-params-from-ckpt``) is not supported: megatron_opt.checkpoint restores masters.
        """
        if state_dict is not None:
            raise UnsupportedConfigError(
                "reload_model_params(state_dict=...): loading fp32 masters from a model state dict is not supported; "
                "restore masters with megatron_opt.checkpoint.load (or drop --load-main-params-from-ckpt).")
        for leaf in self._leaves():
            leaf.reload_model_params()

    # ----------------------------------------------------------------- the state view (state/view.py)
    def state_leaves(self) -> list[LeafView]:
        """Each leaf as checkpoint code sees it: update rule, owned pieces tagged with their model chunk,
        param groups, update counter (the one view megatron_opt.checkpoint and state_dict() use)."""
        raise NotImplementedError

    def _state_dict_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The ranks that load a state_dict together (None: the default group)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- state_dict: in memory, per parameter
    def state_dict(self, is_loading: bool = False) -> dict:
        """This rank's optimizer state per parameter, in model space (optimizer/state/in_memory.py): the
        pieces it owns, plus hyperparameters, update counts and the loss scaler. ``is_loading``
        (megatron-core's: a template to load into) returns the same."""
        return in_memory_state.build(self)

    def check_loadable(self, state_dict: dict) -> None:
        """Raise ValueError (changing nothing) unless ``state_dict`` loads on this rank: the same model
        and update rules, no non-finite values, and the elements this rank owns present in it."""
        in_memory_state.check(self, state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict() (every rank calls it; it ends with a param all-gather). The ranks agree
        first: a state_dict refused on any rank raises the same ValueError on every rank. Also takes
        megatron-core's distributed-optimizer formats, as dist_checkpointing.load returns them for
        sharded_state_dict(..., is_loading=True) (optimizer/state/torch_dist.py)."""
        from .state import torch_dist as megatron_format

        if megatron_format.is_megatron_format(state_dict):
            megatron_format.load(self, state_dict)
            return
        collectives.raise_together(lambda: self.check_loadable(state_dict), self._state_dict_group(),
                                   f"{type(self).__name__}.load_state_dict", ValueError)
        in_memory_state.load(self, state_dict)

    # ----------------------------------------------------------------- members Megatron-LM's training loop reads
    is_stub_optimizer = False  # megatron-core's placeholder optimizer for ranks without params; never us

    def get_grad_stats_parallel_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The group the gradient statistics (norm, zeros) are summed over; None is the default group."""
        groups = self._driver.stats_groups
        real = [g for g in groups if g is not None]
        if len(groups) > 1 and len(real) > 1:
            raise StepOrderError("get_grad_stats_parallel_group(): this optimizer sums its statistics over several "
                                 "groups (data- and model-parallel), so no single group describes it.")
        return real[0] if real else None

    def prepare_model_params_for_param_sync(self) -> None:
        """Nothing to prepare: pass 2 writes the rounded params straight into the param buffer."""

    def sharded_state_dict(self, model_sharded_state_dict: Optional[dict] = None, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's distributed-optimizer checkpoint (Megatron-LM's --ckpt-format torch_dist), in
        the format ``metadata['distrib_optim_sharding_type']`` names: 'fully_reshardable' (per param, in
        model space, loadable at any parallel layout) or 'dp_reshardable' (megatron-core's flat buckets).
        Needs megatron-core; see optimizer/state/torch_dist.py and docs/checkpoints.md."""
        from .state import torch_dist as megatron_format

        return megatron_format.build(self, model_sharded_state_dict, is_loading, metadata)

    def save_parameter_state(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(_MEGATRON_CHECKPOINT_HINT.format(what="save_parameter_state()"))

    def load_parameter_state(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(_MEGATRON_CHECKPOINT_HINT.format(what="load_parameter_state()"))

    def save_state_dict_to_file(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(_MEGATRON_CHECKPOINT_HINT.format(what="save_state_dict_to_file()"))

    def load_state_dict_from_file(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(_MEGATRON_CHECKPOINT_HINT.format(what="load_state_dict_from_file()"))


_MEGATRON_CHECKPOINT_HINT = (
    "{what}: Megatron-LM's per-rank optimizer files (--ckpt-format torch) are not supported by megatron_opt. Use "
    "--ckpt-format torch_dist (the default: sharded_state_dict in megatron-core's formats), or save and load with "
    "megatron_opt.checkpoint.save(path, ...) / load(path, ...); see docs/checkpoints.md and docs/megatron.md.")


__all__ = ["MegatronOptimizer"]
