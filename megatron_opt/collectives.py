"""Thin wrappers over torch.distributed: one dtype per call, world size 1 short-circuits, gloo fallbacks,
and the one cross-rank agreement helper.

Every collective megatron_opt issues itself goes through here, so the dtype rule (rule 7 of
docs/contract.md) is checked in one place and tests can observe the traffic by wrapping these
functions. Two kinds of traffic are not issued here: creating process groups (``new_group``) and the
collectives torch.distributed.checkpoint runs inside ``dcp.save`` / ``dcp.load``.

Agreement (``agree``): where one rank can fail, or hold other settings, while the others would go on
into a collective that rank never joins (or train something else), every rank must raise together,
with the failing rank's message. ``agree`` is that one helper; ``agree_each_step`` is its cheap form
for the training step and ``raise_together`` runs a function under it.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from .host_reduction import ReceiveSlots, all_reduce_on_host, reduce_scatter_on_host

ProcessGroup = Optional[dist.ProcessGroup]
Failure = Union[None, str, BaseException]
T = TypeVar("T")


class _Done:
    """Handle of a collective that needed no communication (world size 1), or one already waited for."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _AllReduceAsReduceScatter:
    """Async handle of an all-reduce standing in for a reduce-scatter; copies this rank's chunk on wait()."""

    def __init__(self, work, full: torch.Tensor, shard: torch.Tensor, offset: int) -> None:
        self._work, self._full, self._shard, self._offset = work, full, shard, offset

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        src = self._full[self._offset : self._offset + self._shard.numel()]
        if src.data_ptr() != self._shard.data_ptr():
            self._shard.copy_(src)


class _Slices:
    """Async handle of one collective issued as several (gloo slices, see ``GLOO_SLICE``): waits for
    each in issue order."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


DONE = _Done()  # stateless: one shared instance


def world_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: ProcessGroup) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of ``group`` in group-rank order (None: the default group)."""
    if not dist.is_initialized():
        return [0]
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def flag_device(group: ProcessGroup = None) -> torch.device:
    """Where a small control tensor for ``group`` must live: CUDA for NCCL groups, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_one_dtype(name: str, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"{name}: every tensor of one collective must share a dtype, got {sorted(map(str, dtypes))}")


def _reduce_scatter_op():
    # reduce_scatter_single / all_gather_single where torch has them (2.13 and 2.14 do; their old
    # names reduce_scatter_tensor / all_gather_into_tensor warn there), else the old names.
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_op():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _backend_lacks_reduce_scatter(exc: BaseException) -> bool:
    """Only "this backend cannot do it" (an old gloo) may switch to the emulation; any other failure
    (timeout, dead peer) must surface, or this rank would issue a different collective."""
    return isinstance(exc, (NotImplementedError, AttributeError)) or "support" in str(exc).lower()


def reduce_scatter(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool,
                   slots: Optional[ReceiveSlots] = None):
    """SUM-reduce ``full`` (same size on every rank) and leave this rank's equal chunk in ``shard``.

    ``shard`` may alias this rank's chunk of ``full`` (in-place, as Megatron does). CPU tensors (gloo)
    take the host reduce-scatter (host_reduction.py: one all-to-all, the owner sums; ``slots`` is
    its reusable receive space). A backend without reduce-scatter gets an in-place all-reduce; that is
    decided per call (the backend refuses before any traffic, the same way on every rank), so nothing is
    remembered between calls or groups.
    """
    _check_one_dtype("reduce_scatter", full, shard)
    n = world_size(group)
    if n == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full[: shard.numel()])
        return _Done()
    if full.numel() != shard.numel() * n:
        raise RuntimeError(f"reduce_scatter: {full.numel()} elements do not split into {n} chunks of {shard.numel()}")
    if full.device.type == "cpu":
        handle = reduce_scatter_on_host(full, shard, group, async_op, slots)
        return handle if async_op else _Done()
    try:
        work = _reduce_scatter_op()(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return work if async_op else _Done()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        if not _backend_lacks_reduce_scatter(exc):
            raise
    return _reduce_scatter_as_all_reduce(full, shard, group, async_op)


def _reduce_scatter_as_all_reduce(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool):
    """An in-place all-reduce of ``full``, then this rank's chunk into ``shard`` (nothing to copy when it
    is a view of it). The rest of ``full`` holds the sum too, where a reduce-scatter leaves it as it was;
    nothing reads it (the shard is what the optimizer owns). For a backend without reduce-scatter."""
    work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    handle = _AllReduceAsReduceScatter(work if async_op else None, full, shard, rank(group) * shard.numel())
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
    if full.device.type == "cpu" and shard.numel() > _slice_per_rank(group):
        return _all_gather_in_slices(full, shard, group, async_op)
    work = _all_gather_op()(full, shard, group=group, async_op=async_op)
    return work if async_op else _Done()


# gloo stages a whole all-gather in a flat temporary and copies it in and out; on a large bucket that
# temporary is as large as the bucket and leaves the cache. In slices of this many elements of the
# gathered output the staging stays small, the same at any DP size, and the gather took a third to a
# half of the one bucket-sized all-gather's time (DP 2 and 4, 40M elements).
GLOO_SLICE = 1 << 21


def _slice_per_rank(group: ProcessGroup) -> int:
    return max(1, GLOO_SLICE // world_size(group))


def _all_gather_in_slices(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool):
    """The all-gather of ``shard`` into ``full`` as one list-form all-gather per slice of the per-rank
    chunks, issued in the same order on every rank. When ``shard`` is this rank's chunk of ``full``, its
    output part of each slice is the input itself."""
    n, world, step = shard.numel(), world_size(group), _slice_per_rank(group)
    works = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        outputs = [full[r * n + lo : r * n + hi] for r in range(world)]
        works.append(dist.all_gather(outputs, shard[lo:hi], group=group, async_op=async_op))
    return _Slices(works) if async_op else _Done()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False,
               slots: Optional[ReceiveSlots] = None):
    """``slots`` (a gradient shard's sum across optimizer instances): on CPU tensors the host all-reduce
    (host_reduction.py: every rank adds the gathered copies in rank order) in that receive space."""
    if world_size(group) == 1:
        return _Done()
    if slots is not None and tensor.device.type == "cpu" and op == dist.ReduceOp.SUM:
        handle = all_reduce_on_host(tensor, group, async_op, slots)
        return handle if async_op else _Done()
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else _Done()


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: ProcessGroup) -> None:
    """Send ``input_splits[r]`` consecutive elements of ``input`` to rank r and receive
    ``output_splits[r]`` from rank r into ``output`` (one all_to_all_single: gloo and NCCL both run it)."""
    _check_one_dtype("all_to_all", output, input)
    if world_size(group) == 1:
        output.copy_(input)
        return
    dist.all_to_all_single(output, input, list(output_splits), list(input_splits), group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup) -> None:
    if world_size(group) == 1:
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group or dist.group.WORLD, src_group_rank), group=group)


def gather_objects(obj: Any, group: ProcessGroup = None) -> list:
    """Every rank's ``obj`` (picklable), in group-rank order: one all_gather_object."""
    if world_size(group) == 1:
        return [obj]
    everyone = [None] * world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


# ----------------------------------------------------------------------------------------- agreement
def _message(failure: Failure, error_type: type) -> Optional[str]:
    """A failure as the other ranks read it: the text, led by the exception type unless it is already
    ``error_type`` (DCP's CheckpointException is a BaseException, hence not Exception)."""
    if failure is None or isinstance(failure, str):
        return failure
    return str(failure) if isinstance(failure, error_type) else f"{type(failure).__name__}: {failure}"


def _with(text: str, note: str) -> str:
    return f"{text.rstrip('.')}. {note}" if note else text


def _rank_name(group: ProcessGroup, r: int) -> str:
    g = global_ranks(group)[r]
    return f"rank {r}" if g == r else f"rank {r} (global rank {g})"


def _first_difference(reference: list, other: list, r: int) -> str:
    for (key_a, val_a), (key_b, val_b) in zip(reference, other):
        if key_a != key_b:
            return f"item {key_a!r} on rank 0 is {key_b!r} on rank {r}"
        if val_a != val_b:
            return f"{key_a} is {val_a!r} on rank 0 but {val_b!r} on rank {r}"
    return f"rank 0 has {len(reference)} items, rank {r} has {len(other)}"


def agree(what: str, failure: Failure = None, group: ProcessGroup = None, *,
          fingerprint: Optional[Sequence[tuple[Any, Any]]] = None, payload: Any = None,
          error_type: type = RuntimeError, fix: str = "", failure_note: str = "") -> list:
    """Raise on every rank of ``group`` together, or on none: one all_gather_object of (this rank's
    failure, fingerprint, payload).

    ``failure`` (an exception or a message) on any rank raises ``error_type`` everywhere:
    "``what`` on rank r (and k more): message. ``failure_note``". Otherwise a ``fingerprint`` (a list
    of (item, value) pairs) that differs from rank 0's raises "``what``: the ranks disagree: <the first
    differing item>. ``fix``". The error is chained to this rank's own exception. Returns every
    rank's ``payload`` in group-rank order (e.g. what each rank holds, for a check of the whole set).
    """
    mine = (_message(failure, error_type), None if fingerprint is None else list(fingerprint), payload)
    everyone = gather_objects(mine, group)
    cause = failure if isinstance(failure, BaseException) else None
    failed = [(r, m) for r, (m, _, _) in enumerate(everyone) if m is not None]
    if failed:
        r, message = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise error_type(_with(f"{what} on {_rank_name(group, r)}{more}: {message}", failure_note)) from cause
    if fingerprint is not None:
        reference = everyone[0][1]
        for r, (_, other, _) in enumerate(everyone[1:], start=1):
            if other != reference:
                raise error_type(_with(f"{what}: the ranks disagree: {_first_difference(reference, other, r)}", fix))
    return [p for _, _, p in everyone]


def agree_each_step(what: str, failure: Failure = None, groups: Sequence[ProcessGroup] = (None,), *,
                    fingerprint: Optional[Sequence[tuple[Any, Any]]] = None, error_type: type = RuntimeError,
                    fix: str = "", failure_note: str = "") -> None:
    """``agree`` for every step: one small MAX all-reduce per group of [failed] (plus [n, -n, crc, -crc]
    of the fingerprint: the MAX of a value and of its negation differ iff the ranks differ), and the
    all_gather_object of ``agree`` over ``groups[0]`` only when that shows a failure or a difference.
    A failure or difference seen only through a later group is reported as a peer's in another group."""
    flags = [0.0 if failure is None else 1.0]
    if fingerprint is not None:
        n, crc = float(len(fingerprint)), float(zlib.crc32(repr(list(fingerprint)).encode()))
        flags += [n, -n, crc, -crc]
    group0 = groups[0] if groups else None
    if all(world_size(g) == 1 for g in groups):  # no one to ask: this rank's own failure is the answer
        if failure is not None:
            agree(what, failure, group0, error_type=error_type, failure_note=failure_note)
        return
    seen = torch.tensor(flags, dtype=torch.float64, device=flag_device(group0))
    for group in groups:
        all_reduce(seen, group, op=dist.ReduceOp.MAX)
    seen_l = seen.tolist()
    failed = seen_l[0] > 0
    differs = fingerprint is not None and (seen_l[1] != -seen_l[2] or seen_l[3] != -seen_l[4])
    if not failed and not differs:
        return
    agree(what, failure, group0, fingerprint=fingerprint, error_type=error_type, fix=fix, failure_note=failure_note)
    cause = failure if isinstance(failure, BaseException) else None
    if failed:
        raise error_type(_with(f"{what} on a rank of another process group (a model-parallel peer)",
                               failure_note)) from cause
    raise error_type(_with(f"{what}: the ranks of another process group (model-parallel peers) disagree", fix))


def raise_together(fn: Callable[[], T], group: ProcessGroup = None, what: str = "",
                   error_type: type = RuntimeError) -> T:
    """Run ``fn`` on every rank and return its result; if it raised on any rank, raise ``error_type``
    on every rank ("``what`` failed on rank r: ..."), through ``agree``. Use it at each boundary
    where one rank can fail while the others would go on to a collective that rank never joins."""
    failure: Failure = None
    result = None
    try:
        result = fn()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failure = exc
    agree(f"{what} failed" if what else "failed", failure, group, error_type=error_type)
    return result  # type: ignore[return-value]

