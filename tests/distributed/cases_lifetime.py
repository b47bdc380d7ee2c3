"""Worker-side cases: what a dropped DistributedDataParallel leaves behind."""
from __future__ import annotations

import gc
import weakref

import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import TinyLM, global_batch, rank_microbatches, token_loss_sum


def run_dropped_wrapper_is_freed(overlap: bool) -> dict:
    """Wrap a model, train one micro-batch, drop both: the wrapper and the model (with them the grad
    buffers and the group the wrapper holds) must be collectable; the grad hooks on the params must
    not keep them alive."""
    group = dist.new_group(list(range(dist.get_world_size())))
    lm = TinyLM()
    cfg = mo.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                           bucket_size=200)
    ddp = mo.DistributedDataParallel(lm, cfg, data_parallel_group=group)
    tokens, targets = rank_microbatches(global_batch(dist.get_world_size() * 2, seed=1), dist.get_rank(),
                                        dist.get_world_size())[0]
    token_loss_sum(ddp(tokens), targets)[0].backward()
    ddp.finish_grad_sync()
    refs = {"wrapper": weakref.ref(ddp), "model": weakref.ref(lm)}
    del ddp, lm
    gc.collect()
    dist.destroy_process_group(group)
    return {name: ref() is None for name, ref in refs.items()}
