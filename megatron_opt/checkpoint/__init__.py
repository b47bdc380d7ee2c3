"""megatron_opt.checkpoint: parallel, atomic, resharding checkpoints on torch.distributed.checkpoint.

    save(path, model, optimizer, scheduler, iteration=..., async_save=...)   every rank
    load(path, model, optimizer, scheduler) -> RunState                      every rank, any DP size
    export(path, out)  /  python -m megatron_opt.checkpoint export CKPT OUT  one process
"""
from .api import (RunState, check_pending_save, latest_iteration, load, resolve, save, verify_files,
                  wait_for_pending_save)
from .export import export, read_model_state, read_tensors

__all__ = ["RunState", "save", "load", "check_pending_save", "wait_for_pending_save", "latest_iteration", "resolve",
           "verify_files", "export", "read_model_state", "read_tensors"]
