"""Worker-side cases for test_collectives.py: the agreement helper and the reduce-scatter fallback."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_opt import collectives
from megatron_opt.host_reduction import ReceiveSlots, abandon
from megatron_opt.errors import RankError


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (the type is part of what is checked)
        cause = exc.__cause__
        return f"{type(exc).__name__}: {exc} | cause={type(cause).__name__ if cause is not None else None}"
    return ""


def agree_failure_on(failing: list[int]) -> str:
    """The ranks in ``failing`` hold a local failure; every rank raises together."""
    mine = KeyError("no such batch") if dist.get_rank() in failing else None
    return _error_of(lambda: collectives.agree("loading", mine, None, error_type=RankError, failure_note="Retry."))


def agree_fingerprints(differ_on: int) -> str:
    """Rank ``differ_on`` holds another value for 'lr'; every rank raises naming the item."""
    lr = 0.5 if dist.get_rank() == differ_on else 0.1
    return _error_of(lambda: collectives.agree("Builder", None, None, fingerprint=[("width", 8), ("lr", lr)],
                                               error_type=ValueError, fix="Build the same thing everywhere."))


def agree_payloads() -> list:
    return collectives.agree("sharing", None, None, payload={"rank": dist.get_rank()})


def raise_together_result(fail_on: int) -> str:
    def job() -> int:
        if dist.get_rank() == fail_on:
            raise OSError("disk full")
        return 7

    return _error_of(lambda: collectives.raise_together(job, None, "saving", RuntimeError)) or "7"


def agree_each_step_traffic(fail_on: int, names_differ: bool) -> dict:
    """Counts the all-reduces (and their sizes) and the object gathers of one agree_each_step."""
    reduced, gathered = [], []
    real_all_reduce, real_gather = collectives.all_reduce, dist.all_gather_object
    collectives.all_reduce = lambda t, *a, **k: (reduced.append(t.numel()), real_all_reduce(t, *a, **k))[1]
    dist.all_gather_object = lambda *a, **k: (gathered.append(1), real_gather(*a, **k))[1]
    rank = dist.get_rank()
    names = ["aux", "z"] if names_differ and rank == 1 else ["aux"]
    try:
        error = _error_of(lambda: collectives.agree_each_step(
            "train_step failed", ValueError("bad batch") if rank == fail_on else None, [None],
            fingerprint=[("aux loss names", names)], error_type=RankError, fix="Return the same aux losses."))
    finally:
        collectives.all_reduce, dist.all_gather_object = real_all_reduce, real_gather
    return {"error": error, "reduced": reduced, "gathered": len(gathered)}


def host_reduce_scatter(dtype_name: str) -> dict:
    """On CPU tensors (gloo) reduce_scatter sends each chunk to its owner, which sums in rank order:
    neither gloo's reduce-scatter nor an all-reduce is called, the shard is bitwise
    ((g_0 + g_1) + g_2) + ..., and the rest of ``full`` keeps this rank's own values. Three async
    launches share two receive slots (the third finishes the first), in place and not. all_reduce with
    receive slots leaves the same rank-order sum on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}
    native_calls = []

    def count(fn):
        return lambda *a, **k: (native_calls.append(1), fn(*a, **k))[1]

    def grads(seed: int, r: int, n: int) -> torch.Tensor:
        return torch.randn(n * world, generator=torch.Generator().manual_seed(1000 * seed + r)).to(dtype)

    def expected(seed: int, n: int) -> torch.Tensor:
        total = grads(seed, 0, n)
        for r in range(1, world):
            total = total + grads(seed, r, n)
        return total[rank * n : (rank + 1) * n]

    sizes = [5, 8, 3]  # per-rank chunk of each bucket
    slots = ReceiveSlots(max(sizes) * world, dtype)
    ok = []
    try:
        for n in names:
            setattr(dist, n, count(real[n]))
        for in_place in (True, False):
            fulls = [grads(b, rank, n) for b, n in enumerate(sizes)]
            shards = [f[rank * n : (rank + 1) * n] if in_place else torch.full((n,), 7.0, dtype=dtype)
                      for f, n in zip(fulls, sizes)]
            handles = [collectives.reduce_scatter(f, s, None, async_op=True, slots=slots)
                       for f, s in zip(fulls, shards)]
            for h in handles:
                h.wait()
            for b, (f, s, n) in enumerate(zip(fulls, shards, sizes)):
                rest = torch.cat([f[: rank * n], f[(rank + 1) * n :]])
                own = grads(b, rank, n)
                ok.append(torch.equal(s, expected(b, n))
                          and torch.equal(rest, torch.cat([own[: rank * n], own[(rank + 1) * n :]])))
            full = grads(9, rank, 4)
            shard = torch.empty(4, dtype=dtype)
            collectives.reduce_scatter(full, shard, None, async_op=False)
            ok.append(torch.equal(shard, expected(9, 4)))
        # the all-reduce with receive slots (a shard across optimizer instances): every rank holds the
        # rank-order sum, bitwise
        shards = [grads(20 + b, rank, n)[:n].clone() for b, n in enumerate(sizes)]
        handles = [collectives.all_reduce(t, None, async_op=True, slots=slots) for t in shards]
        for b, (t, h, n) in enumerate(zip(shards, handles, sizes)):
            h.wait()
            total = grads(20 + b, 0, n)
            for r in range(1, world):
                total = total + grads(20 + b, r, n)
            ok.append(torch.equal(t, total[:n]))
        # an abandoned reduction (its bucket reset before the wait) never writes its shard, even when the
        # next launches need its slot and so wait for it
        full = grads(30, rank, 8)
        shard = torch.full((8,), 7.0, dtype=dtype)
        dropped = collectives.reduce_scatter(full, shard, None, async_op=True, slots=slots)
        abandon(dropped)
        later = [grads(31 + b, rank, 8) for b in range(2)]
        outs = [torch.empty(8, dtype=dtype) for _ in later]
        handles = [collectives.reduce_scatter(f, o, None, async_op=True, slots=slots) for f, o in zip(later, outs)]
        for b, (h, out) in enumerate(zip(handles, outs)):
            h.wait()
            ok.append(torch.equal(out, expected(31 + b, 8)))
        ok.append(bool((shard == 7.0).all()))
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    return {"ok": ok, "native_calls": len(native_calls), "slots_allocated": slots.allocated}


def agree_each_step_over_two_groups(fail_on: int) -> str:
    """World 4: groups[0] is {0, 1} or {2, 3}, the second group {0, 2} or {1, 3} (every rank creates
    every group). A failure reaches every rank through the flags; the message names the failing rank
    where it is in this rank's first group, else a peer."""
    rank = dist.get_rank()
    firsts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    seconds = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = [firsts[rank // 2], seconds[rank % 2]]
    failure = RuntimeError("kernel failed") if rank == fail_on else None
    return _error_of(lambda: collectives.agree_each_step("the update failed", failure, groups, error_type=RankError))
