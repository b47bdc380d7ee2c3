"""Where this rank's optimizer state goes in megatron-core's two distributed-optimizer checkpoint
formats (megatron.core.dist_checkpointing ShardedTensors), and where it comes back from.

    fully_reshardable   per parameter, in model space: ``optimizer.state.<state>.<model key>`` with the
                        model ShardedTensor's key, global shape, offsets (TP, the layer axis) and
                        replica id. Each rank writes only the elements it owns, as rectangular boxes
                        of the param's shape (no gather), so any layout can read any region back.
    dp_reshardable      per bucket, in megatron-core's flat-buffer layout:
                        ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<d>.bucket_idx_<k>.<state>``,
                        a 1-D tensor of the bucket's unpadded length. Written only where this
                        optimizer's buckets hold their params where megatron-core's would.

megatron-core is imported inside the functions: the package imports without it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ...distributed.shard_view import LocalShard
from ...errors import UnsupportedConfigError
from .boxes import flat_range_to_boxes
from .view import MASTER, MatrixStateTensor, OptimizerStateView, StateSlice, homed_matrix_state, owned_slices

FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"
MEGATRON_PARAM_ALIGN = 64  # megatron-core's _pad_start_of_param_if_needed (distributed optimizer)
TAG = "megatron_opt_at"  # a LocalNonpersistentObject beside each tensor: where its values go (never saved)


def megatron_state_name(state: str) -> str:
    """megatron-core names the fp32 master 'param'; the update rule's state keeps its name."""
    return "param" if state == MASTER else state


def _values(s: StateSlice, is_loading: bool) -> torch.Tensor:
    """The fp32 values of slice ``s`` (megatron-core stores every state in fp32), or a fresh buffer to load into."""
    if is_loading:
        return torch.empty(s.numel, dtype=torch.float32, device=s.device)
    return s.values().detach().to(torch.float32)


# ----------------------------------------------------------------------------- fully_reshardable
@dataclass(frozen=True)
class ModelSpaceTarget:
    """One model-space tensor a param's elements land in: a ShardedTensor without data, and where in
    the flattened param its (row-major, contiguous) elements start."""

    tensor: Any  # megatron.core.dist_checkpointing.ShardedTensor (data=None)
    param_start: int
    numel: int


def model_params_by_identity(model_sharded_state_dict: Any) -> dict[int, Any]:
    """id(param) -> its ShardedTensor or ShardedTensorFactory in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict or {})
    return {id(base.data): base for base in nested_values(sharded)}


def model_space_targets(base: Any, key: str, replica_id: Any) -> list[ModelSpaceTarget]:
    """The tensors ``base`` (the model's ShardedTensor or factory of a param) stores the param as,
    keyed ``key``. A factory (e.g. SwiGLU's fc1, split in two halves each sharded over TP) is built
    on a tensor of element indices to find where each element goes."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(base, ShardedTensor):
        return [ModelSpaceTarget(replace(base, key=key, data=None, dtype=torch.float32, replica_id=replica_id), 0,
                        base.data.numel())]
    if not isinstance(base, ShardedTensorFactory):
        raise TypeError(f"{type(base).__name__} is not a ShardedTensor or ShardedTensorFactory")
    index = torch.arange(base.data.numel()).view(base.data.shape)
    out = []
    for built in nested_values(base.build_fn(key, index, replica_id, None)):
        if not isinstance(built, ShardedTensor):
            raise ValueError(f"the sharded state dict factory of {base.key} builds a {type(built).__name__}; "
                             f"megatron_opt maps optimizer state through factories that build ShardedTensors only")
        flat = built.data.reshape(-1)
        first = int(flat[0]) if flat.numel() else 0
        if not torch.equal(flat, torch.arange(first, first + flat.numel())):
            raise ValueError(f"the sharded state dict factory of {base.key} reorders the param's elements within "
                             f"{built.key}; megatron_opt maps optimizer state only through row-major slices")
        out.append(ModelSpaceTarget(replace(built, data=None, dtype=torch.float32), first, flat.numel()))
    return out


def optimizer_replica_id(model_replica_id: Any, instance: int) -> Any:
    """A piece of optimizer state is held by one rank of each optimizer instance: the model's replica
    id (pipeline, tensor-parallel duplicates) with the data-parallel coordinate replaced by the instance."""
    if isinstance(model_replica_id, tuple) and len(model_replica_id) == 3:
        return (*model_replica_id[:2], instance)
    return instance


def model_space_tensors(base: Any, prefix: str, values: torch.Tensor, start: int,
                        replica_id: Any) -> dict[int, dict[str, Any]]:
    """ShardedTensors holding ``values`` (elements [start, start + len) of the flattened param whose
    model entry is ``base``), one per rectangular box, each beside a tag: its first element in ``values``."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    out: dict[int, dict[str, Any]] = {}
    end = start + values.numel()
    for target in model_space_targets(base, prefix + base.key, replica_id):
        lo, hi = max(start, target.param_start), min(end, target.param_start + target.numel)
        if lo >= hi:
            continue
        t = target.tensor
        p = t.prepend_axis_num
        for box in flat_range_to_boxes(t.local_shape, lo - target.param_start, hi - target.param_start):
            at = target.param_start + box.flat_start - start
            # Prepended axes (the stacked layer axis) become leading singleton axes of the box itself:
            # dist_checkpointing writes unevenly sharded tensors without expanding prepend_axis_num.
            sizes = (1,) * p + tuple(box.sizes)
            data = values[at : at + box.numel].view(sizes)
            offset = tuple(t.global_offset[:p]) + tuple(o + b for o, b in zip(t.global_offset[p:], box.offsets))
            out[len(out)] = {"data": ShardedTensor(t.key, data, torch.float32, sizes, t.global_shape, offset, None,
                                                   t.replica_id, 0, t.allow_shape_mismatch),
                             TAG: LocalNonpersistentObject(at)}
    return out


def fully_reshardable_state(view: OptimizerStateView, params: dict[int, Any], instance: int,
                            is_loading: bool) -> dict[int, dict[str, Any]]:
    """{param index: {'key': tag, state: {box: {'data': ShardedTensor, tag}}}} for every param this rank
    owns a piece of."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    by_param: dict[str, list[StateSlice]] = {}
    for s in owned_slices(view):
        by_param.setdefault(s.key, []).append(s)
    out: dict[int, dict[str, Any]] = {}
    for key, slices in by_param.items():
        param = slices[0].piece.param
        base = params.get(id(param))
        if base is None:
            raise ValueError(f"param {key} is not in the model's sharded state dict: pass the sharded state dict "
                             f"of the model chunks this optimizer was built over (megatron-core's modules build it "
                             f"with keep_vars=True, so its tensors are the params themselves)")
        entry: dict[str, Any] = {"key": LocalNonpersistentObject(key)}
        replica_id = optimizer_replica_id(base.replica_id, instance)
        for s in slices:
            name = megatron_state_name(s.state)
            entry[name] = model_space_tensors(base, f"optimizer.state.{name}.", _values(s, is_loading), s.start,
                                              replica_id)
        out[len(out)] = entry
    return out


def _block_of(base: Any) -> Any:
    """The ShardedTensor that places this rank's block of a param (a factory's first built tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return base if isinstance(base, ShardedTensor) else model_space_targets(base, base.key, base.replica_id)[0].tensor


def matrix_state_entries(view: OptimizerStateView, params: dict[int, Any], instance: int,
                         is_loading: bool) -> dict[str, Any]:
    """{'<state>|<param key>': ShardedTensor} for the per-matrix state (SOAP's) of every matrix homed on this
    rank. Each is keyed by its param's model-space key and placed, whole, at its block's coordinates in the
    param's grid of blocks (stacked layer / expert axes and tensor-parallel slices): any data-parallel size
    loads it; another tensor-parallel split has another grid, which dist_checkpointing refuses by shape."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out: dict[str, Any] = {}
    for m in homed_matrix_state(view):
        base = params.get(id(m.param))
        if base is None:
            raise ValueError(f"param {m.key} is not in the model's sharded state dict: pass the sharded state dict "
                             f"of the model chunks this optimizer was built over")
        block = _block_of(base)
        grid = []
        for axis, (offset, size) in enumerate(zip(block.global_offset, block.global_shape)):
            if axis < block.prepend_axis_num:
                local = 1
            else:  # the state's block of the TP-local param (the whole of it unless matrix_state_tp_size cuts it)
                local = m.shape[axis - block.prepend_axis_num]
                offset += m.offset[axis - block.prepend_axis_num]
            grid.append((axis, offset // local, max(1, size // local)))
        data = torch.empty_like(m.tensor) if is_loading else m.tensor.detach()
        out[f"{m.state}|{m.block_key}"] = ShardedTensor.from_rank_offsets(
            f"optimizer.matrix_state.{m.state}.{block.key}", data, *grid,
            replica_id=optimizer_replica_id(block.replica_id, instance), prepend_axis_num=len(grid))
    return out


def read_matrix_state(view: OptimizerStateView, loaded: Any) -> list[tuple[MatrixStateTensor, torch.Tensor]]:
    """The loaded per-matrix state of every matrix homed on this rank; ValueError when the state dict lacks some."""
    out = []
    for m in homed_matrix_state(view):
        value = (loaded or {}).get(f"{m.state}|{m.block_key}")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(m.tensor.shape):
            raise ValueError(f"the optimizer state dict holds no per-matrix state '{m.state}' of {m.key} (this "
                             f"optimizer's {type(view).__name__} keeps it: a whole-tensor rule's state, e.g. SOAP's); "
                             f"load a checkpoint saved by the same optimizer at the same tensor-parallel split")
        out.append((m, value))
    return out


def read_fully_reshardable(view: OptimizerStateView, param_state: dict) -> list[tuple[StateSlice, torch.Tensor]]:
    """The loaded values of every slice this rank owns; ValueError when the state dict misses any."""
    loaded: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for entry in param_state.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise ValueError("the fully_reshardable param_state was not built by this optimizer's "
                             "sharded_state_dict(..., is_loading=True): build the load template with it")
        for name, boxes in entry.items():
            if name == "key":
                continue
            loaded[(entry["key"], name)] = [(int(b[TAG]), b["data"]) for b in boxes.values()]
    out = []
    for s in owned_slices(view):
        boxes = loaded.get((s.key, megatron_state_name(s.state)))
        if boxes is None:
            raise ValueError(f"the state dict has no '{megatron_state_name(s.state)}' of {s.key}, which this rank owns")
        values = torch.empty(s.numel, dtype=torch.float32, device=s.device)
        covered = 0
        for at, data in boxes:
            values[at : at + data.numel()].copy_(data.reshape(-1))
            covered += data.numel()
        if covered != s.numel:
            raise ValueError(f"the state dict holds {covered} of the {s.numel} elements of "
                             f"'{megatron_state_name(s.state)}' of {s.key} this rank owns")
        out.append((s, values))
    return out


# ----------------------------------------------------------------------------- dp_reshardable
@dataclass(frozen=True)
class BucketPlace:
    """One bucket of this rank in megatron-core's dp_reshardable layout."""

    gbuf: int  # megatron-core's gbuf_idx: the optimizer's buffers, model chunk by model chunk
    dtype: tuple[torch.dtype, torch.dtype]  # (param dtype, grad dtype)
    bucket: int
    shard: LocalShard
    unpadded: int  # the bucket's length without its end padding: the checkpoint tensor's length
    lo: int  # this rank's range [lo, hi) of that tensor
    hi: int


def _megatron_offsets(shard: LocalShard) -> tuple[dict[int, int], int]:
    """Where megatron-core's buffer puts each param of this bucket, relative to the bucket's start
    (params in reverse registration order, each start padded to 64 elements), and the bucket's
    unpadded length."""
    offsets, cursor = {}, 0
    for i in sorted(shard.params, reverse=True):
        start = -(-cursor // MEGATRON_PARAM_ALIGN) * MEGATRON_PARAM_ALIGN
        offsets[i] = start
        cursor = start + shard.params[i].numel()
    return offsets, cursor


def bucket_places(view: OptimizerStateView, expert_parallel: bool) -> list[BucketPlace]:
    """This rank's buckets in megatron-core's dp_reshardable layout. UnsupportedConfigError (naming
    the flag that writes the fully reshardable format instead) where a param is not where
    megatron-core's buffer would put it."""
    out: list[BucketPlace] = []
    gbuf = 0
    for chunk in view.model_chunks:
        buffers: dict[int, list[LocalShard]] = {}
        for shard in chunk.local_shards(expert_parallel):
            buffers.setdefault(shard.buffer_index, []).append(shard)
        for shards in buffers.values():
            for bucket, shard in enumerate(shards):
                offsets, unpadded = _megatron_offsets(shard)
                base = shard.rank * shard.numel
                for piece in shard.pieces:
                    ours = base + piece.shard_range.start - piece.param_range.start
                    if ours != offsets[piece.param_index]:
                        raise UnsupportedConfigError(
                            f"the dp_reshardable optimizer checkpoint format stores the distributed optimizer's "
                            f"flat buckets as megatron-core lays them out, and megatron_opt's bucket "
                            f"{bucket} of buffer {gbuf} holds param {shard.names[piece.param_index]} at element "
                            f"{ours}, not {offsets[piece.param_index]}: save the optimizer in the per-parameter "
                            f"format instead (Megatron-LM: {FULLY_RESHARDABLE_FLAG}; metadata "
                            f"distrib_optim_sharding_type='{FULLY_RESHARDABLE}'), which any layout loads")
                lo, hi = base, min(base + shard.numel, unpadded)
                out.append(BucketPlace(gbuf, (shard.param.dtype, shard.grad.dtype), bucket, shard, unpadded, lo,
                                       max(lo, hi)))
            gbuf += 1
    return out


def bucket_key(prefix: str, place: BucketPlace, state: str) -> str:
    return f"{prefix}.gbuf_idx_{place.gbuf}.dtype_{place.dtype}.bucket_idx_{place.bucket}.{state}"


def bucket_numels(places: Sequence[BucketPlace], unpadded: bool) -> list[dict]:
    """megatron-core's per_bucket_numel(_unpadded): per buffer, {(param dtype, grad dtype): [numel per bucket]}."""
    out: list[dict] = []
    for place in places:
        while len(out) <= place.gbuf:
            out.append({})
        numel = place.unpadded if unpadded else place.shard.numel * place.shard.shard_count
        out[place.gbuf].setdefault(place.dtype, []).append(numel)
    return out


def _pieces_in(place: BucketPlace,
               slices: dict[tuple[int, str], list[StateSlice]]) -> list[tuple[int, StateSlice]]:
    """(position in the bucket tensor relative to ``place.lo``, slice) for every owned state slice of the bucket."""
    offsets, _ = _megatron_offsets(place.shard)
    out = []
    for piece in place.shard.pieces:
        param = place.shard.params[piece.param_index]
        for s in slices.get((id(param), piece.param_range.start), []):
            out.append((offsets[piece.param_index] + piece.param_range.start - place.lo, s))
    return out


def _slices_by_piece(view: OptimizerStateView) -> dict[tuple[int, int], list[StateSlice]]:
    out: dict[tuple[int, int], list[StateSlice]] = {}
    for s in owned_slices(view):
        out.setdefault((id(s.piece.param), s.start), []).append(s)
    return out


def dp_reshardable_state(view: OptimizerStateView, places: Sequence[BucketPlace], prefix: str,
                         state_names: Sequence[str], is_loading: bool) -> dict:
    """{gbuf: {bucket: {state: ShardedTensor}}}: this rank's range of each bucket tensor (its params'
    state at megatron-core's positions, zeros in the alignment gaps)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    slices = _slices_by_piece(view)
    out: dict = {}
    for place in places:
        if place.hi <= place.lo:  # this rank's range is all end padding
            continue
        entry = {}
        pieces = _pieces_in(place, slices)
        for state in state_names:
            name = megatron_state_name(state)
            device = place.shard.grad.device
            if is_loading:
                flat = torch.empty(place.hi - place.lo, dtype=torch.float32, device=device)
            else:
                flat = torch.zeros(place.hi - place.lo, dtype=torch.float32, device=device)
                for at, s in pieces:
                    if s.state == state:
                        flat[at : at + s.numel].copy_(s.values())
            # At load a bucket of another length reads what overlaps (instead of failing inside
            # dist_checkpointing): the lengths are then compared, with a clear error (read_dp_reshardable's caller).
            entry[name] = ShardedTensor(bucket_key(prefix, place, name), flat, torch.float32, (flat.numel(),),
                                        (place.unpadded,), (place.lo,), None, (place.shard.instance_rank, 0, 0),
                                        allow_shape_mismatch=is_loading)
        out.setdefault(place.gbuf, {})[place.bucket] = entry
    return out


def read_dp_reshardable(view: OptimizerStateView, places: Sequence[BucketPlace],
                        param_state: dict) -> list[tuple[StateSlice, torch.Tensor]]:
    """The loaded values of every slice this rank owns, from a dp_reshardable state dict built by
    dp_reshardable_state(is_loading=True) and filled by dist_checkpointing.load."""
    slices = _slices_by_piece(view)
    out = []
    for place in places:
        if place.hi <= place.lo:
            continue
        entry = param_state.get(place.gbuf, {}).get(place.bucket)
        for at, s in _pieces_in(place, slices):
            flat = None if entry is None else entry.get(megatron_state_name(s.state))
            if not isinstance(flat, torch.Tensor) or flat.numel() != place.hi - place.lo:
                raise ValueError(f"the dp_reshardable state dict has no '{megatron_state_name(s.state)}' of bucket "
                                 f"{place.bucket} of buffer {place.gbuf}: build the load template with this "
                                 f"optimizer's sharded_state_dict(..., is_loading=True)")
            out.append((s, flat[at : at + s.numel]))
    return out


__all__ = ["FULLY_RESHARDABLE", "DP_RESHARDABLE", "FULLY_RESHARDABLE_FLAG", "megatron_state_name",
           "model_params_by_identity", "ModelSpaceTarget", "model_space_targets", "optimizer_replica_id",
           "model_space_tensors", "fully_reshardable_state", "read_fully_reshardable", "BucketPlace", "bucket_places",
           "bucket_key", "bucket_numels", "dp_reshardable_state", "read_dp_reshardable"]
