"""Megatron-LM's torch_dist optimizer checkpoint: ``sharded_state_dict`` and ``load_state_dict`` in
megatron-core's two distributed-optimizer formats (state/torch_dist_layouts.py says where the tensors go).

Megatron-LM's ``generate_state_dict`` calls ``optimizer.sharded_state_dict(state_dict, is_loading,
metadata=...)`` with ``metadata['distrib_optim_sharding_type']`` = ``'fully_reshardable'`` (with
``--dist-ckpt-optim-fully-reshardable``) or ``'dp_reshardable'`` (its default), saves or loads it with
``megatron.core.dist_checkpointing``, and passes the loaded dict to ``optimizer.load_state_dict``.
The dict of one DistributedOptimizer is megatron-core's::

    optimizer                 {'param_groups': [...]} (each group with 'step', the update count, and
                              torch's hyperparameter names), plus 'megatron_opt': scalar_state() (the
                              per-leaf update counts, loss scaler, skipped steps, rules); megatron-core
                              reads only 'param_groups'
    grad_scaler               the loss scaler's state_dict (when there is a loss scaler)
    param_state               the tensors (state/torch_dist_layouts.py)
    param_state_sharding_type the format

With dp_reshardable the first two are ShardedObjects per data-parallel group, as megatron-core writes
them. A ChainedOptimizer with one child is that child's dict; with several, ``{index: child dict}``
(keys prefixed ``chained_<i>.`` unless ``metadata['chained_optim_avoid_prefix']`` and a fully
reshardable format), as megatron-core's ChainedOptimizer.

megatron-core is imported inside the functions: the package imports without it.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ... import collectives
from ...errors import UnsupportedConfigError
from . import torch_dist_layouts as layouts
from .view import first_nonfinite

_LOG = logging.getLogger("megatron_opt")

SHARDING_TYPE = "distrib_optim_sharding_type"
# megatron-core's param_group_identifier_keys: how a saved param group finds its group at load.
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
FULLY_RESHARDABLE_FORMATS = ("fully_reshardable", "fully_sharded_model_space")  # megatron-core's set


def children(optimizer: Any) -> list:
    """The DistributedOptimizers of ``optimizer`` (a chain's, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def sharding_type(metadata: Optional[dict]) -> str:
    """The format ``metadata`` asks for. Without one, fully_reshardable: megatron-core 0.16.1's own
    default ('fully_sharded_model_space') needs flattened ShardedTensors, which it no longer supports."""
    kind = (metadata or {}).get(SHARDING_TYPE, layouts.FULLY_RESHARDABLE)
    if kind not in (layouts.FULLY_RESHARDABLE, layouts.DP_RESHARDABLE):
        raise UnsupportedConfigError(
            f"optimizer sharded_state_dict: the distributed-optimizer checkpoint format {kind!r} is not supported by "
            f"megatron_opt; it writes '{layouts.FULLY_RESHARDABLE}' (Megatron-LM: {layouts.FULLY_RESHARDABLE_FLAG}; "
            f"loadable at any parallel layout) and '{layouts.DP_RESHARDABLE}' (Megatron-LM's default).")
    return kind


# ----------------------------------------------------------------------------- scalar state
def common_state(child: Any) -> dict[str, Any]:
    """What megatron-core's DistributedOptimizer.state_dict() returns, plus megatron_opt's scalar state."""
    leaf = child.state_leaves()[0]
    step = int(leaf.step.item())
    extra = leaf.rule.torch_group_fields()  # the inner optimizer's param-group fields, as the rule declares them
    groups = [{**extra, **{k: v for k, v in g.items() if k != "params"}, "step": step} for g in child.param_groups]
    out: dict[str, Any] = {"optimizer": {"param_groups": groups, "megatron_opt": child.scalar_state()}}
    if child.grad_scaler is not None:
        out["grad_scaler"] = child.grad_scaler.state_dict()
    return out


def _identity(group: dict) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in GROUP_IDENTITY)


def _matched_groups(optimizer: Any, saved_groups: list[dict]) -> list[dict]:
    """``optimizer``'s param groups (without 'params') holding the values of the saved group with the
    same megatron-core identity key; a group the checkpoint lacks keeps its own values, as its lr and
    weight decay come from the schedule."""
    by_identity: dict[tuple, dict] = {}
    for g in saved_groups:
        by_identity.setdefault(_identity(g), g)
    return [{k: by_identity.get(_identity(g), {}).get(k, v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _one_update_count(steps: list[int], leaves: int) -> list[int]:
    """The saved update counts, written by a chain split into other leaves, given to each of ``leaves``:
    the one count they share. ValueError when they disagree (no leaf can then be told which is its own)."""
    counts = sorted(set(steps))
    if len(counts) > 1:
        raise ValueError(f"the checkpoint's optimizer parts disagree on the update count ({counts}) and this "
                         f"optimizer is split into other parts ({leaves}): load it in the layout that saved it "
                         f"(the same expert-parallel split)")
    return counts * leaves


def regrouped_scalar_state(optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (a scalar_state() of this model's optimizer in another layout, whose chain had other
    leaves and groups: e.g. the experts' own at expert parallelism) fitted to ``optimizer``: param
    groups matched by identity, the one update count on every leaf (ValueError when they disagree)."""
    own_steps = optimizer.scalar_state()["steps"]
    steps = _one_update_count([int(s) for s in saved["steps"]], len(own_steps)) if saved["steps"] else own_steps
    return {**saved, "param_groups": _matched_groups(optimizer, saved["param_groups"]), "steps": steps}


def scalar_state_from(child: Any, common: dict) -> dict[str, Any]:
    """The scalar_state() to load into ``child`` from a loaded common state: saved param groups matched
    by identity, the update count, the loss scaler."""
    inner = common.get("optimizer")
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise ValueError("the optimizer state dict has no 'optimizer' / 'param_groups' (megatron-core's "
                         "DistributedOptimizer.state_dict() part)")
    ours = inner.get("megatron_opt")
    groups = _matched_groups(child, ours["param_groups"] if ours else inner["param_groups"])
    if ours:
        steps = [int(s) for s in ours["steps"]]
        skipped = int(ours.get("skipped_steps", 0))
        leaves = len(child.scalar_state()["steps"])
        if len(steps) != leaves:
            steps = _one_update_count(steps, leaves)
    else:  # written by megatron-core: the update count rides in every param group
        counts = {int(g["step"]) for g in inner["param_groups"] if g.get("step") is not None}
        if len(counts) > 1:
            raise ValueError(f"the checkpoint's param groups disagree on the update count: {sorted(counts)}")
        steps, skipped = [counts.pop() if counts else 0], child.skipped_steps
    scaler = common.get("grad_scaler") if child.grad_scaler is not None else None
    return {"param_groups": groups, "steps": steps, "grad_scaler": scaler, "skipped_steps": skipped}


# ----------------------------------------------------------------------------- building
def _shards(child: Any) -> list:
    leaf = child.state_leaves()[0]
    return [s for chunk in child.model_chunks for s in chunk.local_shards(leaf.expert_parallel)]


def _dp_group_idx(child: Any, expert: bool) -> int:
    """megatron-core's data_parallel_group_idx: the rank in the model-parallel group (TP x PP; the
    expert TP x PP group for expert params), 0 at data parallelism only."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group() if expert
                     else parallel_state.get_model_parallel_group())
            return collectives.rank(group)
    except ImportError:
        pass
    group = getattr(child, "model_parallel_group", None)
    return collectives.rank(group) if group is not None else 0


def child_sharded_state_dict(child: Any, model_sharded_state_dict: Any, is_loading: bool, kind: str) -> dict:
    """One DistributedOptimizer's sharded state dict in format ``kind``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    leaf = child.state_leaves()[0]
    shards = _shards(child)
    instance = shards[0].instance_rank if shards else 0
    common = common_state(child)
    with_matrix_state = any(leaf.matrix_state for leaf in child.state_leaves())  # a whole-tensor rule's (SOAP's)
    params = (layouts.model_params_by_identity(model_sharded_state_dict)
              if kind == layouts.FULLY_RESHARDABLE or with_matrix_state else {})
    if kind == layouts.FULLY_RESHARDABLE:
        param_state: Any = layouts.fully_reshardable_state(child, params, instance, is_loading)
    else:
        prefix = f"optimizer.distributed.dp_group_idx_{_dp_group_idx(child, leaf.expert_parallel)}"
        dp_rank = shards[0].rank if shards else 0
        replica = (instance, 0, dp_rank)
        common = {k: ShardedObject(f"{prefix}.{k}", v, (1,), (0,), replica_id=replica) for k, v in common.items()}
        places = layouts.bucket_places(child, leaf.expert_parallel)
        param_state = layouts.dp_reshardable_state(child, places, prefix, leaf.state_names, is_loading)
        for name, unpadded in (("per_bucket_numel", False), ("per_bucket_numel_unpadded", True)):
            param_state[name] = ShardedObject(f"{prefix}.{name}", layouts.bucket_numels(places, unpadded), (1,), (0,),
                                              replica_id=replica)
    out = {**common, "param_state": param_state, "param_state_sharding_type": kind}
    if with_matrix_state:  # in any format
        out["matrix_state"] = layouts.matrix_state_entries(child, params, instance, is_loading)
    return out


def build(optimizer: Any, model_sharded_state_dict: Any, is_loading: bool, metadata: Optional[dict]) -> dict:
    """``optimizer.sharded_state_dict(...)`` (every rank calls it; a refusal raises on every rank together)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    def make() -> dict:
        kind = sharding_type(metadata)
        parts = [child_sharded_state_dict(c, model_sharded_state_dict, is_loading, kind) for c in children(optimizer)]
        if len(parts) == 1:
            return parts[0]
        prefixed = (kind not in FULLY_RESHARDABLE_FORMATS
                    or not (metadata or {}).get("chained_optim_avoid_prefix", False))
        for i, part in enumerate(parts):
            if prefixed:
                add_prefix_for_sharding(part, f"chained_{i}.")
        return dict(enumerate(parts))

    return collectives.raise_together(make, None, f"{type(optimizer).__name__}.sharded_state_dict",
                                      UnsupportedConfigError)


# ----------------------------------------------------------------------------- loading
def _candidates(state_dict: Any) -> list[dict]:
    """The state dict itself and its per-child parts (a chain's, keyed by index, in order)."""
    if isinstance(state_dict, list):
        return [p for p in state_dict if isinstance(p, dict)]
    if not isinstance(state_dict, dict):
        return []
    return [state_dict] + [v for _, v in sorted((k, v) for k, v in state_dict.items()
                                                if isinstance(k, int) and isinstance(v, dict))]


def is_megatron_format(state_dict: Any) -> bool:
    """A state dict in megatron-core's distributed-optimizer format (one child's, or a chain's per child)."""
    return any("param_state_sharding_type" in c for c in _candidates(state_dict))


def _merged_common(commons: list[dict]) -> dict[str, Any]:
    """The common states of a chain split otherwise than this optimizer, as one: all param groups (a
    child's are then matched by identity), every leaf's update count (which must agree)."""
    inners = [c.get("optimizer") or {} for c in commons]
    groups = [g for inner in inners for g in inner.get("param_groups", [])]
    ours = [inner.get("megatron_opt") for inner in inners]
    merged: dict[str, Any] = {"param_groups": groups}
    if all(ours):
        merged["megatron_opt"] = {"param_groups": [g for o in ours for g in o["param_groups"]],
                                  "steps": [st for o in ours for st in o["steps"]],
                                  "skipped_steps": max(int(o.get("skipped_steps", 0)) for o in ours)}
    out: dict[str, Any] = {"optimizer": merged}
    if any("grad_scaler" in c for c in commons):
        out["grad_scaler"] = next(c["grad_scaler"] for c in commons if "grad_scaler" in c)
    return out


def _per_child(optimizer: Any, state_dict: Any) -> list[dict]:
    """The part of ``state_dict`` each child of ``optimizer`` reads. A fully_reshardable state dict of a
    chain split otherwise (the experts' own child at expert parallelism; megatron-core's
    dist_checkpointing.load returns the saved chain's common parts beside this chain's param state) is
    read whole by every child: its param state is keyed by model-space names, its param groups by identity."""
    kids, candidates = children(optimizer), _candidates(state_dict)
    commons = [c for c in candidates if "param_state_sharding_type" in c]
    if len(commons) == len(kids) and all("param_state" in c for c in commons):
        return commons
    kinds = {c["param_state_sharding_type"] for c in commons}
    states = [c["param_state"] for c in candidates if "param_state" in c]
    if kinds != {layouts.FULLY_RESHARDABLE} or not states:
        raise ValueError(f"the state dict holds the state of {len(commons)} distributed optimizer(s) "
                         f"({', '.join(sorted(kinds)) or 'no format'}), this {type(optimizer).__name__} has "
                         f"{len(kids)} (another expert-parallel split): load a checkpoint saved with "
                         f"{layouts.FULLY_RESHARDABLE_FLAG}, which any layout loads")
    param_state = {(i, k): v for i, ps in enumerate(states) for k, v in ps.items()}
    whole = {"param_state_sharding_type": layouts.FULLY_RESHARDABLE, "param_state": param_state,
             "matrix_state": {k: v for c in candidates for k, v in (c.get("matrix_state") or {}).items()},
             **_merged_common(commons)}
    return [whole] * len(kids)


def _read(child: Any, part: dict) -> tuple[list, dict]:
    """(slice, loaded values) for every slice ``child`` owns, and its scalar state; ValueError if any is missing."""
    kind = part["param_state_sharding_type"]
    if kind not in (layouts.FULLY_RESHARDABLE, layouts.DP_RESHARDABLE):
        raise ValueError(f"the optimizer state dict is in megatron-core's {kind!r} format, which megatron_opt does "
                         f"not read; re-save it with {layouts.FULLY_RESHARDABLE_FLAG}")
    if kind == layouts.FULLY_RESHARDABLE:
        values = layouts.read_fully_reshardable(child, part["param_state"])
    else:
        leaf = child.state_leaves()[0]
        places = layouts.bucket_places(child, leaf.expert_parallel)
        saved = part["param_state"].get("per_bucket_numel_unpadded")
        mine = layouts.bucket_numels(places, unpadded=True)
        if saved != mine:
            raise ValueError(f"the dp_reshardable checkpoint's buckets hold {saved} elements, this optimizer's "
                             f"{mine}: its flat-buffer layout differs (another model, tensor / pipeline / expert-"
                             f"parallel size, bucket size or data-parallel bucketing); load a checkpoint saved with "
                             f"{layouts.FULLY_RESHARDABLE_FLAG}, which any layout loads")
        values = layouts.read_dp_reshardable(child, places, part["param_state"])
    return values + layouts.read_matrix_state(child, part.get("matrix_state")), scalar_state_from(child, part)


def masters_off_the_weights(values: list) -> dict[str, tuple[int, int]]:
    """{param key: (elements, of which disagree)} for the loaded masters that are not their param's current
    value beyond rounding to the param's dtype. Megatron-LM loads the model before the optimizer, so a
    master that is not its stored weight was written wrong: megatron-core (0.16.1 and 0.19.2) writes the
    fully_reshardable state of a param whose range runs past its buffer's unpadded end (the first
    pipeline stage's word embedding, last in its buffer) from shifted offsets, logging "param range
    exceeds unpadded buffer" (docs/checkpoints.md)."""
    out: dict[str, tuple[int, int]] = {}
    for s, v in values:
        if s.state != layouts.MASTER:
            continue
        param = s.piece.param.detach().reshape(-1)[s.start: s.start + v.numel()]
        off = int((v.to(param.dtype) != param).sum())
        total, bad = out.get(s.key, (0, 0))
        out[s.key] = (total + v.numel(), bad + off)
    return {k: n for k, n in out.items() if n[1]}


def _warn_masters_off_the_weights(plans: list) -> None:
    off = {}
    for _, values, _ in plans:
        off.update(masters_off_the_weights(values))
    if off:
        described = ", ".join(f"{k} ({bad} of {total} elements)" for k, (total, bad) in sorted(off.items()))
        _LOG.warning("the checkpoint's optimizer masters disagree with its model weights beyond rounding for %s "
                     "(on this rank): the optimizer state of these params was saved wrong; megatron-core writes "
                     "it so for a param that runs past its buffer's unpadded end (its log says 'param range "
                     "exceeds unpadded buffer'). Training goes on from these masters; to start them from the "
                     "weights instead, load with --no-load-optim (the moments then start at zero).", described)


def load(optimizer: Any, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)`` for megatron-core's formats: every rank checks first
    (the state it owns is present and finite, the param groups and update counts read), a refusal
    raises the same ValueError on every rank before anything changes; then the state is written, the
    masters rounded into the params and all-gathered (a collective)."""
    def check() -> list:
        plans = []
        for child, part in zip(children(optimizer), _per_child(optimizer, state_dict)):
            values, scalars = _read(child, part)
            bad = first_nonfinite((f"'{layouts.megatron_state_name(s.state)}' of {s.key}", v) for s, v in values)
            if bad is not None:
                raise ValueError(f"{bad} holds non-finite values; refusing to load it (the next step would write NaN "
                                 f"into the params)")
            plans.append((child, values, scalars))
        return plans

    plans = collectives.raise_together(check, None, f"{type(optimizer).__name__}.load_state_dict", ValueError)
    _warn_masters_off_the_weights(plans)
    with torch.no_grad():
        for child, values, scalars in plans:
            for s, v in values:
                s.write(v)
            child.load_scalar_state(scalars)
        for child, _, _ in plans:
            child.sync_params_from_masters()


__all__ = ["regrouped_scalar_state", "SHARDING_TYPE", "children", "sharding_type", "common_state", "scalar_state_from",
           "child_sharded_state_dict", "build", "is_megatron_format", "load"]
