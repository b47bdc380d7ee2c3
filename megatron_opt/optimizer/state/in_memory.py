"""The optimizer's in-memory state_dict: this rank's optimizer state per parameter, in model space.

It is what megatron_opt.checkpoint writes, through the same view (state/view.py), held in memory:

    format        STATE_DICT_FORMAT
    fingerprint   {"params": [[key, shape, dtype], ...], "optimizer": {"rules": [...], "state": [...]}}
    state         {state name: {param key: {"start": int, "values": 1-D CPU tensor}}}: elements
                  [start, start + len) of the flattened param; 'master' as fp32 values whatever the
                  storage, the update rule's state in its own dtype (a load converts)
    scalars       param-group hyperparameters, update counts, loss scaler, skipped steps, rules
    matrix_state  {state name: {param key: whole tensor}}: the per-matrix state (SOAP's) of the matrices this
                  rank homes (whole-tensor rules; absent for the others)

A rank's state_dict holds the pieces that rank owns, so it loads wherever it covers what the loading
rank owns: at the data-parallel size and rank that saved it, or from a one-rank state_dict at any
size. megatron_opt.checkpoint reshards from any size to any size.
"""
from __future__ import annotations

from typing import Any

import torch

from .view import (OptimizerStateView, compatibility_problem, first_nonfinite, homed_matrix_state,
                   model_fingerprint, optimizer_fingerprint, owned_slices)

STATE_DICT_FORMAT = "megatron_opt.optimizer_state_dict/2"
_SAME_DP_FORMAT = "megatron_opt.DistributedOptimizer/1"  # megatron_opt's earlier per-shard format
_FIX = ("Load a checkpoint saved by this model with the same update rules; to change the data-parallel size, save "
        "and load with megatron_opt.checkpoint, which reshards.")


def _fingerprint(view: OptimizerStateView) -> dict[str, Any]:
    return {"params": model_fingerprint(view.model_chunks), "optimizer": optimizer_fingerprint(view)}


def build(view: OptimizerStateView) -> dict[str, Any]:
    """The state_dict of ``view`` (copies on the CPU: later steps do not change it)."""
    state: dict[str, dict[str, Any]] = {}
    for s in owned_slices(view):
        state.setdefault(s.state, {})[s.key] = {"start": s.start, "values": s.values().detach().cpu().clone()}
    out = {"format": STATE_DICT_FORMAT, "fingerprint": _fingerprint(view), "state": state,
           "scalars": view.scalar_state()}
    homed = homed_matrix_state(view)
    if homed:
        out["matrix_state"] = {}
        for m in homed:
            out["matrix_state"].setdefault(m.state, {})[m.block_key] = m.tensor.detach().cpu().clone()
    return out


def _saved_matrix_state(state_dict: dict, m: Any) -> torch.Tensor:
    """The saved per-matrix state ``m`` (a MatrixStateTensor); ValueError when the state_dict lacks it."""
    saved = state_dict.get("matrix_state", {}).get(m.state, {}).get(m.block_key)
    if saved is None or tuple(saved.shape) != tuple(m.tensor.shape):
        held = "nothing" if saved is None else f"a {tuple(saved.shape)} tensor"
        raise ValueError(
            f"the state_dict holds {held} for the per-matrix state '{m.state}' of {m.block_key}, which this rank keeps "
            f"({tuple(m.tensor.shape)}): a state_dict holds the matrices its rank was home to, and loads only at the "
            f"data-parallel size and rank that saved it. Save and load with megatron_opt.checkpoint, which reshards.")
    return saved


def _saved_part(state_dict: dict, s: Any) -> torch.Tensor:
    """The saved values of the elements slice ``s`` owns; ValueError when the state_dict lacks some."""
    saved = state_dict["state"].get(s.state, {}).get(s.key)
    lo = s.start - saved["start"] if saved is not None else -1
    if saved is None or lo < 0 or lo + s.numel > saved["values"].numel():
        held = ("nothing" if saved is None else
                f"elements [{saved['start']}, {saved['start'] + saved['values'].numel()})")
        raise ValueError(
            f"the state_dict holds {held} of '{s.state}' of {s.key}, but this rank owns elements "
            f"[{s.start}, {s.start + s.numel}): a state_dict holds one rank's part of the state and loads only at "
            f"the data-parallel size and rank that saved it. Save and load with megatron_opt.checkpoint, which "
            f"stores the state per parameter and reshards.")
    return saved["values"][lo : lo + s.numel]


def check(view: OptimizerStateView, state_dict: Any) -> None:
    """Raise ValueError (changing nothing) unless ``state_dict`` loads into ``view`` on this rank."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
        found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
        older = (" (megatron_opt's earlier per-shard format, which this version no longer reads; re-save it with "
                 "the version that wrote it through megatron_opt.checkpoint)" if found == _SAME_DP_FORMAT else "")
        raise ValueError(f"not a megatron_opt optimizer state_dict (format {found!r}){older}. {_FIX}")
    problem = compatibility_problem(state_dict["fingerprint"], _fingerprint(view), "the state_dict")
    if problem:
        raise ValueError(f"state_dict does not match this optimizer: {problem}. {_FIX}")
    saved_groups = state_dict["scalars"]["param_groups"]
    my_groups = [g for leaf in view.state_leaves() for g in leaf.param_groups]
    if len(saved_groups) != len(my_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(my_groups)}. {_FIX}")
    parts = [(f"'{s.state}' of {s.key}", _saved_part(state_dict, s)) for s in owned_slices(view)]
    parts += [(f"'{m.state}' of {m.block_key}", _saved_matrix_state(state_dict, m)) for m in homed_matrix_state(view)]
    bad = first_nonfinite(parts)
    if bad is not None:
        raise ValueError(f"state_dict {bad} holds non-finite values; refusing to load it (the next step would write "
                         f"NaN into the params). {_FIX}")


def load(view: OptimizerStateView, state_dict: dict) -> None:
    """Write a checked state_dict into the live optimizer, then round the masters into the params and
    all-gather them (a collective: every rank of the optimizer calls it)."""
    with torch.no_grad():
        for s in owned_slices(view):
            s.write(_saved_part(state_dict, s))
        for m in homed_matrix_state(view):
            m.write(_saved_matrix_state(state_dict, m))
        view.load_scalar_state(state_dict["scalars"])
        view.sync_params_from_masters()


__all__ = ["STATE_DICT_FORMAT", "build", "check", "load"]
