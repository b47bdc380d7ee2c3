"""What a saved checkpoint holds, read from its manifest without loading it: for launchers that decide
before a run starts (resume or not, which layout can load it, whether the optimizer state is there)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import directory, param_layout


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint iteration, as its manifest describes it."""

    folder: Path  # the iteration folder (iter_NNNNNNN)
    iteration: int
    has_optimizer: bool  # False when saved without the optimizer (--no-save-optim)
    has_scheduler: bool
    data_parallel_size: int
    world_size: int
    model_parallel_sizes: Optional[dict[str, int]]  # tensor / pipeline / ... sizes when the model recorded them
    global_param_keys: bool  # params named by megatron-core's global keys (loads at any TP / PP / DP layout)


def read_info(path: Union[str, Path], iteration: Optional[int] = None) -> CheckpointInfo:
    """The checkpoint ``resolve(path, iteration)`` picks, described. FileNotFoundError when there is
    none; CheckpointError when its manifest cannot be read (a damaged folder: load another iteration)."""
    folder = directory.resolve(path, iteration)
    manifest = directory.read_manifest(folder)
    try:
        return CheckpointInfo(
            folder=folder, iteration=int(manifest["iteration"]),
            has_optimizer="optimizer" in manifest["fingerprint"], has_scheduler=bool(manifest.get("scheduler")),
            data_parallel_size=int(manifest["data_parallel_size"]), world_size=int(manifest["world_size"]),
            model_parallel_sizes=manifest.get("model_parallel_sizes"),
            global_param_keys=manifest.get("param_keys", param_layout.LOCAL) != param_layout.LOCAL)
    except (ValueError, KeyError, TypeError) as exc:  # a field missing or of the wrong type
        raise directory.damaged_manifest(folder, exc) from None
