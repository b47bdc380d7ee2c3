"""The step plan: every shard one pass touches, cut once into fixed-size chunks.

An optimizer step runs pass 1 (grad statistics) and pass 2 (the update) over many buckets. Walking
them one launch and one Python call per bucket makes a step at large data-parallel sizes host- and
launch-bound, so a ``StepPlan`` is built once for the shards launched together (one grad dtype and one
param dtype, typically one buffer: the optimizer's ``LaunchPlan``) and each pass is then one launch over all of them:

* a pointer table, one row per shard: the raw addresses of grad, master, up to two state arrays and
  param_out. The tensors are held by the plan and must never be reallocated (the optimizer only
  ever copies into them in place);
* a chunk table, one row per chunk of at most ``CHUNK`` elements inside one piece: shard, start, end,
  and the piece's param group, whether it counts in the norm and the vector phase of its arrays.
  Chunks never include padding, and their boundaries depend on the tables alone, so pass 1's
  per-chunk partials (and so the grad norm) are bitwise the same on any GPU and grid size.

Torch backends (``reference``, ``cpu``) run the same plan shard by shard, so every backend takes the
same arguments. They read lr and weight decay on the host: ``DeviceHyperparams`` hands out an
``LrWdTable``, its device table with the host values it staged, so they never travel host -> device ->
host (and nothing is hidden on the tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .op_args import LrWd, LrWdTable, ShardOperands
from .operand_checks import check_plan_shards
from .precision import FLOAT_DTYPES

CHUNK = 32768  # elements per chunk at most: 4 (bf16) to 8 (fp32) unrolled iterations of a 256-thread block
PTR_COLS = 5  # grad, master, state0, state1, param_out (matches csrc/common.cuh kPtrCols)
MAX_STATES = 2
_VECTOR_BYTES = 16
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/common.cuh kCodeF32, kCodeBF16, kCodeF16
MASTER_CODES = {torch.float32: 0, torch.float16: 2, torch.int16: 3}  # 3: remainder (csrc/common.cuh kCodeRem)
_IN_NORM_BIT = 32
_PHASE_SHIFT = 40


def _phase(ptr: int, elem_size: int, vec: int) -> int:
    """Element phase of an address modulo ``vec`` elements, or -1 if not even element-aligned."""
    return -1 if ptr % elem_size else (ptr // elem_size) % vec


@dataclass
class StepPlan:
    """The shards one launch covers, cut into chunks once. ``update=False`` builds a stats-only plan
    (grads alone)."""

    shards: tuple[ShardOperands, ...]
    update: bool = True
    chunk: int = CHUNK
    _device_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.shards = tuple(self.shards)
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.shards:
            check_plan_shards(self.shards, self.update)
        self.max_group = max((g for s in self.shards for g in s.table.group), default=-1)
        self._chunk_rows = self._build_chunks()

    # ------------------------------------------------------------------ description
    @property
    def device(self) -> Optional[torch.device]:
        return self.shards[0].grad.device if self.shards else None

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        return self.shards[0].grad.dtype if self.shards else None

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        return None if not self.shards or self.shards[0].param_out is None else self.shards[0].param_out.dtype

    @property
    def num_chunks(self) -> int:
        return len(self._chunk_rows)

    def chunk_rows(self) -> list[tuple[int, int, int, int, bool, int]]:
        """(shard, start, end, group, in_norm, phase) per chunk, phase -1 for the scalar path."""
        return list(self._chunk_rows)

    # ------------------------------------------------------------------ construction
    @property
    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(t.dtype for t in self.shards[0].state) if self.shards else ()

    @property
    def master_dtype(self) -> Optional[torch.dtype]:
        return self.shards[0].master.dtype if self.shards and self.shards[0].master is not None else None

    def state_codes(self) -> tuple[int, int]:
        """The dtype code of each of the two state slots (-1: no such state)."""
        codes = [DTYPE_CODES[d] for d in self.state_dtypes] + [-1] * (MAX_STATES - len(self.state_dtypes))
        return codes[0], codes[1]

    def check_kernel_layout(self, op: str) -> None:
        """The CUDA kernels take at most two state arrays per shard, each float32, bfloat16 or float16."""
        if len(self.state_dtypes) > MAX_STATES or any(d not in FLOAT_DTYPES for d in self.state_dtypes):
            raise TypeError(f"{op}: the CUDA kernels take at most {MAX_STATES} float32/bfloat16/float16 state tensors "
                            f"per shard, this plan has {list(self.state_dtypes)}")

    def _arrays(self, s: ShardOperands) -> list[Optional[torch.Tensor]]:
        state = list(s.state[:MAX_STATES]) + [None] * (MAX_STATES - len(s.state))
        return [s.grad, s.master if self.update else None, *(state if self.update else [None, None]),
                s.param_out if self.update else None]

    def _build_chunks(self) -> list[tuple[int, int, int, int, bool, int]]:
        rows = []
        for k, s in enumerate(self.shards):
            # Element i of every array starts a 16-byte grad vector iff (i + phase) % vec == 0; a
            # shard whose arrays disagree on the phase runs one element per thread.
            vec = _VECTOR_BYTES // s.grad.element_size()
            phases = {_phase(x.data_ptr(), x.element_size(), vec) for x in self._arrays(s) if x is not None}
            phase = phases.pop() if len(phases) == 1 else -1
            t = s.table
            for start, end, norm, group in zip(t.starts, t.ends, t.in_norm, t.group):
                for a in range(start, end, self.chunk):
                    rows.append((k, a, min(end, a + self.chunk), group, norm, phase))
        return rows

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Pointer and chunk tables plus pass 1's per-chunk workspace, on the plan's device (built once)."""
        if "ptrs" not in self._device_cache:
            self.check_kernel_layout("StepPlan")
            device = self.device
            ptrs = [[0 if t is None else t.data_ptr() for t in self._arrays(s)] for s in self.shards]
            chunks = [[k, a, e, g | (int(bool(n)) << _IN_NORM_BIT) | ((p + 1) << _PHASE_SHIFT)]
                      for k, a, e, g, n, p in self._chunk_rows]
            host_ptrs = torch.tensor(ptrs, dtype=torch.int64).reshape(-1, PTR_COLS)
            host_chunks = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 4)
            self._device_cache.update(
                ptrs=_upload(host_ptrs, device, self._device_cache),
                chunks=_upload(host_chunks, device, self._device_cache),
                sumsq_ws=torch.empty(max(1, self.num_chunks), dtype=torch.float64, device=device),
                counts_ws=torch.empty(2 * max(1, self.num_chunks), dtype=torch.int32, device=device),
            )
        return self._device_cache

    def check_once(self, key: str, check: Callable[[], None]) -> None:
        """Run ``check()`` (an op's operand checks, which depend only on the plan's tensors) the first
        time ``key`` is seen: a plan is built once and run every step."""
        done = self._device_cache.setdefault("checked", set())
        if key not in done:
            check()
            done.add(key)

    def check_groups(self, lr_wd: torch.Tensor, op: str) -> None:
        if not isinstance(lr_wd, torch.Tensor) or lr_wd.dtype != torch.float64 or lr_wd.dim() != 2 \
                or lr_wd.shape[1] != 2:
            raise TypeError(f"{op}: lr_wd must be a float64 tensor of shape [num_groups, 2] (lr, weight decay)")
        if self.max_group >= lr_wd.shape[0]:
            raise ValueError(f"{op}: pieces use param group {self.max_group} but lr_wd has {lr_wd.shape[0]} rows")
        if self.shards and lr_wd.device != self.device:
            raise ValueError(f"{op}: lr_wd is on {lr_wd.device}, the plan on {self.device}")


def _upload(host: torch.Tensor, device: torch.device, keep: dict) -> torch.Tensor:
    """Copy to ``device`` without a host sync. The pinned source is kept in ``keep``: a copy recorded
    while a CUDA graph is being captured reads it again at every replay."""
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    keep.setdefault("pinned_sources", []).append(pinned)
    return pinned.to(device, non_blocking=True)


def lr_wd_table(lr: Sequence[float], weight_decay: Sequence[float], device: torch.device) -> LrWdTable:
    """A [num_groups, 2] float64 (lr, weight decay) table on ``device`` with its host values, copied
    without a host sync (a new table per call: the optimizer keeps one ``DeviceHyperparams`` instead)."""
    lr_l, wd_l = [float(x) for x in lr], [float(x) for x in weight_decay]
    if len(lr_l) != len(wd_l):
        raise ValueError(f"lr has {len(lr_l)} entries but weight_decay has {len(wd_l)}")
    if not lr_l:
        raise ValueError("lr must have one entry per param group")
    host = torch.tensor(list(zip(lr_l, wd_l)), dtype=torch.float64)
    if device.type != "cuda":
        return LrWdTable(host.to(device), LrWd(lr_l, wd_l))
    pinned = host.pin_memory()  # alive as long as the table (graph replays read it)
    out = torch.empty_like(host, device=device)
    out.copy_(pinned, non_blocking=True)
    return LrWdTable(out, LrWd(lr_l, wd_l), pinned_source=pinned)


def host_lr_wd(lr_wd: "LrWdTable | torch.Tensor") -> LrWd:
    """The host values of an (lr, weight decay) table: those an ``LrWdTable`` was staged from (float64 both
    ways, so bitwise the table's), or, for a bare tensor, read back from the device."""
    return LrWdTable.of(lr_wd).host


class DeviceHyperparams:
    """The per-group (lr, weight decay) table the update kernels read, kept on the device and
    updated in place only when a value changed, so a captured CUDA graph replays the current values."""

    def __init__(self, num_groups: int, device: torch.device) -> None:
        self.table = torch.zeros(max(1, num_groups), 2, dtype=torch.float64, device=device)
        self._uploaded: Optional[tuple] = None
        self._staged: Optional[LrWdTable] = None

    def update(self, lr: Sequence[float], weight_decay: Sequence[float]) -> LrWdTable:
        """Stage this step's values (an upload only when one changed): the table, with its host values."""
        values = tuple(zip((float(x) for x in lr), (float(x) for x in weight_decay)))
        if len(values) != self.table.shape[0]:
            raise ValueError(f"{len(values)} param groups, the table was built for {self.table.shape[0]}")
        if values != self._uploaded:
            host = torch.tensor(values, dtype=torch.float64)
            if self.table.is_cuda:
                host = host.pin_memory()  # the caching host allocator keeps it alive until the copy is done
            self.table.copy_(host, non_blocking=self.table.is_cuda)
            self._uploaded = values
            self._staged = LrWdTable(self.table, LrWd([v[0] for v in values], [v[1] for v in values]))
        return self._staged


__all__ = ["CHUNK", "DTYPE_CODES", "MASTER_CODES", "ShardOperands", "StepPlan", "lr_wd_table", "host_lr_wd",
           "DeviceHyperparams"]
