"""Reductions of CPU tensors (gloo) whose sums the host does, in rank order.

Reduce-scatter: gloo has no true one (its ``reduce_scatter`` stages the whole input and costs more than
an all-reduce), and an all-reduce moves every element twice (reduce, then broadcast back). Here one
``all_to_all_single`` sends chunk r of the bucket to rank r and the owner adds what it received, so
each element crosses once: half the all-reduce's time at DP 2-4 on this machine (24-48M fp32 elements,
`scripts/bench_host_reduce_scatter.py`).

All-reduce of one shard across optimizer instances (partial sharding): one all-gather, then every rank
adds the copies. Both sums run in rank order (((g_0 + g_1) + g_2) + ...), so a shard reduced in two
levels over instances of one rank (k = DP) is bitwise the one-level reduce-scatter's, and neither
depends on gloo's ring order (which in bf16 rounds some elements ~1% off where the terms cancel).

The data arrives in receive space (``ReceiveSlots``), reused across steps so no bucket-sized allocation
(and its page faults) happens per step. The sum is done on the host, in ``wait()``, or earlier when the
caller polls ``finish_if_done`` while the backward goes on (gloo's collective handles report completion;
its point-to-point ones do not, which is why these are collectives and not sends and receives).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# gloo's all_to_all_single aborts the process on bfloat16 (and refuses int16); the all-to-all only
# moves bytes, so bfloat16 travels as bytes.
_AS_BYTES = (torch.bfloat16,)


class ReceiveSlots:
    """Receive space for the host reductions of one gradient buffer: ``count`` slots of up to
    ``numel`` elements, allocated on first use and reused. A launch that finds every slot taken first
    finishes the oldest reduction holding one (issued on every rank in the same order, so that wait
    cannot block on a collective another rank has not issued)."""

    def __init__(self, numel: int, dtype: torch.dtype, count: int = 2) -> None:
        self.numel, self.dtype, self.count = numel, dtype, count
        self._free: list[torch.Tensor] = []
        self.allocated = 0  # slots allocated so far (at most ``count``)
        self._holders: list["HostReduction"] = []  # in launch order

    def take(self, numel: int) -> torch.Tensor:
        """A whole free slot (the caller uses its first ``numel`` elements)."""
        if numel > self.numel:
            raise RuntimeError(f"ReceiveSlots: {numel} elements asked of slots of {self.numel}")
        if not self._free and self.allocated < self.count:
            self._free.append(torch.empty(self.numel, dtype=self.dtype))
            self.allocated += 1
        while not self._free:
            self._holders[0].wait()  # returns its slot
        return self._free.pop()

    def hold(self, handle: "HostReduction") -> None:
        self._holders.append(handle)

    def give_back(self, handle: "HostReduction", slot: torch.Tensor) -> None:
        self._holders.remove(handle)
        self._free.append(slot)


class HostReduction:
    """Handle of one host reduction: its collective in flight, then the sum on ``wait()``."""

    def __init__(self, work, chunks: list[torch.Tensor], out: torch.Tensor, first_is_received: bool,
                 slots: Optional[ReceiveSlots], slot: torch.Tensor) -> None:
        self._work, self._chunks, self._out, self._first_is_received = work, chunks, out, first_is_received
        self._slots, self._slot = slots, slot
        self._done = False
        if slots is not None:
            slots.hold(self)  # its slot is reused only after its sum

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def abandon(self) -> None:
        """Drop the sum (its bucket was reset before the reduction was waited for, e.g. a step that failed):
        the data still arrives into the slot, which is reused only after that, but ``out`` is never written."""
        self._out = None

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._out is not None:
            _sum_in_rank_order(self._chunks, self._out, self._first_is_received)
        self._done = True
        self._chunks = []
        if self._slots is not None:
            self._slots.give_back(self, self._slot)


def _sum_in_rank_order(chunks: list[torch.Tensor], out: torch.Tensor, first_is_received: bool) -> None:
    """``out`` = ((chunks[0] + chunks[1]) + chunks[2]) + ... . One chunk may be ``out`` itself (the
    in-place case), so the partial sum lives in chunk 0 when that is receive space, else (rank 0 of a
    reduce-scatter, whose chunk 0 is its own) in ``out``, which chunk 0 then no longer needs."""
    if not first_is_received:
        torch.add(chunks[0], chunks[1], out=out)
        for chunk in chunks[2:]:
            out.add_(chunk)
        return
    acc = chunks[0]
    for chunk in chunks[1:-1]:
        acc.add_(chunk)
    torch.add(acc, chunks[-1], out=out)


def receive_numel(numel: int, world: int, rank: int) -> int:
    """Elements a rank receives in the host reduce-scatter of ``numel`` elements: the first and the last
    rank send one contiguous run of the other ranks' chunks and receive only those; a middle rank's own
    chunk sits inside its input, so it also sends itself one."""
    chunk = numel // world
    return (world - 1) * chunk if rank in (0, world - 1) else world * chunk


def reduce_scatter_on_host(full: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup],
                           async_op: bool, slots: Optional[ReceiveSlots] = None) -> HostReduction:
    """SUM-reduce ``full`` over ``group`` into this rank's chunk ``shard`` (which may alias that chunk of
    ``full``); the rest of ``full`` is left as it was, as a reduce-scatter leaves it. ``slots``: reused
    receive space (None: a fresh tensor)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = shard.numel()
    own = full[rank * chunk : (rank + 1) * chunk]
    at_an_end = rank in (0, world - 1)
    slot, received = _receive_space(slots, receive_numel(full.numel(), world, rank), full.dtype)
    if at_an_end:
        send = full[chunk:] if rank == 0 else full[: (world - 1) * chunk]
        splits = [0 if r == rank else chunk for r in range(world)]
    else:
        send, splits = full, [chunk] * world
    splits = [s * full.element_size() // _wire(full).element_size() for s in splits]  # bytes for bfloat16
    work = dist.all_to_all_single(_wire(received), _wire(send), splits, splits, group=group, async_op=async_op)
    parts = list(received.split(chunk))
    chunks = parts[:rank] + [own] + parts[rank:] if at_an_end else parts
    return _started(HostReduction(work if async_op else None, chunks, shard, rank != 0, slots, slot), async_op)


def all_reduce_on_host(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool,
                       slots: Optional[ReceiveSlots] = None) -> HostReduction:
    """SUM-reduce ``tensor`` in place over ``group``: every rank gathers every copy and adds them in rank
    order, so every rank holds the same bits. ``slots``: reused receive space (None: a fresh tensor)."""
    world, n = dist.get_world_size(group), tensor.numel()
    slot, received = _receive_space(slots, world * n, tensor.dtype)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(_wire(received), _wire(tensor), group=group, async_op=async_op)
    return _started(HostReduction(work if async_op else None, list(received.split(n)), tensor, True, slots, slot),
                    async_op)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What the collective moves: bytes for bfloat16 (``_AS_BYTES``), else the tensor itself."""
    return tensor.view(torch.uint8) if tensor.dtype in _AS_BYTES else tensor


def _receive_space(slots: Optional[ReceiveSlots], numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slot, its first ``numel`` elements): from ``slots``, or a fresh tensor when there are none."""
    slot = slots.take(numel) if slots is not None else torch.empty(numel, dtype=dtype)
    return slot, slot[:numel]


def _started(handle: HostReduction, async_op: bool) -> HostReduction:
    """The handle of a launched host reduction, finished now unless ``async_op``."""
    if not async_op:
        handle.wait()
    return handle


def abandon(handle) -> None:
    """A reset bucket's handle: a host reduction still pending never writes its result (see
    ``HostReduction.abandon``); any other handle is left alone."""
    if isinstance(handle, HostReduction):
        handle.abandon()  # nothing left to drop once it was waited


def finish_if_done(handle) -> bool:
    """Finish a host reduction whose data has arrived (its sum, now rather than at the end of the
    backward); False for any other handle or one still in flight."""
    if isinstance(handle, HostReduction) and handle.is_completed():
        handle.wait()
        return True
    return False


__all__ = ["ReceiveSlots", "HostReduction", "receive_numel", "reduce_scatter_on_host", "all_reduce_on_host",
           "abandon", "finish_if_done"]
