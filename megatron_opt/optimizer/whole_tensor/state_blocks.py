"""StateBlocks: which blocks of a matrix its per-matrix state (SOAP's, NorMuon's) belongs to.

megatron-core keeps such state per TP-local block, so a run's state is that of its own tensor-parallel split, and
a checkpoint's is that of the split that saved it. ``matrix_state_tp_size`` (a rule constant, 0 = the run's own
TP size) names the split whose blocks the state belongs to: a TP1 run given 2 keeps, for every TP-split matrix,
one state per half along the matrix's partition dimension, the very blocks a TP2 run holds, so a TP2 checkpoint
loads into it bitwise (the checkpoint keys are the blocks' offsets and shapes) and the rule runs on each block as
TP2 did. The rule's stateful part sees each block alone; the rest of the step is the run's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ... import collectives
from ...errors import UnsupportedConfigError
from .tensor_parallel_newton_schulz import partition_dim_of

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offset in the TP-local param, shape) of one state block


@dataclass(frozen=True)
class StateBlocks:
    """``count`` equal blocks along ``dim`` of a (TP-local) matrix, in order (count 1: the matrix whole)."""

    dim: int = 0
    count: int = 1

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The blocks, each contiguous as a TP rank's own block is: a GEMM rounds by its operands' layout, and the
        block's step should be the one that TP rank computes."""
        return [matrix] if self.count == 1 else [b.contiguous() for b in matrix.chunk(self.count, dim=self.dim)]

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return parts[0] if self.count == 1 else torch.cat(list(parts), dim=self.dim)

    def shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        return [block_shape for _, block_shape in self.blocks(shape)]

    def blocks(self, shape: Sequence[int]) -> list[Block]:
        """(offset, shape) of every block of a matrix of ``shape``."""
        size = list(shape)
        size[self.dim] //= self.count
        out = []
        for b in range(self.count):
            offset = [0] * len(shape)
            offset[self.dim] = b * size[self.dim]
            out.append((tuple(offset), tuple(size)))
        return out

    def label(self, name: str, block: int) -> str:
        """A state check's name, with the block where there are several."""
        return name if self.count == 1 else f"{name} (block {block} of {self.count} along dim {self.dim})"


def state_blocks_of(name: str, shape: Sequence[int], param: torch.nn.Parameter, shard: Any,
                    state_tp_size: int) -> StateBlocks:
    """The blocks of one matrix's per-matrix state: a TP-split param (megatron-core's ``tensor_model_parallel`` and
    ``partition_dim``) cut into ``state_tp_size / this run's TP size`` blocks along its partition dimension; else
    whole. UnsupportedConfigError (the same on every rank: the layout is) for a size the run cannot cut to."""
    if state_tp_size == 0:
        return StateBlocks()
    group = getattr(shard, "tensor_parallel_group", None)
    run_tp = collectives.world_size(group) if group is not None else 1
    if state_tp_size % run_tp:
        raise UnsupportedConfigError(
            f"matrix_state_tp_size={state_tp_size} is not a multiple of this run's tensor-parallel size {run_tp}: "
            f"the per-matrix state can keep the blocks of a finer split only; use a multiple of {run_tp} (or 0).")
    count = state_tp_size // run_tp
    dim = partition_dim_of(param)
    if count == 1 or dim is None:
        return StateBlocks()
    if getattr(param, "partition_stride", 1) != 1:
        raise UnsupportedConfigError(
            f"matrix_state_tp_size={state_tp_size}: {name} is split over tensor parallelism with stride "
            f"{param.partition_stride} (SwiGLU's fc1: a TP block is [gate_r; up_r]), whose blocks are not contiguous "
            f"here; use matrix_state_tp_size 0 (this run's split), or the saved split's tensor-parallel size.")
    if shape[dim] % count:
        raise UnsupportedConfigError(
            f"matrix_state_tp_size={state_tp_size}: {name} of shape {tuple(shape)} does not cut into {count} blocks "
            f"along dim {dim}; use a tensor-parallel size that divides it.")
    return StateBlocks(dim, count)


__all__ = ["Block", "StateBlocks", "state_blocks_of"]
