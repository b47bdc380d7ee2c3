"""The same-DP-only state dict of a ShardStore: this rank's shards as they lie in memory.

It loads only into an optimizer with the same model, data-parallel size and rank (a fingerprint
checks it); megatron_opt.checkpoint stores the state per parameter and reshards instead.
"""
from __future__ import annotations

import torch

from ..ops import precision
from .shard_store import ShardStore, master_values


def fingerprint(store: ShardStore) -> dict:
    return {
        "optimizer": store.rule.name,
        "shards": [
            {
                "param_dtype": str(s.shard.param.dtype),
                "grad_dtype": str(s.shard.grad.dtype),
                "bucket_params": [tuple(p.shape) for p in s.shard.params.values()],
                "shard_count": s.shard.shard_count,
                "rank": s.shard.rank,
                "numel": s.table.numel,
            }
            for s in store.shards
        ],
    }


def state_dict(store: ShardStore) -> dict:
    return {
        "fingerprint": fingerprint(store),
        "update_rule": {"name": store.rule.name, "hyperparameters": store.rule.hyperparameters()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in store.param_groups],
        "step": int(store.step.item()),
        # Masters as fp32 values and state in its own dtype: a load converts into whatever this
        # optimizer keeps (fp32 <-> 16-bit moments, remainders).
        "shards": [{"master": master_values(s).detach().cpu().clone(),
                    **{k: v.detach().cpu().clone() for k, v in s.state.items()}} for s in store.shards],
    }


def check_loadable(store: ShardStore, state_dict: dict, fix: str) -> None:
    mine, theirs = fingerprint(store), state_dict["fingerprint"]
    if mine["optimizer"] != theirs["optimizer"]:
        raise ValueError(f"state_dict is for optimizer '{theirs['optimizer']}', this one is "
                         f"'{mine['optimizer']}'. {fix}")
    counts = {s["shard_count"] for s in mine["shards"]}, {s["shard_count"] for s in theirs["shards"]}
    if counts[0] and counts[1] and counts[0] != counts[1]:
        raise ValueError(f"state_dict was saved with the optimizer sharded over {sorted(counts[1])} ranks, this one "
                         f"is sharded over {sorted(counts[0])}: a state_dict holds one rank's shard and cannot "
                         f"change data-parallel size. Use megatron_opt.checkpoint.save/load, which store the "
                         f"state per parameter and reshard.")
    if len(mine["shards"]) != len(theirs["shards"]):
        raise ValueError(f"state_dict has {len(theirs['shards'])} shards on this rank, this optimizer has "
                         f"{len(mine['shards'])}: the model or the data-parallel size differs. {fix}")
    for i, (a, b) in enumerate(zip(mine["shards"], theirs["shards"])):
        for key in a:
            if a[key] != b[key]:
                raise ValueError(f"state_dict does not match this optimizer: shard {i} {key} is {b[key]!r} in "
                                 f"the checkpoint but {a[key]!r} here. {fix}")
    for i, saved in enumerate(state_dict["shards"]):
        for name, t in saved.items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"state_dict shard {i} '{name}' holds non-finite values; refusing to load it "
                                 f"(the next step would write NaN into the params). {fix}")
    if len(state_dict["param_groups"]) != len(store.param_groups):
        raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, this optimizer has "
                         f"{len(store.param_groups)}. {fix}")


def load_state_dict(store: ShardStore, state_dict: dict) -> None:
    """Restore the state (checked first by check_loadable); the caller then syncs params."""
    for group, saved in zip(store.param_groups, state_dict["param_groups"]):
        group.update(saved)
    store.step.fill_(int(state_dict["step"]))
    for s, saved in zip(store.shards, state_dict["shards"]):
        master = saved["master"].to(device=s.shard.grad.device, dtype=torch.float32)
        for name, t in s.state.items():
            t.copy_(saved[name])  # converts fp32 <-> 16-bit
        if s.master.dtype == torch.float32:
            s.master.copy_(master)
            if s.param_out is not None:
                s.param_out.copy_(master)
        else:
            precision.store_master(master, s.master, s.param_out)


__all__ = ["fingerprint", "state_dict", "check_loadable", "load_state_dict"]
