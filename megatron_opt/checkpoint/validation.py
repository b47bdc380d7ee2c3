"""What a load checks before it changes anything: the files, the model and optimizer they fit, the schedule.

Each check raises a CheckpointError naming the file and the problem; load() runs them on every
rank and raises on every rank together.
"""
from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.distributed.checkpoint as dcp

from ..distributed.shard_view import GradSource
from ..errors import CheckpointError
from ..optimizer.state.view import OptimizerStateView, compatibility_problem
from . import directory, model_space


def verify_files(folder: Path, manifest: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """DCP's .metadata matches its SHA-256 (every rank: everything below trusts it); every data file
    it names exists and is long enough; this rank's share of the data files (every world-th) matches
    its SHA-256. Raises naming the file. Checkpoints saved before .metadata was hashed skip that check."""
    files = manifest.get("files", {})
    metadata_file = folder / directory.METADATA
    if directory.METADATA in files:
        if not metadata_file.exists():
            raise CheckpointError(f"{metadata_file} is missing")
        if directory.sha256_of(metadata_file) != files[directory.METADATA]:
            raise CheckpointError(f"{metadata_file} is corrupt: its SHA-256 differs from the manifest")
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{metadata_file} cannot be read ({type(exc).__name__}: {exc})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = folder / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f} is truncated: {f.stat().st_size} bytes, needs at least {size}")
    data = sorted(name for name in files if name != directory.METADATA)
    for i, name in enumerate(data):
        if i % world == rank and directory.sha256_of(folder / name) != files[name]:
            raise CheckpointError(f"{folder / name} is corrupt: its SHA-256 differs from the manifest")


def check_compatible(manifest: dict[str, Any], chunks: Sequence[GradSource], optimizer: Optional[OptimizerStateView],
                     scheduler: Optional[Any], folder: Path, params: Optional[list] = None) -> None:
    """The checkpoint's format, model (param names, shapes, dtypes; ``params``: as
    param_layout.fingerprint_params gives them) and optimizer rules fit these."""
    where = folder / directory.MANIFEST
    if manifest.get("format") != model_space.FORMAT:
        raise CheckpointError(f"{where}: format {manifest.get('format')!r} is not {model_space.FORMAT!r}")
    saved = manifest["fingerprint"]
    if optimizer is not None and "optimizer" not in saved:
        raise CheckpointError(f"{where}: the checkpoint has no optimizer state; load with load_optimizer=False")
    problem = compatibility_problem(saved, model_space.fingerprint(chunks, optimizer, params), "the checkpoint")
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    if scheduler is not None and not manifest.get("scheduler"):
        raise CheckpointError(f"{where}: the checkpoint has no scheduler state")


def dry_run_scheduler_load(scheduler: Any, state: dict, folder: Path) -> None:
    """Load the schedule into a shallow copy that writes into copies of the param groups, so a
    mismatch (e.g. another max_lr) raises here, before anything live is written."""
    trial = copy.copy(scheduler)
    trial.optimizer = types.SimpleNamespace(param_groups=[dict(g) for g in scheduler.optimizer.param_groups])
    try:
        trial.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(f"{folder}: the scheduler state does not fit this scheduler: "
                              f"{type(exc).__name__}: {exc}") from None


__all__ = ["verify_files", "check_compatible", "dry_run_scheduler_load"]
