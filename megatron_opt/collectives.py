"""Thin wrappers over torch.distributed: one dtype per call, world size 1 short-circuits, gloo fallbacks.

Every collective megatron_opt issues goes through here, so the dtype rule (rule 7 of docs/contract.md) is
checked in one place and tests can observe the traffic by wrapping these functions.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


class _Done:
    """Handle of a collective that needed no communication (world size 1)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _FallbackReduceScatter:
    """Async handle of an all-reduce emulating reduce-scatter; copies this rank's chunk on wait()."""

    def __init__(self, work, full: torch.Tensor, shard: torch.Tensor, offset: int) -> None:
        self._work, self._full, self._shard, self._offset = work, full, shard, offset

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        src = self._full[self._offset : self._offset + self._shard.numel()]
        if src.data_ptr() != self._shard.data_ptr():
            self._shard.copy_(src)


def world_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: ProcessGroup) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def flag_device(group: ProcessGroup = None) -> torch.device:
    """Where a small control tensor for ``group`` must live: CUDA for NCCL groups, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_one_dtype(name: str, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"{name}: every tensor of one collective must share a dtype, got {sorted(map(str, dtypes))}")


_reduce_scatter_supported = True


def _reduce_scatter_op():
    # torch 2.14 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn).
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_op():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool):
    """SUM-reduce ``full`` (same size on every rank) and leave this rank's equal chunk in ``shard``.

    ``shard`` may alias this rank's chunk of ``full`` (in-place, as Megatron does).
    """
    global _reduce_scatter_supported
    _check_one_dtype("reduce_scatter", full, shard)
    n = world_size(group)
    if n == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full[: shard.numel()])
        return _Done()
    if full.numel() != shard.numel() * n:
        raise RuntimeError(f"reduce_scatter: {full.numel()} elements do not split into {n} chunks of {shard.numel()}")
    if _reduce_scatter_supported:
        try:
            work = _reduce_scatter_op()(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            return work if async_op else _Done()
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            # Only "this backend cannot do it" (old gloo) may switch to the emulation; any other
            # failure (timeout, dead peer) must surface, or this rank would issue a different collective.
            if not isinstance(exc, (NotImplementedError, AttributeError)) and "support" not in str(exc).lower():
                raise
            _reduce_scatter_supported = False
    work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    handle = _FallbackReduceScatter(work if async_op else None, full, shard, rank(group) * shard.numel())
    if not async_op:
        handle.wait()
        return _Done()
    return handle


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool):
    """Gather every rank's equal chunk into ``full``; ``shard`` may alias this rank's chunk of it."""
    _check_one_dtype("all_gather", full, shard)
    if world_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            full[: shard.numel()].copy_(shard)
        return _Done()
    if not async_op and full.device.type == "cpu" and shard.numel() > _slice_per_rank(group):
        _all_gather_in_chunks(full, shard, group)
        return _Done()
    work = _all_gather_op()(full, shard, group=group, async_op=async_op)
    return work if async_op else _Done()


# gloo stages a whole all-gather output in a temporary buffer; a synchronous gather of a large bucket
# (e.g. after a checkpoint load) goes in slices so that buffer stays small. The bound is on the
# gathered output (all ranks' slices), so the staging stays the same at any DP size.
SYNC_ALL_GATHER_CHUNK = 1 << 21  # elements of the gathered output per slice


def _slice_per_rank(group: ProcessGroup) -> int:
    return max(1, SYNC_ALL_GATHER_CHUNK // world_size(group))


def _all_gather_in_chunks(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> None:
    n, world, step = shard.numel(), world_size(group), _slice_per_rank(group)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        # When ``shard`` is this rank's chunk of ``full`` its output slice is the input itself.
        outputs = [full[r * n + lo : r * n + hi] for r in range(world)]
        dist.all_gather(outputs, shard[lo:hi], group=group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    if world_size(group) == 1:
        return _Done()
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else _Done()


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup) -> None:
    if world_size(group) == 1:
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group or dist.group.WORLD, src_group_rank), group=group)



def max_over_groups(values: list, groups: list) -> list:
    """One small MAX all-reduce per group (on the device the group needs): every rank learns the
    largest of each value, e.g. whether any rank failed. The cheap happy path of an agreement."""
    flags = torch.tensor(values, dtype=torch.float64, device=flag_device(groups[0] if groups else None))
    for group in groups:
        all_reduce(flags, group, op=dist.ReduceOp.MAX)
    return flags.tolist()


def gather_failures(failure: Optional[BaseException], group: ProcessGroup = None, payload=None) -> list:
    """Every rank's (error message or None, payload) over ``group``: the slow path of an agreement,
    run only after max_over_groups said something is wrong."""
    mine = (None if failure is None else f"{type(failure).__name__}: {failure}", payload)
    if world_size(group) == 1:
        return [mine]
    everyone = [None] * world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def raise_together(fn, group: ProcessGroup = None, what: str = "", error_type: type = RuntimeError):
    """Run ``fn`` on every rank; if it raised on any rank, raise ``error_type`` on every rank with
    the first failing rank's message (one all_gather_object). Use it at each boundary where one rank
    can fail while the others would go on to a collective that rank never joins."""
    error = None
    result = None
    try:
        result = fn()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = str(exc) if isinstance(exc, error_type) else f"{type(exc).__name__}: {exc}"
    errors = [error]
    if world_size(group) > 1:
        errors = [None] * world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, message = failed[0]
        where = f" on rank {r}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
        raise error_type(f"{what} failed{where}: {message}" if what else f"failed{where}: {message}")
    return result


def check_ranks_agree(what: str, fingerprint: list, group: ProcessGroup = None, local_error: Optional[str] = None,
                      fix: str = "", error_type: type = ValueError) -> None:
    """One all_gather_object of (local error, fingerprint) over ``group``. A local error on any rank,
    or any rank whose fingerprint (a list of (item, value) pairs) differs from rank 0's, raises
    ``error_type`` on every rank, naming the rank and the first differing item."""
    mine = (local_error, list(fingerprint))
    everyone = [mine]
    if world_size(group) > 1:
        everyone = [None] * world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    for r, (err, _) in enumerate(everyone):
        if err is not None:
            raise error_type(f"{what}: rank {r}: {err}")
    reference = everyone[0][1]
    for r, (_, other) in enumerate(everyone[1:], start=1):
        if other == reference:
            continue
        for (key_a, val_a), (key_b, val_b) in zip(reference, other):
            if key_a != key_b or val_a != val_b:
                detail = (f"{key_a} is {val_a!r} on rank 0 but {val_b!r} on rank {r}" if key_a == key_b
                          else f"item {key_a!r} on rank 0 is {key_b!r} on rank {r}")
                break
        else:
            detail = f"rank 0 has {len(reference)} items, rank {r} has {len(other)}"
        raise error_type(f"{what}: the ranks disagree: {detail}. {fix}".rstrip())
