"""Where each param of this rank sits in the checkpoint: its name there, global shape, offsets, and
whether this rank's copy is the one written.

    local          (data parallelism) a param is named by its local name (``chunk<c>.<name>`` with
                   several chunks), in its own shape: the format megatron_opt.checkpoint always wrote.
    megatron_core  (model chunks that are megatron-core modules) the param's ShardedTensor in the
                   module's ``sharded_state_dict()`` gives it: the global key (a stacked layer / expert
                   axis as a suffix: ``decoder.layers.self_attention.linear_qkv.weight[1]`` for global
                   layer 1, whichever pipeline stage holds it), the global shape and this rank's
                   offsets in it (tensor-parallel slices), and the replica id: a tensor-parallel
                   duplicate or the last pipeline stage's tied copy of the embedding (a non-main
                   replica) is read at load but never written, so every element is stored once.
                   A checkpoint in this form loads at any TP / PP / DP layout of the same model.

A save at data parallelism writes local; a model-parallel optimizer's, megatron_core (local names would
collide across TP ranks and PP stages); a load reads the form the manifest's 'param_keys' names, so a
TP/PP checkpoint loads at TP1/PP1 (over megatron-core modules) too.
megatron-core is imported inside the functions: the package imports without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import collectives
from ..distributed.shard_view import GradSource
from ..errors import CheckpointError
from ..optimizer.state.view import model_fingerprint, param_entries

LOCAL = "local"
MEGATRON_CORE = "megatron_core"
MODEL_PARALLEL_FIX = ("megatron_opt.checkpoint saves a model-parallel (tensor/pipeline) optimizer only over "
                      "megatron-core modules, whose sharded_state_dict() gives each param its global key, shape "
                      "and offsets; use megatron-core's modules (or save through Megatron-LM's torch_dist "
                      "checkpoint: optimizer.sharded_state_dict with distrib_optim_sharding_type='fully_reshardable')")


@dataclass(frozen=True)
class Piece:
    """A row-major block of this rank's param that lies in one place of the global tensor."""

    flat_start: int  # its first element in the flattened param
    shape: torch.Size  # its shape
    offset: tuple[int, ...]  # where it starts in the global tensor, per dimension

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class Placement:
    """One param of this rank in the checkpoint: usually one piece (the whole param at its offsets);
    SwiGLU's fc1 is two (its gate and up halves, each sliced over tensor parallelism on its own)."""

    key: str  # its name in the checkpoint (without the 'model/' or 'optim/<state>/' prefix)
    shape: torch.Size  # the global shape
    pieces: tuple[Piece, ...]
    written: bool  # this rank's copy is the one saved (False: a TP duplicate or a tied copy)


def whole(key: str, shape: torch.Size, offset: tuple[int, ...], global_shape: torch.Size, written: bool) -> Placement:
    """A param that is one block of its global tensor."""
    return Placement(key, torch.Size(global_shape), (Piece(0, torch.Size(shape), tuple(offset)),), written)


def _module(chunk: GradSource) -> Any:
    return getattr(chunk, "module", None)


def megatron_core_available(chunks: Sequence[GradSource]) -> bool:
    """Every chunk wraps a module with megatron-core's ``sharded_state_dict``."""
    return bool(chunks) and all(callable(getattr(_module(c), "sharded_state_dict", None)) for c in chunks)


def default_kind(chunks: Sequence[GradSource], model_parallel: bool) -> str:
    """What a save writes: local at data parallelism (the format's names and shapes unchanged, so
    export() and older checkpoints keep theirs), megatron_core for a model-parallel optimizer over
    megatron-core modules; refused for other model-parallel modules."""
    if not model_parallel:
        return LOCAL
    if not megatron_core_available(chunks):
        raise CheckpointError(f"the model chunks ({type(_module(chunks[0])).__name__}) have no sharded_state_dict(): "
                              f"{MODEL_PARALLEL_FIX}.")
    return MEGATRON_CORE


def _is_written(replica_id: Any) -> bool:
    """The main replica across model parallelism (the data-parallel coordinate, last, is ignored: each
    data-parallel rank writes the elements its optimizer owns)."""
    if isinstance(replica_id, tuple):
        return all(r == 0 for r in replica_id[:-1])
    return True


def _megatron_core_placement(local_key: str, base: Any) -> Placement:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from ..optimizer.state.torch_dist_layouts import model_space_targets

    plain = isinstance(base, ShardedTensor) and base.flattened_range is None
    targets = model_space_targets(base, base.key, base.replica_id) if plain or isinstance(
        base, ShardedTensorFactory) else []
    first = targets[0].tensor if targets else None
    p = first.prepend_axis_num if first is not None else 0
    if not targets or any(t.tensor.key != first.key or t.tensor.prepend_axis_num != p or
                          tuple(t.tensor.global_offset[:p]) != tuple(first.global_offset[:p]) for t in targets):
        what = "is not in" if base is None else f"is a {type(base).__name__} in"
        raise CheckpointError(f"param {local_key} {what} its module's sharded_state_dict() in a form "
                              f"megatron_opt.checkpoint can place (a ShardedTensor, or a factory that slices it "
                              f"into blocks of one tensor, as SwiGLU's fc1): save this model through "
                              f"Megatron-LM's torch_dist checkpoint (optimizer.sharded_state_dict, "
                              f"'fully_reshardable') instead")
    # A stacked axis (the layer, the expert) becomes part of the name: one tensor per layer, as each
    # layer is a param of its own (a rank holds several layers of one ShardedTensor key).
    key = first.key if p == 0 else f"{first.key}[{','.join(str(i) for i in first.global_offset[:p])}]"
    pieces = tuple(Piece(t.param_start, torch.Size(t.tensor.local_shape), tuple(t.tensor.global_offset[p:]))
                   for t in targets)
    return Placement(key, torch.Size(first.global_shape[p:]), pieces, _is_written(base.replica_id))


def _megatron_core_placements(chunks: Sequence[GradSource]) -> dict[str, Placement]:
    from ..optimizer.state.torch_dist_layouts import model_params_by_identity

    by_id: dict[int, Any] = {}
    for chunk in chunks:
        by_id.update(model_params_by_identity(_module(chunk).sharded_state_dict()))
    out = {e.key: _megatron_core_placement(e.key, by_id.get(id(e.param))) for e in param_entries(chunks)}
    first_with: dict[str, str] = {}
    for local_key, place in out.items():
        other = first_with.setdefault(place.key, local_key)
        if other != local_key:  # a save would write one over the other; a load would wait in DCP
            raise CheckpointError(f"params {other!r} and {local_key!r} both have the global key {place.key!r} in "
                                  f"their modules' sharded_state_dict(); each param needs a key of its own (check "
                                  f"the modules' sharded_state_dict, e.g. a stacked layer or expert axis left out)")
    return out


def placements(chunks: Sequence[GradSource], kind: str, model_parallel: bool) -> dict[str, Placement]:
    """Placement of every param entry (by its local key) in checkpoint form ``kind``; CheckpointError
    (with the fix) where that form cannot hold this model."""
    if kind == MEGATRON_CORE:
        if not megatron_core_available(chunks):
            raise CheckpointError("the checkpoint names params by megatron-core's global keys, and these model chunks "
                                  "have no sharded_state_dict(): load it into megatron-core modules")
        return _megatron_core_placements(chunks)
    if kind != LOCAL:
        raise CheckpointError(f"unknown param naming {kind!r} in the checkpoint (a newer megatron_opt wrote it?)")
    if model_parallel:
        raise CheckpointError(f"the checkpoint names params locally (saved at data parallelism only, or over modules "
                              f"without sharded_state_dict()), which cannot place them in this tensor/pipeline-"
                              f"parallel model; {MODEL_PARALLEL_FIX}.")
    return {e.key: whole(e.key, e.param.shape, (0,) * e.param.dim(), e.param.shape, True)
            for e in param_entries(chunks)}


def fingerprint_params(chunks: Sequence[GradSource], kind: str, places: dict[str, Placement]) -> list[list]:
    """[key, global shape, dtype] of every param of the whole model, sorted: with megatron_core, the union
    over all ranks (a collective over the default group)."""
    if kind == LOCAL:
        return model_fingerprint(chunks)
    mine = sorted({(places[e.key].key, tuple(places[e.key].shape), str(e.param.dtype)) for e in param_entries(chunks)})
    if collectives.world_size(None) > 1:
        import torch.distributed as dist

        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        mine = sorted({tuple(item) for part in parts for item in part})
    return [[k, list(shape), dtype] for k, shape, dtype in mine]


__all__ = ["LOCAL", "MEGATRON_CORE", "Piece", "Placement", "whole", "megatron_core_available", "default_kind",
           "placements", "fingerprint_params"]
