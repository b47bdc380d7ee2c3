"""megatron-core's ``dist_checkpointing.load`` with megatron_opt's bucket-layout check in front
(optimizer/dp_reshardable_check.py); install() puts it where Megatron-LM's checkpointing calls it."""
from __future__ import annotations

import functools
from typing import Any, Callable

from ..optimizer.dp_reshardable_check import check_bucket_layout


def checked(load: Callable) -> Callable:
    """``load`` (megatron-core's dist_checkpointing.load), refusing by name on every rank a dp_reshardable
    optimizer checkpoint laid out in other buckets than the state dict asks for."""
    @functools.wraps(load)
    def load_after_checking(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        check_bucket_layout(sharded_state_dict, checkpoint_dir)
        return load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    return load_after_checking


__all__ = ["checked"]
