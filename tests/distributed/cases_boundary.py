"""Worker-side cases for test_boundary.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.common import TinyLM, build, global_batch, token_loss_sum


def _train(ddp, opt, steps: int = 2) -> None:
    rank = dist.get_rank()
    for step in range(steps):
        x, y = global_batch(dist.get_world_size(), seed=40 + step)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss_sum, n = token_loss_sum(ddp(x), y)
        opt.scale_loss(loss_sum / n).backward()
        assert opt.step()[0]


def _same_on_all_ranks(tensors: dict) -> bool:
    flat = torch.cat([t.reshape(-1).double() for _, t in sorted(tensors.items())])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, flat) for g in gathered)


def gather_main_params_case() -> dict:
    fp32 = TinyLM(torch.float32)
    ddp32, opt32 = build(fp32)
    _train(ddp32, opt32)
    masters32 = opt32.gather_main_params()
    bf16 = TinyLM(torch.bfloat16)
    ddp16, opt16 = build(bf16, bf16=True)
    _train(ddp16, opt16)
    masters16 = opt16.gather_main_params()
    params16 = dict(bf16.named_parameters())
    return dict(
        names_match=set(masters32) == {n for n, _ in fp32.named_parameters()} == set(masters16),
        fp32_equal=all(torch.equal(masters32[n], p.detach()) for n, p in fp32.named_parameters()),
        bf16_rounds_to_params=all(masters16[n].dtype == torch.float32
                                  and torch.equal(masters16[n].to(p.dtype), p.detach()) for n, p in params16.items()),
        identical_across_ranks=_same_on_all_ranks(masters16),
    )
