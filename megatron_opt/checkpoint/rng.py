"""The random-number generators of one process (python, numpy, torch CPU, every CUDA device, and
megatron-core's RNG tracker: the model-parallel / expert-parallel / data-parallel streams that dropout
forks into): captured into a checkpoint per rank, restored at the same world size."""
from __future__ import annotations

import random
import sys
import warnings
from typing import Any, Optional

import torch

try:
    import numpy as np
except ImportError:  # numpy is a dependency, but keep RNG capture working without it
    np = None  # type: ignore[assignment]

_TRACKER_MODULE = "megatron.core.tensor_parallel.random"


def _megatron_core_tracker() -> Optional[Any]:
    """megatron-core's RNG tracker when the process already uses one: megatron-core is never imported
    here, and an uninitialised tracker is left alone (creating it would fix its kind, e.g. before
    Megatron-LM asks for Transformer Engine's)."""
    module = sys.modules.get(_TRACKER_MODULE)
    if module is None or not getattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return module.get_cuda_rng_tracker()


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_core_tracker()
    if tracker is not None:
        # A graph-safe tracker keeps generators, not state tensors: those cannot be saved as values.
        states = {name: s.clone() for name, s in tracker.get_states().items() if isinstance(s, torch.Tensor)}
        if states:
            state["megatron_core_tracker"] = states
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("megatron_core_tracker")
    if saved:
        tracker = _megatron_core_tracker()
        if tracker is None:
            warnings.warn("the checkpoint holds megatron-core RNG tracker states (dropout streams) but this process "
                          "has no initialised tracker, so they are not restored: call megatron-core's "
                          "model_parallel_cuda_manual_seed() before loading", stacklevel=3)
            return
        states = dict(tracker.get_states())
        states.update({name: s.clone() for name, s in saved.items()})
        tracker.set_states(states)


__all__ = ["capture_rng", "restore_rng"]
