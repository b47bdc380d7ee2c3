"""Worker-side cases for test_collectives.py: the agreement helper and the reduce-scatter fallback."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_opt import collectives
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


def reduce_scatter_on_gloo_is_an_all_reduce() -> dict:
    """On CPU tensors (gloo) reduce_scatter is an in-place all-reduce, whether or not the backend offers a
    reduce-scatter: gloo's native one is never called, and the shard is the reduce-scatter's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}
    native_calls = []

    def refuse(*a, **k):
        raise NotImplementedError("reduce_scatter is not supported by this backend")

    def count(fn):
        return lambda *a, **k: (native_calls.append(1), fn(*a, **k))[1]

    def one_round(in_place: bool) -> bool:
        full = torch.arange(4.0 * world) + rank
        shard = full[rank * 4 : (rank + 1) * 4] if in_place else torch.empty(4)
        collectives.reduce_scatter(full, shard, None, async_op=False)
        expected = sum(torch.arange(4.0 * world) + r for r in range(world))[rank * 4 : (rank + 1) * 4]
        return torch.equal(shard, expected)

    try:
        for n in names:
            setattr(dist, n, refuse)
        refused = one_round(False) and one_round(True)
        for n in names:
            setattr(dist, n, count(real[n]))
        offered = one_round(False) and one_round(True)
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    return {"refused_ok": refused, "offered_ok": offered, "native_calls": len(native_calls)}


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
