"""Reading and writing a ShardStore's state from outside the step: checkpoints, torch.optim's
per-param ``state``, Megatron-LM's ``reload_model_params``.

Everything here works on views of the store's flat tensors, so a write lands in the state the next
step uses. Param all-gathers are the caller's (the leaf's) business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...distributed.shard_view import GradSource, LocalShard, assemble_full_tensors
from ...ops import precision
from .shard_store import ShardStore, master_values


@dataclass(frozen=True)
class PieceState:
    """One owned param piece with its optimizer state: views over the piece's elements.

    ``tensors['master']`` is the master's storage (fp32, fp16, or an int16 remainder of the bf16
    param); ``values`` / ``write`` read and store masters as fp32 values whatever the storage, and
    the update rule's state in its own dtype (``write`` converts)."""

    source: GradSource
    name: str
    param: torch.nn.Parameter
    param_start: int  # where the piece starts in the flattened param
    tensors: dict[str, torch.Tensor]  # 'master' and the update rule's state, 1-D views
    param_view: Optional[torch.Tensor] = None  # the piece of the model-dtype param shard (16-bit params)

    def value_dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name == "master" else self.tensors[name].dtype

    def values(self, name: str) -> torch.Tensor:
        if name == "master":
            return precision.load_master(self.tensors[name], self.param_view)
        return self.tensors[name]

    def write(self, name: str, values: torch.Tensor) -> None:
        target = self.tensors[name]
        if name == "master" and target.dtype != torch.float32:
            precision.store_master(values.to(device=target.device, dtype=torch.float32), target, self.param_view)
        else:
            target.copy_(values)


def piece_states(store: ShardStore) -> list[PieceState]:
    """This rank's owned param pieces, each with views of its master and update-rule state."""
    out = []
    for s in store.shards:
        tensors = {"master": s.master, **s.state}
        for pc in s.shard.pieces:
            lo, hi = pc.shard_range.start, pc.shard_range.end
            out.append(PieceState(s.source, s.shard.names[pc.param_index], s.shard.params[pc.param_index],
                                  pc.param_range.start, {k: t[lo:hi] for k, t in tensors.items()},
                                  None if s.param_out is None else s.param_out[lo:hi]))
    return out


def state_tensors(store: ShardStore) -> dict[str, torch.Tensor]:
    """This rank's optimizer state (views, not copies): masters, rule state and the step counter."""
    out = {"step": store.step}
    for i, s in enumerate(store.shards):
        out[f"shard{i}.master"] = s.master
        for name, t in s.state.items():
            out[f"shard{i}.{name}"] = t
    return out


GAPS = "(gaps)"  # state_bytes' name for allocated elements no piece covers (bucket padding inside a shard)


def state_bytes(store: ShardStore) -> list[tuple[GradSource, str, str, int]]:
    """What this rank's optimizer state occupies: (model chunk, param name or GAPS, state name, bytes)
    per owned piece and state tensor ('master' and the update rule's). A master that IS the fp32 param
    buffer (fp32 params) costs nothing beyond the model and counts 0 bytes."""
    out = []
    for s in store.shards:
        tensors = {"master": s.master, **s.state}
        covered = sum(pc.shard_range.size for pc in s.shard.pieces)
        for state, t in tensors.items():
            size = 0 if state == "master" and s.param_out is None else t.element_size()
            for pc in s.shard.pieces:
                out.append((s.source, s.shard.names[pc.param_index], state, pc.shard_range.size * size))
            if s.shard.numel > covered:
                out.append((s.source, GAPS, state, (s.shard.numel - covered) * size))
    return out


def per_param_state(store: ShardStore) -> dict[torch.Tensor, dict[str, Any]]:
    """Per main param: views of the flat optimizer state, as torch.optim exposes it."""
    out = {}
    for s in store.shards:
        for main, start, end in zip(s.main_params, s.table.starts, s.table.ends):
            entry: dict[str, Any] = {"step": store.step}
            entry.update({name: t[start:end] for name, t in s.state.items()})
            out[main] = entry
    return out


def gather_main_params(store: ShardStore) -> dict[str, torch.Tensor]:
    """Every param's fp32 master by name, assembled from all ranks (a collective over the DP group)."""
    owned: dict[tuple, list] = {}
    for s in store.shards:  # with ``selects`` a published shard may have several (narrowed) OwnedShards
        owned.setdefault((id(s.source), s.shard.buffer_index, s.shard.bucket_index), []).append(s)

    def master_of(src: GradSource, shard: LocalShard) -> torch.Tensor:
        runs = owned.get((id(src), shard.buffer_index, shard.bucket_index), [])
        if len(runs) == 1 and runs[0].offset == 0 and runs[0].shard.numel == shard.numel:
            return master_values(runs[0])  # the whole shard (every store without ``selects``)
        flat = torch.zeros(shard.numel, dtype=torch.float32, device=shard.grad.device)
        for s in runs:
            flat[s.offset : s.offset + s.shard.numel].copy_(master_values(s))
        return flat

    out: dict[str, torch.Tensor] = {}
    for src in store.sources:
        out.update(assemble_full_tensors(src.local_shards(store.is_expert_parallel),
                                         lambda shard, src=src: master_of(src, shard)))
    if store.selects is not None:  # the other store's params come back as zeros: they are not ours to report
        mine = {name for name, _ in store.managed_params().values()}
        out = {name: t for name, t in out.items() if name in mine}
    return out


def round_masters_into_params(store: ShardStore) -> None:
    """Write the rounded masters into this rank's model-param shards (after the masters were set).
    With remainders the param already is the master's high half."""
    for s in store.shards:
        if s.param_out is not None and not precision.is_remainder(s.master):
            # Piece by piece: the gaps may be another store's params (Muon's split of one buffer).
            for start, end in zip(s.table.starts, s.table.ends):
                s.param_out[start:end].copy_(s.master[start:end])


def reload_model_params(store: ShardStore) -> None:
    """Re-copy the model params (e.g. after loading a model checkpoint) into the masters."""
    for s in store.shards:
        if precision.is_remainder(s.master):
            s.master.zero_()  # the master is exactly the bf16 param
        elif s.param_out is not None:
            s.master.copy_(s.param_out)


__all__ = ["GAPS", "PieceState", "piece_states", "state_bytes", "state_tensors", "per_param_state",
           "gather_main_params", "round_masters_into_params", "reload_model_params"]
