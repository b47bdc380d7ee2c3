"""Writing one iteration folder atomically (every rank calls write_iteration with its DCP state dict).

Ranks write into a temporary folder through DCP, hash their own files, and hand the hashes to rank
0, which writes the manifest, renames the folder into place, replaces the tracker and prunes old
iterations (directory.py). Every phase ends in an agreement that all ranks reach, so one rank's
failure is everyone's CheckpointError and no later phase starts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp

from .. import collectives
from ..errors import CheckpointError
from . import directory
from .dcp_errors import dcp_failures
from .dcp_items import ModelSpaceSavePlanner


def _prepare_folder(root: Path, tmp: Path, rank: int) -> None:
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        directory.remove_stale_temporaries(root)
        tmp.mkdir()


def write_iteration(root: Path, iteration: int, state: dict[str, Any], manifest: dict[str, Any],
                    keep_latest_k: Optional[int], group: Optional[Any]) -> None:
    """Write ``state`` as ``root/iter_<iteration>`` with ``manifest`` (plus the files' SHA-256), over
    the process group ``group`` (None: the default group)."""
    rank = collectives.rank(group)
    tmp, final = directory.temporary_dir(root, iteration), directory.iteration_dir(root, iteration)
    collectives.raise_together(lambda: _prepare_folder(root, tmp, rank), group, "checkpoint save (prepare)",
                               CheckpointError)
    with dcp_failures(f"checkpoint save of {tmp}"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ModelSpaceSavePlanner(),
                 process_group=group)
    hashes = collectives.raise_together(
        lambda: {p.name: directory.sha256_of(p) for p in directory.files_to_hash(tmp, rank)}, group,
        "checkpoint save (hash)", CheckpointError)
    everyone = collectives.gather_objects(hashes, group)

    def commit() -> None:
        if rank != 0:
            return
        files = {name: digest for h in everyone for name, digest in h.items()}
        directory.write_manifest(tmp, {**manifest, "files": files})
        directory.commit(tmp, final)
        directory.write_tracker(root, iteration)
        if keep_latest_k is not None:
            directory.prune(root, keep_latest_k, protect=[iteration])

    collectives.raise_together(commit, group, f"checkpoint commit of {final}", CheckpointError)


__all__ = ["write_iteration"]
