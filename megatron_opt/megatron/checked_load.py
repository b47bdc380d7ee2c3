"""Before a dist_checkpointing load: does a dp_reshardable optimizer checkpoint have this run's buckets?

megatron-core's ``dp_reshardable`` format (Megatron-LM's default) stores the distributed optimizer's
state per flat bucket, keyed ``...gbuf_idx_<g>.dtype_<d>.bucket_idx_<k>.<state>`` with the bucket's
length as the tensor's shape. A run whose buckets differ (another ``--ddp-bucket-size``, model or
parallel layout) asks for keys the checkpoint does not have, and torch.distributed.checkpoint fails
with a missing-key error that names neither the cause nor the fix. ``check_bucket_layout`` compares the
bucket keys and lengths a load asks for with the checkpoint's metadata first and raises a
``CheckpointError`` on every rank together, naming both layouts and the two ways out. Megatron-LM calls
``dist_checkpointing.load`` itself; ``megatron_opt.megatron.install()`` puts ``checked(load)`` in its place.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable, Optional

from .. import collectives
from ..errors import CheckpointError
from ..optimizer.state.torch_dist_layouts import FULLY_RESHARDABLE_FLAG
from ..optimizer.state.view import MATRIX_STATE_SPLIT

# prefix (the dp group and buffer), bucket index, state name
_BUCKET_KEY = re.compile(r"^(?P<buffer>.*optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.*)"
                         r"\.bucket_idx_(?P<bucket>\d+)\.(?P<state>[^.]+)$")


class LayerWiseCheckpoint(str):
    """The problem text when the checkpoint's optimizer state is megatron-core's LayerWise format (its own fix)."""


def _layout(lengths: dict[str, int]) -> dict[str, dict[int, int]]:
    """{bucket key: length} -> {buffer prefix: {bucket index: length}}."""
    out: dict[str, dict[int, int]] = {}
    for key, length in lengths.items():
        match = _BUCKET_KEY.match(key)
        if match:
            out.setdefault(match["buffer"], {})[int(match["bucket"])] = length
    return out


# megatron-core's LayerWiseDistributedOptimizer (Megatron-LM's --optimizer muon / adaptive_muon / soap with
# --use-distributed-optimizer) saves its child's state per param, its fp32 masters under this name.
_LAYER_WISE_MASTER = "optimizer.state.fp32_param."


def _saved_keys(checkpoint_dir: str) -> Optional[dict[str, Optional[tuple[int, ...]]]]:
    """{tensor key: shape (None for an object)} of the checkpoint, or None where it is not a torch_dist one."""
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    return {key: (tuple(int(n) for n in item.size) if getattr(item, "size", None) is not None else None)
            for key, item in metadata.state_dict_metadata.items()}


def _layer_wise(prefix: str, saved_keys: dict) -> Optional[str]:
    """A key of megatron-core's LayerWise per-param state under the chained child ``prefix``, if it holds any."""
    return next((k for k in sorted(saved_keys) if k.startswith(prefix + _LAYER_WISE_MASTER)), None)


def _problem(requested: dict[str, int], checkpoint_dir: str) -> Optional[str]:
    saved_keys = _saved_keys(checkpoint_dir)
    if saved_keys is None:
        return None
    saved_lengths = {k: shape[0] for k, shape in saved_keys.items() if shape is not None and len(shape) == 1}
    wanted, saved = _layout(requested), _layout(saved_lengths)
    for buffer, buckets in sorted(wanted.items()):
        have = saved.get(buffer, {})
        lengths_now = [buckets[k] for k in sorted(buckets)]
        lengths_saved = [have[k] for k in sorted(have)]
        if any(have.get(k) != length for k, length in buckets.items()):
            prefix = buffer[:buffer.index("optimizer.distributed.")]
            layer_wise = None if have else _layer_wise(prefix, saved_keys)
            if layer_wise is not None:
                return LayerWiseCheckpoint(
                    f"the optimizer checkpoint in {checkpoint_dir} was saved by megatron-core's "
                    f"LayerWiseDistributedOptimizer (per-param state such as {layer_wise}: Megatron-LM's --optimizer "
                    f"muon / adaptive_muon / soap with --use-distributed-optimizer run by megatron-core), a format "
                    f"megatron_opt does not read. Load the model only (--no-load-optim): the optimizer then starts "
                    f"afresh")
            name = buffer[buffer.index("optimizer.distributed.") + len("optimizer.distributed."):]
            stored = (f"stores buffer {name} as {len(have)} bucket(s) of {lengths_saved} elements" if have
                      else f"holds no dp_reshardable state for buffer {name}")
            return (f"the dp_reshardable optimizer checkpoint in {checkpoint_dir} {stored}, "
                    f"and this run's buffer has {max(buckets) + 1} bucket(s) of {lengths_now} elements (another "
                    f"--ddp-bucket-size, model or tensor / pipeline / expert-parallel layout)")
    return None


def check_bucket_layout(sharded_state_dict: Any, checkpoint_dir: Any) -> None:
    """Raise CheckpointError on every rank together when the dp_reshardable optimizer state that
    ``sharded_state_dict`` asks for is laid out in other buckets in ``checkpoint_dir``; nothing when it
    asks for none, or the checkpoint is not a torch_dist folder. A collective over the default group
    (every rank calls dist_checkpointing.load together)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    requested = {t.key: int(t.global_shape[0]) for t in nested_values(sharded_state_dict)
                 if isinstance(t, ShardedTensor) and len(t.global_shape) == 1 and _BUCKET_KEY.match(t.key)}
    try:
        problem: Any = _problem(requested, str(checkpoint_dir)) if requested else None
    except Exception as exc:  # an unreadable .metadata: every rank hears of it, none waits in the load
        problem = exc
    fix = ("" if isinstance(problem, LayerWiseCheckpoint) else
           f"Save the optimizer in the per-parameter format, which any bucket and parallel layout loads "
           f"(Megatron-LM: {FULLY_RESHARDABLE_FLAG}), or load with the bucket layout it was saved with "
           f"(the same --ddp-bucket-size, model and parallel sizes).")
    collectives.agree("dist_checkpointing.load of the optimizer state", problem, None, error_type=CheckpointError,
                      failure_note=fix)


def _matrix_state_problem(requested: dict[str, tuple[int, ...]], checkpoint_dir: str) -> Optional[str]:
    saved_keys = _saved_keys(checkpoint_dir)
    if saved_keys is None:
        return None
    for key, shape in sorted(requested.items()):
        have = saved_keys.get(key)
        if have != shape:
            stored = f"stores it as {have}" if have is not None else "does not hold it"
            return f"the optimizer checkpoint in {checkpoint_dir} {stored}, and this run asks for {key} as {shape}: " \
                   f"{MATRIX_STATE_SPLIT}"
    return None


def check_matrix_state_layout(sharded_state_dict: Any, checkpoint_dir: Any) -> None:
    """Raise CheckpointError on every rank together when the per-matrix state (``optimizer.matrix_state.*``) that
    ``sharded_state_dict`` asks for is not in ``checkpoint_dir`` at the same global shape (another tensor-parallel
    split, another optimizer); nothing when it asks for none. A collective over the default group."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    requested = {t.key: tuple(int(n) for n in t.global_shape) for t in nested_values(sharded_state_dict)
                 if isinstance(t, ShardedTensor) and ".matrix_state." in t.key}
    try:
        problem: Any = _matrix_state_problem(requested, str(checkpoint_dir)) if requested else None
    except Exception as exc:  # an unreadable .metadata: every rank hears of it, none waits in the load
        problem = exc
    collectives.agree("dist_checkpointing.load of the per-matrix optimizer state", problem, None,
                      error_type=CheckpointError,
                      failure_note="To go on at another split, load the model without the optimizer state "
                                   "(--no-load-optim): the optimizer then starts afresh.")


def checked(load: Callable) -> Callable:
    """``load`` (megatron-core's dist_checkpointing.load), refusing by name on every rank a dp_reshardable
    optimizer checkpoint laid out in other buckets than the state dict asks for, and per-matrix state of another
    tensor-parallel split."""
    @functools.wraps(load)
    def load_after_checking(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        check_bucket_layout(sharded_state_dict, checkpoint_dir)
        check_matrix_state_layout(sharded_state_dict, checkpoint_dir)
        return load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    return load_after_checking


__all__ = ["check_bucket_layout", "check_matrix_state_layout", "checked"]
