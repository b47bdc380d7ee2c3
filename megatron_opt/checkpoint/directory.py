"""The checkpoint directory: iteration folders, atomic commit, the tracker file, retention, integrity.

    SAVE_DIR/latest_checkpointed_iteration.txt     the newest complete iteration (Megatron-LM's name)
    SAVE_DIR/iter_0000100/                         DCP files + megatron_opt_manifest.json
    SAVE_DIR/.tmp_iter_0000200/                    a save in progress (never read)

A save writes into the temporary folder; only after every rank finished does rank 0 write the manifest (with a
SHA-256 of each of DCP's files, its .metadata included), rename the folder into place, then replace the
tracker by write-then-rename. A save killed at any point therefore leaves either nothing visible or a complete
folder, and the tracker always names a complete one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from ..errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "megatron_opt_manifest.json"
METADATA = ".metadata"  # DCP's index of the data files (written by the coordinator, rank 0)
_TMP_PREFIX = ".tmp_iter_"


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def temporary_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"{_TMP_PREFIX}{iteration:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_tracker(root: Path) -> Optional[int]:
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def write_tracker(root: Path, iteration: int) -> None:
    write_file_atomically(Path(root) / TRACKER, f"{iteration}\n".encode())


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    write_file_atomically(Path(folder) / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def damaged_manifest(folder: Path, exc: BaseException) -> CheckpointError:
    """The error for a manifest that cannot be read or lacks what it must hold, with the fix."""
    folder = Path(folder)
    return CheckpointError(f"{folder / MANIFEST} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is "
                           f"damaged: load another iteration ({folder.parent}/iter_...)")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; CheckpointError when it cannot be read or is not a JSON object."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise damaged_manifest(folder, exc) from None
    if not isinstance(manifest, dict):
        raise damaged_manifest(folder, TypeError(f"a JSON {type(manifest).__name__}, not an object"))
    return manifest


def replaced_dir(final: Path) -> Path:
    """Where commit() parks an older save of the same iteration for a moment (see find_complete)."""
    return final.with_name(final.name + ".replaced")


def find_complete(final: Path) -> Optional[Path]:
    """``final`` if complete; else its parked older version (a save killed between commit()'s two
    renames); else None."""
    for candidate in (final, replaced_dir(final)):
        if (candidate / MANIFEST).exists():
            return candidate
    return None


def commit(tmp: Path, final: Path) -> None:
    """Make a finished temporary folder visible under its final name (one rename)."""
    if final.exists():  # re-saving an iteration: move the old one aside first, then drop it
        old = replaced_dir(final)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def complete_iterations(root: Union[str, Path]) -> list[int]:
    """The iterations whose folders are complete (hold a manifest), oldest first."""
    out = []
    for child in Path(root).glob("iter_*"):
        if child.is_dir() and child.name[5:].isdigit() and (child / MANIFEST).exists():
            out.append(int(child.name[5:]))
    return sorted(out)


def prune(root: Path, keep_latest_k: int, protect: Iterable[int] = ()) -> None:
    """Delete complete iterations older than the newest ``keep_latest_k`` (never the protected ones)."""
    keep = set(complete_iterations(root)[-keep_latest_k:]) | set(protect)
    for it in complete_iterations(root):
        if it not in keep:
            # Rename first: a kill during the deletion then leaves a stale temporary, never a
            # folder that still looks complete.
            doomed = Path(root) / f"{_TMP_PREFIX}pruned_{it:07d}"
            shutil.rmtree(doomed, ignore_errors=True)
            os.rename(iteration_dir(root, it), doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(root: Path) -> None:
    """Before a save: drop unfinished temporaries, and put back an older save that commit() had
    parked (killed between its two renames) or drop it if the new one made it."""
    for child in Path(root).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(child, ignore_errors=True)
    for parked in Path(root).glob("iter_*.replaced"):
        final = parked.with_name(parked.name[: -len(".replaced")])
        if (final / MANIFEST).exists():
            shutil.rmtree(parked, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(parked, final)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    # One reused buffer: a fresh 4 MiB block per read left two blocks live at a time, and the heap
    # they dirtied stayed resident through the load that follows the check.
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def data_files_of_rank(folder: Path, rank: int) -> list[Path]:
    """The DCP data files a rank wrote (FileSystemWriter names them __<rank>_<n>.distcp)."""
    return sorted(Path(folder).glob(f"__{rank}_*.distcp"))


def files_to_hash(folder: Path, rank: int) -> list[Path]:
    """The files a rank hashes for the manifest: its data files, and on rank 0 (DCP's coordinator,
    which wrote it) the .metadata."""
    own = data_files_of_rank(folder, rank)
    return own + [Path(folder) / METADATA] if rank == 0 else own


def resolve(path: Union[str, Path], iteration: Optional[int] = None) -> Path:
    """The folder to load: ``iteration``, else the tracker's, else the newest complete one; ``path``
    itself when it is an iteration folder. FileNotFoundError when there is none."""
    root = Path(path)
    if (root / MANIFEST).exists():
        return root
    if iteration is None:
        iteration = read_tracker(root)
    if iteration is None:
        complete = complete_iterations(root) if root.exists() else []
        if not complete:
            raise FileNotFoundError(f"no checkpoint in {root}: no {TRACKER} and no complete iter_* folder")
        iteration = complete[-1]
    folder = iteration_dir(root, iteration)
    found = find_complete(folder)
    if found is None:
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {MANIFEST})")
    return found


def latest_iteration(path: Union[str, Path]) -> Optional[int]:
    """The iteration the tracker names (None when there is no tracker; ValueError when it holds no number)."""
    return read_tracker(Path(path))


__all__ = ["TRACKER", "MANIFEST", "METADATA", "iteration_dir", "temporary_dir", "read_tracker", "write_tracker",
           "write_manifest", "read_manifest", "damaged_manifest", "commit", "complete_iterations", "prune",
           "remove_stale_temporaries", "sha256_of", "data_files_of_rank", "files_to_hash", "resolve",
           "latest_iteration", "write_file_atomically"]
