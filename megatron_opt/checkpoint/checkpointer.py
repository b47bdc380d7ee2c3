"""Checkpointer: save() and load() (every rank calls them), and what outlives one call.

A Checkpointer owns the background save in flight (at most one) and the staging buffers a
background save copies into. Each save or load runs its collectives on a gloo process group of its
own (10-minute timeout), created for that operation and destroyed once every rank is done with it:
a save in the background never interleaves with training collectives, and no group outlives its
use. Failures are agreed on: every rank raises the same CheckpointError, and a failed load changes
nothing. A collective that fails because a rank died or stopped answering is raised as a
CheckpointError too, on every surviving rank.

The module-level save / load / check_pending_save / wait_for_pending_save use the Checkpointer
kept on the model's first chunk (default_checkpointer): nothing is kept at module level.
"""
from __future__ import annotations

import datetime
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import collectives
from ..distributed.shard_view import GradSource
from ..errors import CheckpointError
from . import directory, model_space, param_layout, validation, writer
from .dcp_errors import dcp_failures
from .dcp_items import ModelSpaceLoadPlanner, saved_tensor_shapes
from ..optimizer.state.torch_dist import regrouped_scalar_state
from .rng import capture_rng, restore_rng

Model = Union[GradSource, Sequence[GradSource]]
CHECKPOINT_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
T = TypeVar("T")

try:
    from importlib.metadata import version as _version

    VERSION = _version("megatron_opt")
except Exception:  # running from a source tree without an install
    VERSION = "unknown"


@dataclass
class LoadResult:
    """What load() restored besides the tensors."""

    iteration: int
    consumed_samples: int
    saved_data_parallel_size: int
    path: str
    extra: dict = field(default_factory=dict)
    rank_extra: Optional[dict] = None  # this rank's extras; None when the world size changed
    rng_restored: bool = False
    saved_world_size: int = 0  # the world size at save (RNG and rank_extra come back only at the same)


# ----------------------------------------------------------------------------- process groups
def _new_group() -> Optional[Any]:
    """A gloo group of the whole world for one operation's checkpoint traffic (every rank creates it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)


def _release(group: Optional[Any]) -> None:
    if group is not None:
        dist.destroy_process_group(group)


def _peer_failure(what: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{what} failed: a collective with the other ranks failed, so a rank died or stopped "
                           f"answering ({type(exc).__name__}: {exc})")


def _together(fn: Callable[[], T], what: str, group: Optional[Any] = None) -> T:
    """collectives.raise_together over the default group, then destroy ``group`` (the operation's),
    which every rank is done with. When the agreement itself fails (a rank died, or stopped answering
    until the group's timeout), raise a CheckpointError on this rank instead of the backend's error,
    since the others cannot be told, and leave ``group`` alone: its peers may be gone."""
    try:
        result = collectives.raise_together(fn, None, what, CheckpointError)
    except CheckpointError:
        _release(group)
        raise
    except Exception as exc:
        raise _peer_failure(what, exc) from exc
    _release(group)
    return result


# ----------------------------------------------------------------------------- a save in the background
class _PendingSave:
    def __init__(self, iteration: int, job: Callable[[], None], group: Optional[Any]) -> None:
        self.iteration = iteration
        self.group = group
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(job,), name=f"megatron_opt-save-{iteration}",
                                       daemon=True)
        self.thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self.error = exc

    def report(self) -> None:
        if self.error is not None:
            raise self.error


class Checkpointer:
    """Saves and loads checkpoints (see docs/checkpoints.md); owns the background save in flight.

    Every rank creates one and calls its methods together, in the same order. ``close()`` (or leaving
    a ``with`` block) waits for a background save and raises its error."""

    def __init__(self) -> None:
        self._pending: Optional[_PendingSave] = None
        self._staging = model_space.Staging()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        self.wait_for_pending_save()

    # ------------------------------------------------------------------------- saving
    def save(self, path: Union[str, Path], model: Model, optimizer: Optional[Any] = None,
             scheduler: Optional[Any] = None, *, iteration: int, consumed_samples: int = 0,
             extra: Optional[dict] = None, rank_extra: Optional[dict] = None, keep_latest_k: Optional[int] = None,
             async_save: bool = False, save_rng: bool = True) -> None:
        """Save model, optimizer, scheduler and run state as ``path/iter_<iteration>`` (every rank calls it).

        ``extra``: run-wide extras (identical on every rank); ``rank_extra``: this rank's own (e.g. its
        data-loader position), given back by load() at the same world size and model-parallel layout.
        ``async_save``: copy the state (the only part that blocks), write it in the background; the
        next save, ``wait_for_pending_save()`` or a failing ``check_pending_save()`` reports errors,
        on every rank.
        ``save_rng=False`` (Megatron-LM's ``--no-save-rng``): leave this rank's RNG states out; a load then
        keeps the generators as they are.
        """
        self.wait_for_pending_save()
        chunks = model_space.as_chunks(model)
        if optimizer is not None:
            model_space.check_optimizer(chunks, optimizer)
        it = int(iteration)
        model_parallel = model_space.is_model_parallel(chunks, optimizer)
        kind, places = _together(lambda: _placements(chunks, None, model_parallel),
                                 f"checkpoint save of iteration {it}")
        params = param_layout.fingerprint_params(chunks, kind, places)  # a collective with megatron-core's keys
        run = {"iteration": it, "consumed_samples": int(consumed_samples), "extra": dict(extra or {})}
        rank_state = {"rng": capture_rng() if save_rng else None, "extra": dict(rank_extra or {})}
        state = model_space.build_save_state(chunks, optimizer, scheduler, run, rank_state,
                                             self._staging if async_save else None, places)
        manifest = {
            "format": model_space.FORMAT, "megatron_opt_version": VERSION, "iteration": it,
            "data_parallel_size": model_space.data_parallel_size(chunks), "world_size": collectives.world_size(None),
            "fingerprint": model_space.fingerprint(chunks, optimizer, params), "scheduler": scheduler is not None,
            "param_keys": kind, "model_parallel_sizes": model_space.model_parallel_sizes(chunks),
        }
        group = _new_group()
        job = lambda: writer.write_iteration(Path(path), it, state, manifest, keep_latest_k, group)  # noqa: E731
        if async_save:
            self._pending = _PendingSave(it, job, group)
            return
        _together(job, f"checkpoint save of iteration {it}", group)

    def check_pending_save(self, block: bool = False) -> None:
        """Finish a background save if it is done on every rank (or wait for it with ``block``), and raise
        its error on every rank. Call it once per step: it costs one small all-reduce while a save runs."""
        pending = self._pending
        if pending is None:
            return
        if block:
            pending.thread.join()
        what = f"background checkpoint save of iteration {pending.iteration}"
        done = torch.tensor([0.0 if pending.thread.is_alive() else 1.0], device=collectives.flag_device(None))
        if collectives.world_size(None) > 1:
            try:
                collectives.all_reduce(done, None, op=dist.ReduceOp.MIN)
            except Exception as exc:
                raise _peer_failure(what, exc) from exc
        if done.item() < 1.0:
            return
        self._pending = None
        pending.thread.join()
        _together(pending.report, what, pending.group)

    def wait_for_pending_save(self) -> None:
        """Block until a background save finished everywhere; raise its error on every rank."""
        self.check_pending_save(block=True)

    # ------------------------------------------------------------------------- loading
    def load(self, path: Union[str, Path], model: Model, optimizer: Optional[Any] = None,
             scheduler: Optional[Any] = None, *, iteration: Optional[int] = None, load_optimizer: bool = True,
             load_rng: bool = True) -> LoadResult:
        """Load a checkpoint saved at any data-parallel size (every rank calls it).

        Checks the folder, the files (sizes, SHA-256) and the model's names, shapes and dtypes, reads
        everything into fresh tensors, rejects non-finite optimizer state, and only then writes the
        model, optimizer (unless ``load_optimizer=False``) and scheduler. RNG states (``load_rng``) and
        per-rank extras are restored when the world size equals the saved one. Any failure raises
        CheckpointError on every rank.
        """
        self.wait_for_pending_save()
        chunks = model_space.as_chunks(model)
        if optimizer is not None:
            model_space.check_optimizer(chunks, optimizer)
        opt = optimizer if load_optimizer else None
        rank, world = collectives.rank(None), collectives.world_size(None)

        model_parallel = model_space.is_model_parallel(chunks, optimizer)

        def find() -> tuple[Path, dict, str, dict]:
            folder = directory.resolve(path, iteration)
            manifest = directory.read_manifest(folder)
            where = folder / directory.MANIFEST
            return (folder, manifest, *_placements(chunks, manifest.get("param_keys", param_layout.LOCAL),
                                                   model_parallel, where))

        folder, manifest, kind, places = _together(find, f"checkpoint load from {path}")
        params = param_layout.fingerprint_params(chunks, kind, places)  # a collective with megatron-core's keys

        def check() -> None:
            validation.check_compatible(manifest, chunks, opt, scheduler, folder, params)
            validation.verify_files(folder, manifest, rank, world)

        _together(check, f"checkpoint load from {path}")
        # Checkpoints before the world size was recorded stored it as data_parallel_size.
        saved_world = manifest.get("world_size", manifest["data_parallel_size"])
        # Per-rank state (RNG, rank_extra) belongs to a rank's role: the same world size in another
        # layout gives a rank another role (older checkpoints, without sizes, were data-parallel).
        sizes = model_space.model_parallel_sizes(chunks)
        same_layout = saved_world == world and manifest.get("model_parallel_sizes", sizes) == sizes
        dest = model_space.build_load_destination(chunks, opt, scheduler, same_layout, places)
        group = _new_group()

        def read() -> None:
            needed = model_space.matrix_state_keys(opt, places)
            if needed:  # a whole-tensor rule's per-matrix state: refuse another TP split by name, before reading
                with dcp_failures(f"reading {folder}"):
                    saved = saved_tensor_shapes(dcp.FileSystemReader(str(folder)).read_metadata())
                missing = model_space.missing_matrix_state(needed, saved)
                if missing:
                    raise CheckpointError(f"{folder}: {missing}")
            with warnings.catch_warnings(), dcp_failures(f"reading {folder}"):
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(dest, storage_reader=dcp.FileSystemReader(str(folder)), planner=ModelSpaceLoadPlanner(),
                         process_group=group)
            bad = model_space.nonfinite_optimizer_state(dest)
            if bad:
                raise CheckpointError(f"{folder}: {bad}; refusing to load it (the next step would write NaN into "
                                      f"the params)")
            if opt is not None:
                scalars = dest["optim/scalars"]
                if len(scalars["param_groups"]) != len(opt.param_groups) or \
                        len(scalars["steps"]) != len(opt.scalar_state()["steps"]):
                    # Another layout split the optimizer otherwise (the experts' own groups at EP > 1).
                    try:
                        dest["optim/scalars"] = regrouped_scalar_state(opt, scalars)
                    except ValueError as exc:
                        raise CheckpointError(f"{folder}: {exc}") from None
            if scheduler is not None:
                validation.dry_run_scheduler_load(scheduler, dest["scheduler"], folder)

        _together(read, f"checkpoint load from {folder}", group)
        model_space.apply_loaded_state(dest, chunks, opt, scheduler, places)
        if optimizer is not None and not load_optimizer:
            optimizer.reload_model_params()
        mine = dest.get(model_space.rank_key())
        rng_restored = mine is not None and mine["rng"] is not None and load_rng
        if rng_restored:
            restore_rng(mine["rng"])
        run = dest["run"]
        return LoadResult(iteration=run["iteration"], consumed_samples=run["consumed_samples"],
                          saved_data_parallel_size=manifest["data_parallel_size"], path=str(folder),
                          extra=run.get("extra", {}), rank_extra=mine["extra"] if mine is not None else None,
                          rng_restored=rng_restored, saved_world_size=saved_world)


def _placements(chunks: Sequence[GradSource], kind: Optional[str], model_parallel: bool,
                where: Optional[Path] = None) -> tuple[str, dict]:
    """(param naming, placements by local key): a save's default naming (``kind`` None) or a checkpoint's."""
    if kind is None:
        kind = param_layout.default_kind(chunks, model_parallel)
    try:
        return kind, param_layout.placements(chunks, kind, model_parallel)
    except CheckpointError as exc:
        if where is None:
            raise
        raise CheckpointError(f"{where}: {exc}") from None


# ----------------------------------------------------------------------------- the module-level functions
_DEFAULT_ATTRIBUTE = "_megatron_opt_checkpointer"


def default_checkpointer(model: Model) -> Checkpointer:
    """The Checkpointer the module-level functions use for ``model``: kept on its first chunk, so it
    lives as long as the model does, and every model has its own."""
    first = model_space.as_chunks(model)[0]
    found = getattr(first, _DEFAULT_ATTRIBUTE, None)
    if found is None:
        found = Checkpointer()
        setattr(first, _DEFAULT_ATTRIBUTE, found)
    return found


def save(path: Union[str, Path], model: Model, optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
         **kwargs: Any) -> None:
    """``default_checkpointer(model).save(...)``: see Checkpointer.save."""
    default_checkpointer(model).save(path, model, optimizer, scheduler, **kwargs)


def load(path: Union[str, Path], model: Model, optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
         **kwargs: Any) -> LoadResult:
    """``default_checkpointer(model).load(...)``: see Checkpointer.load."""
    return default_checkpointer(model).load(path, model, optimizer, scheduler, **kwargs)


def check_pending_save(model: Model, block: bool = False) -> None:
    """``default_checkpointer(model).check_pending_save(block)``: once per step after an async save()."""
    default_checkpointer(model).check_pending_save(block)


def wait_for_pending_save(model: Model) -> None:
    """``default_checkpointer(model).wait_for_pending_save()``: before exiting after an async save()."""
    default_checkpointer(model).wait_for_pending_save()


__all__ = ["Checkpointer", "LoadResult", "CHECKPOINT_GROUP_TIMEOUT", "default_checkpointer", "save", "load",
           "check_pending_save", "wait_for_pending_save"]
