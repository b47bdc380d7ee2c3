"""The FSDP2 baseline's sharding: fully_shard on each block, then on the root, over all ranks."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def fully_shard_blocks(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], device_type: str,
                       bf16: bool) -> None:
    """Shard ``model`` with FSDP2 over every rank, one unit per block and the root; ``bf16`` computes in
    bf16 with fp32 gradient reduction (the sharded params stay fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": init_device_mesh(device_type, (dist.get_world_size(),))}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
