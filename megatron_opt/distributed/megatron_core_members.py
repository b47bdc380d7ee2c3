"""The members megatron-core's DistributedDataParallel has and Megatron-LM calls, which concern the
wrapped module rather than data parallelism: each passes the call on to the module, or refuses what
megatron_opt does not do (grad-buffer offloading).

They are a mixin of DistributedDataParallel, kept apart from its own work. They cannot live in
``megatron_opt/megatron/``: that adapter is a leaf nothing in the core imports (tests/unit/test_layering.py),
and these are members of the core's public class. Nothing here imports megatron-core.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UnsupportedConfigError


class MegatronCoreModuleMembers:
    """Megatron-LM's checkpoint and micro-batch calls on a model chunk, passed to ``self.module``."""

    module: torch.nn.Module

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's checkpoint state dict (its own state_dict_for_save_checkpoint when it has
        one, as megatron-core's modules do), without this wrapper's 'module.' prefix."""
        inner = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if callable(inner):
            return inner(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """The wrapped module's megatron-core sharded state dict (Megatron-LM's torch_dist model checkpoint)."""
        inner = getattr(self.module, "sharded_state_dict", None)
        if not callable(inner):
            raise UnsupportedConfigError(
                f"sharded_state_dict(): the wrapped {type(self.module).__name__} has no sharded_state_dict (only "
                f"megatron-core modules do). Save with megatron_opt.checkpoint.save, or Megatron-LM's "
                f"--ckpt-format torch.")
        return inner(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    def set_is_first_microbatch(self) -> None:
        """Tell the wrapped modules a new step's first micro-batch starts (Transformer Engine refreshes
        its fp8 weight caches on it); megatron-core's modules decide themselves whether it matters."""
        inner = getattr(self.module, "set_is_first_microbatch", None)
        if callable(inner):
            inner()
            return
        for m in self.module.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        raise UnsupportedConfigError(
            "offload_grad_buffers(): megatron_opt does not free its grad buffers between steps (the optimizer's "
            "step plans point into them); run without Megatron-LM's grad-buffer offloading.")

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        raise UnsupportedConfigError("restore_grad_buffers(): grad-buffer offloading is not supported by megatron_opt.")


__all__ = ["MegatronCoreModuleMembers"]
