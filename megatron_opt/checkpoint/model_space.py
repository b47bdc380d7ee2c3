"""What a checkpoint holds, by name, in model space (independent of the data-parallel layout).

Keys of the DCP state dict:
    model/<param>                 the model param in its dtype and shape; each rank contributes the
                                  part of its own shard (ParamChunk), so no rank writes it all
    optim/<state>/<param>         'master' and the update rule's state, in the param's shape; each
                                  rank contributes the part it owns (ParamChunk)
    optim/scalars                 param-group hyperparameters, update counts, loss scaler, rules
    scheduler, run                the LR schedule; iteration, consumed samples, user extras
    rank/<rank>                   each rank's RNG state and its own extras (e.g. its data position)
With several model chunks (virtual pipeline stages) a param is named ``chunk<c>.<name>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from .. import collectives
from ..distributed.shard_view import GradSource
from .dcp_items import ParamChunk

FORMAT = "megatron_opt.checkpoint/1"


@dataclass(frozen=True)
class ParamEntry:
    chunk: int
    name: str
    key: str  # the name inside the checkpoint
    param: torch.nn.Parameter


def as_chunks(model: Union[GradSource, Sequence[GradSource]]) -> list[GradSource]:
    chunks = [model] if isinstance(model, (GradSource, torch.nn.Module)) else list(model)
    for chunk in chunks:
        if not isinstance(chunk, GradSource):
            raise TypeError(f"megatron_opt.checkpoint needs megatron_opt.DistributedDataParallel model chunks, "
                            f"got {type(chunk).__name__}; wrap the model first.")
    return chunks


def param_entries(chunks: Sequence[GradSource]) -> list[ParamEntry]:
    """Every trainable param of every chunk, in buffer order (the same on every rank)."""
    out = []
    for c, chunk in enumerate(chunks):
        for shard in chunk.local_shards():
            for i in sorted(shard.params):
                name = shard.names[i]
                key = name if len(chunks) == 1 else f"chunk{c}.{name}"
                out.append(ParamEntry(c, name, key, shard.params[i]))
    return out


def state_names(optimizer: Any) -> list[str]:
    """'master' and the update rule's state tensors, in a fixed order."""
    names = ["master"]
    for rule in {type(r).__name__: r for r in _rules(optimizer)}.values():
        names += [n for n in rule.state_dtypes() if n not in names]
    return names


def state_names_of(optimizer: Any, param: torch.nn.Parameter) -> list[str]:
    """'master' and the state of the rule that updates ``param`` (dense or expert-parallel child)."""
    expert = not getattr(param, "allreduce", True)
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(child, "is_expert_parallel", False) == expert:
            return ["master"] + list(child.update_rule.state_dtypes())
    return state_names(optimizer)


def _rules(optimizer: Any) -> list:
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    return [child.update_rule for child in children]


def fingerprint(chunks: Sequence[GradSource], optimizer: Optional[Any]) -> dict[str, Any]:
    """What must match for a load: param names, shapes, dtypes; the optimizer's rules and state."""
    out: dict[str, Any] = {"params": [[e.key, list(e.param.shape), str(e.param.dtype)] for e in param_entries(chunks)]}
    if optimizer is not None:
        out["optimizer"] = {"rules": [r.name for r in _rules(optimizer)], "state": state_names(optimizer)}
    return out


def _pieces_by_param(optimizer: Any, chunks: Sequence[GradSource]) -> dict[tuple[int, str], Any]:
    index = {id(chunk): c for c, chunk in enumerate(chunks)}
    return {(index[id(ps.source)], ps.name): ps for ps in optimizer.piece_states()}


def _model_pieces(chunks: Sequence[GradSource]) -> dict[tuple[int, str], tuple[torch.Tensor, int]]:
    """(chunk, name) -> (this rank's piece of the param, a view of its param-buffer shard; its start)."""
    out = {}
    for c, chunk in enumerate(chunks):
        for shard in chunk.local_shards():
            for pc in shard.pieces:
                view = shard.param[pc.shard_range.start : pc.shard_range.end]
                out[(c, shard.names[pc.param_index])] = (view, pc.param_range.start)
    return out


class _Staging:
    """Reused copy buffers for background saves: the blocking copy then lands in memory that is
    already mapped (fresh allocations would page-fault on every save)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._buffers[key] = torch.empty_like(t)
        return buf.copy_(t)


_staging = _Staging()


def rank_key() -> str:
    return f"rank/{collectives.rank(None)}"


def build_save_state(chunks: Sequence[GradSource], optimizer: Optional[Any], scheduler: Optional[Any],
                     run: dict[str, Any], rank_state: dict[str, Any], snapshot: bool) -> dict[str, Any]:
    """The DCP state dict to save. ``snapshot`` copies every tensor (for a save in the background)."""
    own = (lambda key, t: _staging.copy(key, t.detach())) if snapshot else (lambda key, t: t.detach())
    entries = param_entries(chunks)
    model_pieces = _model_pieces(chunks)
    sd: dict[str, Any] = {}
    for e in entries:
        view, start = model_pieces.get((e.chunk, e.name), (torch.empty(0, dtype=e.param.dtype), 0))
        sd[f"model/{e.key}"] = ParamChunk(own(f"model/{e.key}", view), e.param.shape, start)
    if optimizer is not None:
        pieces = _pieces_by_param(optimizer, chunks)
        for st in state_names(optimizer):
            for e in entries:
                if st not in state_names_of(optimizer, e.param):
                    continue
                ps = pieces.get((e.chunk, e.name))
                key = f"optim/{st}/{e.key}"
                flat = own(key, ps.values(st)) if ps is not None else torch.empty(0, device=e.param.device)
                sd[key] = ParamChunk(flat, e.param.shape, ps.param_start if ps is not None else 0)
        sd["optim/scalars"] = optimizer.scalar_state()
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    sd["run"] = dict(run)
    sd[rank_key()] = rank_state
    return sd


@dataclass(frozen=True)
class _Owned:
    """One piece this rank owns in a load: its key, how it is read (dtype, size) and written back."""

    key: str
    dtype: torch.dtype  # the checkpoint's value dtype (fp32 for masters, whatever their storage)
    numel: int
    device: torch.device
    shape: torch.Size
    start: int
    write: Any  # callable(values): stores the values into the live model / optimizer


def _owned(chunks: Sequence[GradSource], optimizer: Optional[Any]) -> list[_Owned]:
    """Every piece this rank owns: the model params' pieces without an optimizer (a model-only load),
    else the optimizer state's, since the params are then the rounded masters (what was saved as the
    model too). Masters are read as fp32 values and stored in whatever form the optimizer keeps them
    (fp32, fp16, bf16 param + remainder); 16-bit moments are read in their dtype (DCP converts)."""
    entries = param_entries(chunks)
    if optimizer is None:
        model_pieces = _model_pieces(chunks)
        out = []
        for e in entries:
            if (e.chunk, e.name) in model_pieces:
                view, start = model_pieces[(e.chunk, e.name)]
                out.append(_Owned(f"model/{e.key}", view.dtype, view.numel(), view.device, e.param.shape, start,
                                  view.copy_))
        return out
    pieces = _pieces_by_param(optimizer, chunks)
    out = []
    for e in entries:
        ps = pieces.get((e.chunk, e.name))
        if ps is not None:
            for st, t in ps.tensors.items():
                out.append(_Owned(f"optim/{st}/{e.key}", ps.value_dtype(st), t.numel(), t.device, e.param.shape,
                                  ps.param_start, lambda values, ps=ps, st=st: ps.write(st, values)))
    return out


def build_load_destination(chunks: Sequence[GradSource], optimizer: Optional[Any], scheduler: Optional[Any],
                           load_rank_state: bool) -> dict[str, Any]:
    """Fresh tensors for everything a load reads (one copy of the rank's state): nothing live is
    written until all is read and checked."""
    owned = _owned(chunks, optimizer)
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
        dest[o.key] = ParamChunk(flat[k][used[k] : used[k] + o.numel], o.shape, o.start)
        used[k] += o.numel
    if optimizer is not None:
        dest["optim/scalars"] = None
    if scheduler is not None:
        dest["scheduler"] = None
    dest["run"] = None
    if load_rank_state:
        dest[rank_key()] = None
    return dest


# isfinite() makes about 7 bytes of temporaries per element (abs, ==, !=, *): check in small slices,
# so the temporaries reuse the same few hundred KiB instead of raising the load's peak.
_FINITE_CHECK_SLICE = 1 << 16


def nonfinite_optimizer_state(dest: dict[str, Any]) -> Optional[str]:
    for key, value in dest.items():
        if not isinstance(value, ParamChunk):
            continue
        flat = value.flat
        for lo in range(0, flat.numel(), _FINITE_CHECK_SLICE):
            if not torch.isfinite(flat[lo : lo + _FINITE_CHECK_SLICE]).all():
                return f"{key} holds non-finite values"
    return None


def apply_loaded_state(dest: dict[str, Any], chunks: Sequence[GradSource], optimizer: Optional[Any],
                       scheduler: Optional[Any]) -> None:
    """Write what was read into the live model, optimizer and scheduler (after every check passed)."""
    with torch.no_grad():
        for o in _owned(chunks, optimizer):
            o.write(dest[o.key].flat)
        if optimizer is None:  # every rank loaded its own part of the params: gather the rest
            for chunk in chunks:
                chunk.start_param_sync(force_sync=True)
                chunk.finish_param_sync()
        else:
            optimizer.load_scalar_state(dest["optim/scalars"])
            optimizer.sync_params_from_masters()
    if scheduler is not None:
        scheduler.load_state_dict(dest["scheduler"])


__all__ = ["FORMAT", "ParamEntry", "as_chunks", "param_entries", "state_names", "fingerprint", "build_save_state",
           "build_load_destination", "nonfinite_optimizer_state", "apply_loaded_state"]
