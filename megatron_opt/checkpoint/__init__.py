"""megatron_opt.checkpoint: parallel, atomic, resharding checkpoints on torch.distributed.checkpoint.

    checkpointer = Checkpointer()                                   every rank, once
    checkpointer.save(path, model, optimizer, scheduler, iteration=..., async_save=...)
    checkpointer.check_pending_save()                               once per step after an async save
    checkpointer.load(path, model, optimizer, scheduler) -> LoadResult   any DP size
    save / load / check_pending_save(model) / wait_for_pending_save(model): the same through the
        Checkpointer kept on the model (default_checkpointer)
    export(path, out)  /  python -m megatron_opt.checkpoint export CKPT OUT   one process
    read_info(path) -> CheckpointInfo   what a checkpoint holds (iteration, optimizer, layout), unloaded
    resolve(path), latest_iteration(path), complete_iterations(path), TRACKER   the folder's iterations
"""
from .checkpointer import (Checkpointer, LoadResult, check_pending_save, default_checkpointer, load, save,
                           wait_for_pending_save)
from .directory import TRACKER, complete_iterations, latest_iteration, resolve
from .export import export, read_model_state, read_tensors
from .info import CheckpointInfo, read_info
from .validation import verify_files

__all__ = ["Checkpointer", "LoadResult", "default_checkpointer", "save", "load", "check_pending_save",
           "wait_for_pending_save", "latest_iteration", "resolve", "complete_iterations", "TRACKER", "CheckpointInfo",
           "read_info", "verify_files", "export", "read_model_state",
           "read_tensors"]
