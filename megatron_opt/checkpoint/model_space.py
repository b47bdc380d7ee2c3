"""What a checkpoint holds, by name, in model space (independent of the data-parallel layout).

Keys of the DCP state dict:
    model/<param>                 the model param in its dtype and shape; each rank contributes the
                                  part of its own shard (ParamChunk), so no rank writes it all
    optim/<state>/<param>         'master' and the update rule's state, in the param's shape; each
                                  rank contributes the part it owns (ParamChunk)
    optim/scalars                 param-group hyperparameters, update counts, loss scaler, rules
    scheduler, run                the LR schedule; iteration, consumed samples, user extras
    rank/<rank>                   each rank's RNG state and its own extras (e.g. its data position)
With several model chunks (virtual pipeline stages) a param is named ``chunk<c>.<name>``. Over
megatron-core modules a param is named, shaped and placed as its ShardedTensor says instead (global
key, shape and offsets; tensor-parallel duplicates and the tied copy written once: param_layout.py),
so the checkpoint also reshards across tensor and pipeline parallelism.

The optimizer is read and written only through its declared state view
(optimizer/state/view.py), the same view its in-memory state_dict() uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .. import collectives
from ..distributed.shard_view import GradSource
from ..errors import CheckpointError
from ..optimizer.state.view import (MATRIX_STATE_SPLIT, MatrixStateTensor, OptimizerStateView, first_nonfinite,
                                    homed_matrix_state,
                                    model_fingerprint, optimizer_fingerprint, owned_slices, param_entries, state_names,
                                    state_names_of)
from .dcp_items import ParamChunk
from .param_layout import Placement

FORMAT = "megatron_opt.checkpoint/1"


def as_chunks(model: Union[GradSource, Sequence[GradSource]]) -> list[GradSource]:
    chunks = [model] if isinstance(model, (GradSource, torch.nn.Module)) else list(model)
    for chunk in chunks:
        if not isinstance(chunk, GradSource):
            raise TypeError(f"megatron_opt.checkpoint needs megatron_opt.DistributedDataParallel model chunks, "
                            f"got {type(chunk).__name__}; wrap the model first.")
    return chunks


def check_optimizer(chunks: Sequence[GradSource], optimizer: Any) -> OptimizerStateView:
    """``optimizer`` offers the state view, over exactly these model chunks (model parallelism is checked
    where the params are placed: param_layout.placements)."""
    if not isinstance(optimizer, OptimizerStateView):
        raise TypeError(f"megatron_opt.checkpoint needs a megatron_opt optimizer (DistributedOptimizer or "
                        f"ChainedOptimizer), got {type(optimizer).__name__}.")
    mine = optimizer.model_chunks
    if len(mine) != len(chunks) or any(a is not b for a, b in zip(mine, chunks)):
        raise CheckpointError(f"the optimizer was built over {len(mine)} model chunk(s) that are not the {len(chunks)} "
                              f"given to megatron_opt.checkpoint: pass the same chunks, in the same order.")
    return optimizer


def is_model_parallel(chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView]) -> bool:
    """The optimizer's leaves, or the chunks' own groups (a model-only save has no optimizer), span
    tensor / pipeline / context / expert parallelism."""
    if optimizer is not None and any(leaf.model_parallel for leaf in optimizer.state_leaves()):
        return True
    return any(getattr(getattr(c, "model_parallel_groups", None), "is_model_parallel", False) for c in chunks)


def model_parallel_sizes(chunks: Sequence[GradSource]) -> Optional[dict[str, int]]:
    """The chunks' model-parallel sizes (None for chunks that do not record them)."""
    groups = getattr(chunks[0], "model_parallel_groups", None) if chunks else None
    return groups.sizes() if groups is not None else None


def data_parallel_size(chunks: Sequence[GradSource]) -> int:
    """The size of the chunks' data-parallel group (the dense params'; the expert params' without any)."""
    shards = [s for c in chunks for s in c.local_shards(False)] or [s for c in chunks for s in c.local_shards()]
    if not shards:
        return collectives.world_size(None)
    shard = shards[0]
    return collectives.world_size(shard.data_parallel_group if shard.data_parallel_group is not None else shard.group)


def fingerprint(chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView],
                params: Optional[list] = None) -> dict[str, Any]:
    """What must match for a load: param names, shapes, dtypes (``params``: param_layout.fingerprint_params's,
    else the local ones); the optimizer's rules and state."""
    out: dict[str, Any] = {"params": params if params is not None else model_fingerprint(chunks)}
    if optimizer is not None:
        out["optimizer"] = optimizer_fingerprint(optimizer)
    return out


def _model_pieces(chunks: Sequence[GradSource]) -> dict[tuple[int, str], tuple[torch.Tensor, int]]:
    """(chunk, name) -> (this rank's piece of the param, a view of its param-buffer shard; its start)."""
    out = {}
    for c, chunk in enumerate(chunks):
        for shard in chunk.local_shards():
            for pc in shard.pieces:
                view = shard.param[pc.shard_range.start : pc.shard_range.end]
                out[(c, shard.names[pc.param_index])] = (view, pc.param_range.start)
    return out


class Staging:
    """Reused copy buffers for background saves: the blocking copy then lands in memory that is
    already mapped (fresh allocations would page-fault on every save)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._buffers[key] = torch.empty_like(t)
        return buf.copy_(t)


def rank_key() -> str:
    return f"rank/{collectives.rank(None)}"


def build_save_state(chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView], scheduler: Optional[Any],
                     run: dict[str, Any], rank_state: dict[str, Any], staging: Optional[Staging],
                     places: dict[str, Placement]) -> dict[str, Any]:
    """The DCP state dict to save. With ``staging`` every tensor is copied (for a save in the background).
    ``places``: param_layout.placements by local key."""
    own: Callable[[str, torch.Tensor], torch.Tensor] = \
        (lambda key, t: staging.copy(key, t.detach())) if staging is not None else (lambda key, t: t.detach())
    entries = param_entries(chunks)
    model_pieces = _model_pieces(chunks)
    sd: dict[str, Any] = {}
    for e in entries:
        view, start = model_pieces.get((e.chunk, e.name), (torch.empty(0, dtype=e.param.dtype), 0))
        key = f"model/{places[e.key].key}"
        sd[key] = ParamChunk(own(key, view), e.param.shape, start, places[e.key])
    if optimizer is not None:
        leaves = optimizer.state_leaves()
        owned = {(s.state, s.key): s for s in owned_slices(optimizer)}
        for name in state_names(optimizer):
            for e in entries:
                if name not in state_names_of(leaves, e):
                    continue
                # Every rank writes every key (an empty chunk where it owns nothing), as DCP expects.
                s = owned.get((name, e.key))
                key = f"optim/{name}/{places[e.key].key}"
                flat = own(key, s.values()) if s is not None else torch.empty(0, device=e.param.device)
                sd[key] = ParamChunk(flat, e.param.shape, s.start if s is not None else 0, places[e.key])
        for m in homed_matrix_state(optimizer):  # written by each matrix's home only
            key = matrix_state_key(m, places)
            sd[key] = own(key, m.tensor)
        sd["optim/scalars"] = optimizer.scalar_state()
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    sd["run"] = dict(run)
    sd[rank_key()] = rank_state
    return sd


def matrix_state_key(m: MatrixStateTensor, places: dict[str, Placement]) -> str:
    """The checkpoint key of one per-matrix state tensor: the param's name there, and where this rank's block
    of it starts and its shape (a TP-local block's state belongs to that block: another tensor-parallel split
    has other blocks, so other keys)."""
    place = places[m.key]
    origin = place.pieces[0].offset if place.pieces else (0,) * len(m.param.shape)
    offset = tuple(o + b for o, b in zip(origin, m.offset))  # the state's block (matrix_state_tp_size) within it
    block = ",".join(str(o) for o in offset) + "+" + "x".join(str(n) for n in m.shape)
    return f"optim/matrix/{m.state}/{place.key}@{block}"


def matrix_state_keys(optimizer: Optional[OptimizerStateView], places: dict[str, Placement]) -> list[str]:
    """The checkpoint keys of the per-matrix state this rank reads (none without a whole-tensor rule's)."""
    return [] if optimizer is None else [matrix_state_key(m, places) for m in homed_matrix_state(optimizer)]


def missing_matrix_state(keys: Sequence[str], saved_keys: Any) -> Optional[str]:
    """Why a checkpoint holding ``saved_keys`` cannot give this rank its per-matrix state ``keys`` (None when it
    can)."""
    missing = [k for k in keys if k not in saved_keys]
    if not missing:
        return None
    return (f"it holds no {missing[0]} ({len(missing)} per-matrix state tensor(s) missing): {MATRIX_STATE_SPLIT}. "
            f"To go on at another split, load the model without the optimizer state (Megatron-LM's --no-load-optim; "
            f"megatron_opt.checkpoint.load with optimizer=None): the optimizer then starts afresh")


@dataclass(frozen=True)
class _Owned:
    """One piece this rank owns in a load: its key, how it is read (dtype, size) and written back."""

    key: str
    dtype: torch.dtype  # the checkpoint's value dtype (fp32 for masters, whatever their storage)
    numel: int
    device: torch.device
    shape: torch.Size
    start: int
    write: Callable[[torch.Tensor], Any]  # stores the values into the live model / optimizer
    placement: Placement


def _owned(chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView],
           places: dict[str, Placement]) -> list[_Owned]:
    """Every piece this rank owns: the model params' pieces without an optimizer (a model-only load),
    else the optimizer state's, since the params are then the rounded masters (what was saved as the
    model too). Masters are read as fp32 values and stored in whatever form the optimizer keeps them
    (fp32, fp16, bf16 param + remainder); 16-bit moments are read in their dtype (DCP converts)."""
    if optimizer is None:
        model_pieces = _model_pieces(chunks)
        out = []
        for e in param_entries(chunks):
            if (e.chunk, e.name) in model_pieces:
                view, start = model_pieces[(e.chunk, e.name)]
                out.append(_Owned(f"model/{places[e.key].key}", view.dtype, view.numel(), view.device, e.param.shape,
                                  start, view.copy_, places[e.key]))
        return out
    return [_Owned(f"optim/{s.state}/{places[s.key].key}", s.dtype, s.numel, s.device, s.shape, s.start, s.write,
                   places[s.key]) for s in owned_slices(optimizer)]


def build_load_destination(chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView],
                           scheduler: Optional[Any], load_rank_state: bool,
                           places: dict[str, Placement]) -> dict[str, Any]:
    """Fresh tensors for everything a load reads (one copy of the rank's state): nothing live is
    written until all is read and checked."""
    owned = _owned(chunks, optimizer, places)
    # One allocation per dtype/device, carved into views: a single mapping that goes back to the OS
    # whole when the load returns. Piece-sized allocations landed in the malloc heap, interleaved
    # with DCP's per-item read buffers, and the freed copy stayed resident after the load.
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for o in owned:
        sizes[(o.dtype, o.device)] = sizes.get((o.dtype, o.device), 0) + o.numel
    flat = {k: torch.empty(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
    used = dict.fromkeys(sizes, 0)
    dest: dict[str, Any] = {}
    for o in owned:
        k = (o.dtype, o.device)
        dest[o.key] = ParamChunk(flat[k][used[k] : used[k] + o.numel], o.shape, o.start, o.placement)
        used[k] += o.numel
    if optimizer is not None:
        for m in homed_matrix_state(optimizer):
            dest[matrix_state_key(m, places)] = torch.empty_like(m.tensor)
        dest["optim/scalars"] = None
    if scheduler is not None:
        dest["scheduler"] = None
    dest["run"] = None
    if load_rank_state:
        dest[rank_key()] = None
    return dest


def nonfinite_optimizer_state(dest: dict[str, Any]) -> Optional[str]:
    """'<key> holds non-finite values' for the first read tensor with a NaN or an infinity, else None."""
    bad = first_nonfinite((key, value.flat if isinstance(value, ParamChunk) else value) for key, value in dest.items()
                          if isinstance(value, (ParamChunk, torch.Tensor)))
    return None if bad is None else f"{bad} holds non-finite values"


def apply_loaded_state(dest: dict[str, Any], chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView],
                       scheduler: Optional[Any], places: dict[str, Placement]) -> None:
    """Write what was read into the live model, optimizer and scheduler (after every check passed)."""
    with torch.no_grad():
        for o in _owned(chunks, optimizer, places):
            o.write(dest[o.key].flat)
        if optimizer is None:  # every rank loaded its own part of the params: gather the rest
            for chunk in chunks:
                chunk.start_param_sync(force_sync=True)
                chunk.finish_param_sync()
        else:
            for m in homed_matrix_state(optimizer):
                m.write(dest[matrix_state_key(m, places)])
            optimizer.load_scalar_state(dest["optim/scalars"])
            optimizer.sync_params_from_masters()
    if scheduler is not None:
        scheduler.load_state_dict(dest["scheduler"])


__all__ = ["FORMAT", "as_chunks", "check_optimizer", "is_model_parallel", "model_parallel_sizes", "data_parallel_size",
           "fingerprint", "Staging", "rank_key", "build_save_state", "matrix_state_key", "matrix_state_keys",
           "missing_matrix_state",
           "build_load_destination", "nonfinite_optimizer_state", "apply_loaded_state"]
