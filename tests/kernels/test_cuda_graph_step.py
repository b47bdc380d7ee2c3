"""optimizer_cuda_graph on a GPU: the whole step after the grad sync captured in one CUDA graph and
replayed gives bitwise the same params, norms and skip decisions as the host-decided eager step,
with an lr that changes between replays, a clipped step, an injected overflow and a norm skip.
One process, NCCL with world size 1 (the multi-rank device decision is covered on gloo by
tests/distributed/test_device_step.py)."""
from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.ops as ops

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (torch.cuda.is_available() and ops.HAS_CUDA_EXT),
                                 reason="needs a CUDA device and the compiled extension")]

# (grad multiplier, lr): x0.15 clips mildly, x1 clips, inf overflows, x1e4 crosses the threshold.
SCHEDULE = [(1.0, 1e-2), (0.15, 9e-3), (1.0, 8e-3), (float("inf"), 7e-3), (0.15, 6e-3), (1e4, 5e-3),
            (1.0, 4e-3), (2.0, 3e-3)]


@pytest.fixture(scope="module")
def nccl_world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    path = tempfile.mktemp()
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()
    if os.path.exists(path):
        os.remove(path)


def _model(seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(96, 96) for _ in range(3)] + [torch.nn.LayerNorm(96), torch.nn.Linear(96, 17)]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)


def _train(graph: bool, optimizer: str = "adam") -> list[dict]:
    model = _model()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, bucket_size=4000))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(
        lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=1.0, weight_decay=0.1,
        grad_norm_skip_threshold=1e3, optimizer_cuda_graph=graph, optimizer=optimizer), ddp)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(32, 96, device="cuda", generator=g).bfloat16()
    out = []
    for mult, lr in SCHEDULE:
        for group in opt.param_groups:
            group["lr"] = lr
        ddp.zero_grad_buffer()
        loss = ddp(x).float().square().mean()
        (loss * mult if math.isfinite(mult) else loss).backward()
        if not math.isfinite(mult):
            model[0].weight.main_grad.view(-1)[5] = float("inf")
        success, norm, _ = opt.step()
        torch.cuda.synchronize()
        out.append(dict(success=bool(success), norm=None if norm is None else float(norm),
                        params=torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu(),
                        skipped=opt.skipped_steps))
    return out


@pytest.mark.parametrize("optimizer", ["adam", "muon"])  # muon: the Linear weights (Newton-Schulz in the graph)
def test_graph_replay_is_bitwise_equal_to_the_eager_step(nccl_world_of_one, optimizer):
    eager, graphed = _train(False, optimizer), _train(True, optimizer)
    assert [r["success"] for r in eager] == [r["success"] for r in graphed]
    assert [r["success"] for r in eager].count(False) == 2, "one overflow and one norm skip"
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert torch.equal(e["params"], g["params"]), f"step {i}: params differ"
        assert e["skipped"] == g["skipped"]
        if e["success"]:
            assert e["norm"] == g["norm"], (i, e["norm"], g["norm"])
        else:
            assert math.isnan(g["norm"])
    assert not torch.equal(eager[0]["params"], eager[-1]["params"])
