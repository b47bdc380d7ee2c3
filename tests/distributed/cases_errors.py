"""Worker-side cases for bad input: errors must be clear and raised on every rank together."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import TinyLM, build, global_batch, token_loss_sum


def _catch(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def step_without_backward(only_rank: int, distributed: bool = True) -> str:
    """Ranks other than ``only_rank`` run a backward (only_rank < 0: no rank does); step() must raise
    on every rank instead of leaving the ranks that did run backward waiting (or stepping alone)."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp, opt = build(model, distributed=distributed)
    ddp.zero_grad_buffer()
    if only_rank >= 0 and rank != only_rank:
        x, y = global_batch(dist.get_world_size(), seed=1)[rank]
        token_loss_sum(ddp(x), y)[0].backward()
    return _catch(opt.step)


def nan_check_before_reduction() -> str:
    """check_for_nan_in_grad: a NaN on rank 1 only must raise on every rank, not only on rank 1."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, check_for_nan_in_grad=True))
    ddp.zero_grad_buffer()
    x, y = global_batch(2, seed=1)[rank]
    loss = token_loss_sum(ddp(x), y)[0]
    (loss * (float("nan") if rank == 1 else 1.0)).backward()
    return _catch(ddp.finish_grad_sync)


def train_step_bad_loss_fn() -> str:
    model = TinyLM()
    ddp, opt = build(model)
    return _catch(lambda: mo.train_step(ddp, opt, None, [1], lambda m, b: torch.zeros(())))
