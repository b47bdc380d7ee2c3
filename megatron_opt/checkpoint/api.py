"""save() and load(): parallel, atomic, optionally asynchronous, resharding across DP sizes.

Every rank calls both. Each rank writes only the optimizer elements it owns (model space, see
model_space.py) through torch.distributed.checkpoint, on a dedicated gloo group so a save in the
background never interleaves with training collectives. Failures are agreed on: every rank raises
the same CheckpointError, and a failed load changes nothing.
"""
from __future__ import annotations

import copy
import datetime
import types
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import collectives
from ..distributed.shard_view import GradSource
from ..errors import CheckpointError
from . import directory, model_space
from .dcp_items import ModelSpaceLoadPlanner, ModelSpaceSavePlanner
from .run_state import capture_rng, restore_rng

Model = Union[GradSource, Sequence[GradSource]]
CHECKPOINT_GROUP_TIMEOUT = datetime.timedelta(minutes=10)

try:
    from importlib.metadata import version as _version

    VERSION = _version("megatron_opt")
except Exception:  # running from a source tree without an install
    VERSION = "unknown"


@dataclass
class RunState:
    """What load() restored besides the tensors."""

    iteration: int
    consumed_samples: int
    saved_data_parallel_size: int
    path: str
    extra: dict = field(default_factory=dict)
    rank_extra: Optional[dict] = None  # this rank's extras; None when the world size changed
    rng_restored: bool = False


# ----------------------------------------------------------------------------- the checkpoint group
_group: Optional[Any] = None
_group_for: Optional[int] = None


def _checkpoint_group() -> Optional[Any]:
    """A gloo group of the whole world for checkpoint traffic (created once, collectively)."""
    global _group, _group_for
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world_id = id(dist.group.WORLD)
    if _group is None or _group_for != world_id:
        _group = dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)
        _group_for = world_id
    return _group


# ----------------------------------------------------------------------------- saving
class _PendingSave:
    def __init__(self, iteration: int, job) -> None:
        self.iteration = iteration
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._run, args=(job,), name=f"megatron_opt-save-{iteration}",
                                       daemon=True)
        self.thread.start()

    def _run(self, job) -> None:
        try:
            job()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self.error = f"{type(exc).__name__}: {exc}"


_pending: Optional[_PendingSave] = None


def _write(root: Path, iteration: int, state: dict[str, Any], manifest: dict[str, Any],
           keep_latest_k: Optional[int], group: Optional[Any]) -> None:
    """Write into a temporary folder, then (rank 0) manifest, rename, tracker, retention. Every phase
    ends in a collective that all ranks reach, so one rank's failure is everyone's error."""
    rank, world = collectives.rank(group), collectives.world_size(group)
    tmp, final = directory.temporary_dir(root, iteration), directory.iteration_dir(root, iteration)
    collectives.raise_together(lambda: _prepare_folder(root, tmp, rank), group, "checkpoint save (prepare)",
                               CheckpointError)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ModelSpaceSavePlanner(),
             process_group=group)
    hashes = collectives.raise_together(
        lambda: {p.name: directory.sha256_of(p) for p in directory.data_files_of_rank(tmp, rank)}, group,
        "checkpoint save (hash)", CheckpointError)
    everyone: list = [hashes]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, hashes, group=group)

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


def _prepare_folder(root: Path, tmp: Path, rank: int) -> None:
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        directory.remove_stale_temporaries(root)
        tmp.mkdir()


def save(path: Union[str, Path], model: Model, optimizer: Optional[Any] = None, scheduler: Optional[Any] = None, *,
         iteration: int, consumed_samples: int = 0, extra: Optional[dict] = None, rank_extra: Optional[dict] = None,
         keep_latest_k: Optional[int] = None, async_save: bool = False) -> None:
    """Save model, optimizer, scheduler and run state as ``path/iter_<iteration>`` (every rank calls it).

    ``extra``: run-wide extras (identical on every rank); ``rank_extra``: this rank's own (e.g. its
    data-loader position), given back by load() at the same world size.
    ``async_save``: copy the state (the only part that blocks), write it in the background; the
    next save, ``wait_for_pending_save()`` or a failing ``check_pending_save()`` reports errors,
    on every rank.
    """
    global _pending
    wait_for_pending_save()
    root = Path(path)
    chunks = model_space.as_chunks(model)
    children = getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []
    if any(getattr(child, "model_parallel_group", None) is not None for child in children):
        raise CheckpointError("megatron_opt.checkpoint describes data-parallel sharding only; an optimizer with a "
                              "model_parallel_group (tensor/pipeline parallelism) cannot be saved with it yet.")
    run = {"iteration": int(iteration), "consumed_samples": int(consumed_samples), "extra": dict(extra or {})}
    rank_state = {"rng": capture_rng(), "extra": dict(rank_extra or {})}
    state = model_space.build_save_state(chunks, optimizer, scheduler, run, rank_state, snapshot=async_save)
    manifest = {
        "format": model_space.FORMAT, "megatron_opt_version": VERSION, "iteration": int(iteration),
        "data_parallel_size": collectives.world_size(None), "fingerprint": model_space.fingerprint(chunks, optimizer),
        "scheduler": scheduler is not None,
    }
    group = _checkpoint_group()
    job = lambda: _write(root, int(iteration), state, manifest, keep_latest_k, group)  # noqa: E731
    if async_save:
        _pending = _PendingSave(int(iteration), job)
    else:
        collectives.raise_together(job, None, f"checkpoint save of iteration {iteration}", CheckpointError)


def check_pending_save(block: bool = False) -> None:
    """Finish a background save if it is done on every rank (or wait for it with ``block``), and raise
    its error on every rank. Call it once per step: it costs one small all-reduce while a save runs."""
    global _pending
    if _pending is None:
        return
    if block:
        _pending.thread.join()
    done = torch.tensor([0.0 if _pending.thread.is_alive() else 1.0], device=collectives.flag_device(None))
    if collectives.world_size(None) > 1:
        collectives.all_reduce(done, None, op=dist.ReduceOp.MIN)
    if done.item() < 1.0:
        return
    pending, _pending = _pending, None
    pending.thread.join()

    def report() -> None:
        if pending.error is not None:
            raise RuntimeError(pending.error)

    collectives.raise_together(report, None, f"background checkpoint save of iteration {pending.iteration}",
                               CheckpointError)


def wait_for_pending_save() -> None:
    """Block until a background save finished everywhere; raise its error on every rank."""
    check_pending_save(block=True)


# ----------------------------------------------------------------------------- loading
def resolve(path: Union[str, Path], iteration: Optional[int] = None) -> Path:
    """The folder to load: ``iteration``, else the tracker's, else the newest complete one."""
    root = Path(path)
    if (root / directory.MANIFEST).exists():
        return root  # an iteration folder given directly
    if iteration is None:
        iteration = directory.read_tracker(root)
    if iteration is None:
        complete = directory.complete_iterations(root) if root.exists() else []
        if not complete:
            raise FileNotFoundError(f"no checkpoint in {root}: no {directory.TRACKER} and no complete iter_* folder")
        iteration = complete[-1]
    folder = directory.iteration_dir(root, iteration)
    found = directory.find_complete(folder)
    if found is None:
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {directory.MANIFEST})")
    return found


def verify_files(folder: Path, manifest: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """Every data file DCP's metadata names exists and is long enough; this rank's share of the files
    (every world-th) matches its SHA-256. Raises naming the file."""
    reader = dcp.FileSystemReader(str(folder))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{folder / '.metadata'} cannot be read ({type(exc).__name__}: {exc})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = folder / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f} is truncated: {f.stat().st_size} bytes, needs at least {size}")
    files = manifest.get("files", {})
    for i, name in enumerate(sorted(files)):
        if i % world == rank and directory.sha256_of(folder / name) != files[name]:
            raise CheckpointError(f"{folder / name} is corrupt: its SHA-256 differs from the manifest")


def _check_compatible(manifest: dict[str, Any], chunks: Sequence[GradSource], optimizer: Optional[Any],
                      scheduler: Optional[Any], folder: Path) -> None:
    where = folder / directory.MANIFEST
    if manifest.get("format") != model_space.FORMAT:
        raise CheckpointError(f"{where}: format {manifest.get('format')!r} is not {model_space.FORMAT!r}")
    saved, mine = manifest["fingerprint"], model_space.fingerprint(chunks, optimizer)
    saved_params = {k: (shape, dtype) for k, shape, dtype in saved["params"]}
    my_params = {k: (shape, dtype) for k, shape, dtype in mine["params"]}
    missing = sorted(set(my_params) - set(saved_params))
    extra = sorted(set(saved_params) - set(my_params))
    if missing or extra:
        raise CheckpointError(f"{where}: the checkpoint is of a different model: params missing from it {missing[:5]}, "
                              f"params only in it {extra[:5]}")
    for key, (shape, dtype) in my_params.items():
        if saved_params[key] != (shape, dtype):
            raise CheckpointError(f"{where}: param {key} is {saved_params[key][0]} {saved_params[key][1]} in the "
                                  f"checkpoint but {shape} {dtype} in this model")
    if optimizer is not None:
        if "optimizer" not in saved:
            raise CheckpointError(f"{where}: the checkpoint has no optimizer state; load with load_optimizer=False")
        if saved["optimizer"]["rules"] != mine["optimizer"]["rules"]:
            raise CheckpointError(f"{where}: the checkpoint's optimizer is {saved['optimizer']['rules']}, this one "
                                  f"is {mine['optimizer']['rules']}")
    if scheduler is not None and not manifest.get("scheduler"):
        raise CheckpointError(f"{where}: the checkpoint has no scheduler state")


def _dry_run_scheduler_load(scheduler: Any, state: dict, folder: Path) -> None:
    """Load the schedule into a shallow copy that writes into copies of the param groups, so a
    mismatch (e.g. another max_lr) raises here, before anything live is written."""
    trial = copy.copy(scheduler)
    trial.optimizer = types.SimpleNamespace(param_groups=[dict(g) for g in scheduler.optimizer.param_groups])
    try:
        trial.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(f"{folder}: the scheduler state does not fit this scheduler: "
                              f"{type(exc).__name__}: {exc}") from None


def load(path: Union[str, Path], model: Model, optimizer: Optional[Any] = None, scheduler: Optional[Any] = None, *,
         iteration: Optional[int] = None, load_optimizer: bool = True, load_rng: bool = True) -> RunState:
    """Load a checkpoint saved at any data-parallel size (every rank calls it).

    Checks the folder, the files (sizes, SHA-256) and the model's names, shapes and dtypes, reads
    everything into fresh tensors, rejects non-finite optimizer state, and only then writes the
    model, optimizer (unless ``load_optimizer=False``) and scheduler. RNG states (``load_rng``) and
    per-rank extras are restored when the world size equals the saved one. Any failure raises CheckpointError on every rank.
    """
    wait_for_pending_save()  # a background save uses the same checkpoint group and may be committing
    chunks = model_space.as_chunks(model)
    opt = optimizer if load_optimizer else None
    rank, world = collectives.rank(None), collectives.world_size(None)

    def check() -> tuple[Path, dict]:
        folder = resolve(path, iteration)
        try:
            manifest = directory.read_manifest(folder)
        except Exception as exc:
            raise CheckpointError(f"{folder / directory.MANIFEST} cannot be read ({type(exc).__name__}: {exc})") from None
        _check_compatible(manifest, chunks, opt, scheduler, folder)
        verify_files(folder, manifest, rank, world)
        return folder, manifest

    folder, manifest = collectives.raise_together(check, None, f"checkpoint load from {path}", CheckpointError)
    same_world = manifest["data_parallel_size"] == world
    dest = model_space.build_load_destination(chunks, opt, scheduler, same_world)

    def read() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, storage_reader=dcp.FileSystemReader(str(folder)), planner=ModelSpaceLoadPlanner(),
                     process_group=_checkpoint_group())
        bad = model_space.nonfinite_optimizer_state(dest)
        if bad:
            raise CheckpointError(f"{folder}: {bad}; refusing to load it (the next step would write NaN into the params)")
        if opt is not None:
            saved_groups, mine = dest["optim/scalars"]["param_groups"], opt.param_groups
            if len(saved_groups) != len(mine):
                raise CheckpointError(f"{folder}: the checkpoint has {len(saved_groups)} param groups, this optimizer "
                                      f"has {len(mine)}; build the optimizer with the same grouping")
        if scheduler is not None:
            _dry_run_scheduler_load(scheduler, dest["scheduler"], folder)

    collectives.raise_together(read, None, f"checkpoint load from {folder}", CheckpointError)
    model_space.apply_loaded_state(dest, chunks, opt, scheduler)
    if optimizer is not None and not load_optimizer:
        optimizer.reload_model_params()
    mine = dest.get(model_space.rank_key())
    if mine is not None and load_rng:
        restore_rng(mine["rng"])
    run = dest["run"]
    return RunState(iteration=run["iteration"], consumed_samples=run["consumed_samples"],
                    saved_data_parallel_size=manifest["data_parallel_size"], path=str(folder),
                    extra=run.get("extra", {}), rank_extra=mine["extra"] if mine is not None else None,
                    rng_restored=mine is not None and load_rng)


def latest_iteration(path: Union[str, Path]) -> Optional[int]:
    """The iteration the tracker names (None when there is no checkpoint)."""
    return directory.read_tracker(Path(path))


__all__ = ["RunState", "save", "load", "check_pending_save", "wait_for_pending_save", "resolve", "verify_files",
           "latest_iteration"]
