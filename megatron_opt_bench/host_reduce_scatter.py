"""The gradient reduction of one bucket on gloo, three ways, timed on every rank (median, max over ranks):

- gloo's ``all_reduce`` of the bucket (what megatron_opt issued before its host reduce-scatter);
- gloo's ``reduce_scatter`` (what megatron-core issues);
- ``megatron_opt.collectives.reduce_scatter`` on CPU tensors: one all-to-all, the owner sums.

    torchrun --standalone --nproc_per_node=2 scripts/bench_host_reduce_scatter.py [--elements 40000000 \\
        --dtype float32 --repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_opt import collectives
from megatron_opt.host_reduction import ReceiveSlots


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    local = torch.tensor([statistics.median(times) * 1e3])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=40_000_000, help="bucket size (rounded to the world size)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    chunk = args.elements // world
    full = torch.randn(chunk * world).to(dtype)
    shard = full[rank * chunk : (rank + 1) * chunk]
    slots = ReceiveSlots(full.numel(), dtype)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gloo_shard = torch.empty(chunk, dtype=dtype)
    rows = [
        ("gloo all_reduce", lambda: dist.all_reduce(full)),
        ("gloo reduce_scatter", lambda: rs(gloo_shard, full)),
        ("megatron_opt host reduce-scatter", lambda: collectives.reduce_scatter(full, shard, None, False, slots)),
    ]
    # one untimed round each (allocations, connections), then the timed ones
    results = {}
    for name, fn in rows:
        fn()
        results[name] = _median_ms(fn, args.repeats)
    if rank == 0:
        print(f"DP {world}, {chunk * world:,} {args.dtype} elements per bucket, median of {args.repeats} "
              "(max over ranks):")
        print("| reduction | ms | vs all_reduce |\n|---|---|---|")
        base = results["gloo all_reduce"]
        for name, ms in results.items():
            print(f"| {name} | {ms:.1f} | {ms / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
