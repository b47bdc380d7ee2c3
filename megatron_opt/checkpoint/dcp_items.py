"""How optimizer state in model space meets torch.distributed.checkpoint (DCP).

A ``ParamChunk`` is this rank's contiguous part of one param's state tensor, presented to DCP in the
param's own shape: it answers DCP's checkpointable protocol (``__create_write_items__`` on save,
``__create_chunk_list__`` on load) with the rectangular boxes of its range (see boxes.py), so DCP
writes each rank's boxes and, at any other sharding, reads back exactly the overlaps each rank
asks for. With a Placement (param_layout.py) the boxes are placed in the param's global tensor
(megatron-core's key, shape and offsets) and a non-main replica writes none. Two small planners
resolve a box's index to the tensor view behind it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..optimizer.state.boxes import Box, flat_range_to_boxes
from .param_layout import Placement, whole


class ParamChunk:
    """Elements [start, start + flat.numel()) of a flattened param of ``shape``; ``flat`` is the
    1-D tensor holding them (read on save, written on load). A rank owning nothing passes an empty
    ``flat``: the key then exists on every rank, as DCP expects, with no data on this one."""

    def __init__(self, flat: torch.Tensor, shape: torch.Size, start: int,
                 placement: Optional[Placement] = None) -> None:
        self.flat = flat
        self.shape = torch.Size(shape)  # the local param's
        self.start = start
        self.placement = placement  # None: the param as it is (local names)
        if placement is None:
            placement = whole("", self.shape, (0,) * len(self.shape), self.shape, True)
        self.global_shape = placement.shape
        # Each piece's part of [start, end) as boxes of the piece, moved to its place in the global tensor.
        end = start + flat.numel()
        self.boxes: list[Box] = []
        for piece in placement.pieces:
            lo, hi = max(start, piece.flat_start), min(end, piece.flat_start + piece.numel)
            if lo < hi:
                self.boxes += [Box(tuple(o + b for o, b in zip(piece.offset, box.offsets)), tuple(box.sizes),
                                   piece.flat_start + box.flat_start)
                               for box in flat_range_to_boxes(piece.shape, lo - piece.flat_start,
                                                              hi - piece.flat_start)]

    @property
    def written(self) -> bool:
        """Whether this rank writes its boxes (not a tensor-parallel duplicate or a tied copy)."""
        return self.placement is None or self.placement.written

    # DCP reads the global size of a destination from size() to check it against the checkpoint.
    def size(self) -> torch.Size:
        return self.global_shape

    def box_view(self, offsets: torch.Size) -> torch.Tensor:
        for box in self.boxes:
            if tuple(box.offsets) == tuple(offsets):
                lo = box.flat_start - self.start
                return self.flat[lo : lo + box.numel].view(box.sizes)
        raise KeyError(f"no box at offsets {tuple(offsets)} in this rank's chunk")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if not self.written:
            return []
        props = TensorProperties.create_from_tensor(self.flat)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(b.offsets),
                                                                                 torch.Size(b.sizes)),
                                                      properties=props, size=self.global_shape))
                for b in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in self.boxes]


class ModelSpaceSavePlanner(DefaultSavePlanner):
    """Top-level keys only: a dict value (run state, RNG, scalars) is stored whole, as one object."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ParamChunk):
            return obj.box_view(index.offset).contiguous()
        return super().lookup_object(index)


class ModelSpaceLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up re-initialises known tensor types in place and replaces any other object with
        # None; keep our chunks (top-level keys, so flattening leaves their keys unchanged).
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, ParamChunk)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, chunk in chunks.items():
            state_dict[key] = self.state_dict[key] = chunk

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ParamChunk):
            return obj.box_view(index.offset)
        return super().lookup_tensor(index)


def saved_tensor_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """Global shapes of every tensor key in a DCP checkpoint's metadata."""
    return {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


__all__ = ["ParamChunk", "ModelSpaceSavePlanner", "ModelSpaceLoadPlanner", "saved_tensor_shapes"]
