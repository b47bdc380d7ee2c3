"""Kill -9 a rank in the middle of a checkpoint save (run as a script by test_checkpoint_kill.py, with the
repository root on PYTHONPATH so that it imports tests.support and tests.checkpoint).

    python tests/checkpoint/kill_worker.py --ckpt DIR --kill-at POINT --kill-rank R --marker-dir M
        2 gloo ranks train the fp32 TinyLM run of cases_checkpoint.py, saving every SAVE_EVERY
        iterations (keep_latest_k=KEEP): iteration 2 completes, then the save of iteration 4 runs
        with a hook that SIGKILLs rank R at POINT (see HOOKS). The hooking rank writes
        M/killed_rank<R> (holding POINT) just before it kills itself, so the caller can tell
        that the point was really reached; a survivor writes M/survivor_rank<r>.json (what it
        raised, and when).
    python tests/checkpoint/kill_worker.py --resume --ckpt DIR [DIR ...] --out PREFIX
        for each DIR, 2 fresh ranks (other init, other RNG) load() it, train on to iteration
        FINAL saving like the killed run did, and write PREFIX.rank<r>.pt:
        {DIR: dict(iteration=loaded, rng=..., params=..., state=..., scalars=..., sched=...) or dict(error=...)}
    python tests/checkpoint/kill_worker.py --straight --ckpt DIR --out PREFIX
        the uninterrupted run (same seeds, same saves) to FINAL: the bitwise reference.

The launcher (this script's main process) starts the ranks with multiprocessing (spawn), has
them meet through a FileStore in a fresh folder beside the (first) --ckpt folder (no TCP port, see
dist_harness.file_rendezvous), waits for them, and once one rank has died gives the others GRACE_S to end on their
own (they usually fail in their next collective) before killing them. It prints one JSON line: each rank's
exit code and whether the launcher had to kill it. The caller should still run it in its own
session and kill the process group on a wall-clock timeout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from tests.support.dist_harness import file_rendezvous

WORLD = 2
SAVE_EVERY, KILL_ITERATION, FINAL, KEEP = 2, 4, 6, 1
PG_TIMEOUT_S = 60
GRACE_S = 20.0

# POINT -> where the hook sits. Rank 1 takes part in the DCP write, the hashing and the hash gather;
# everything from the manifest on runs on rank 0 only.
HOOKS = {
    "write_data:before": "FileSystemWriter.write_data, before it runs",
    "write_data:during": "after the first item went into this rank's data file (flushed, not fsynced)",
    "write_data:after": "FileSystemWriter.write_data returned (this rank's file written and fsynced)",
    "metadata:before": "FileSystemWriter.finish (rank 0 writes .metadata), before it runs",
    "metadata:during": ".metadata.tmp written, before its rename to .metadata",
    "metadata:after": "FileSystemWriter.finish returned",
    "sha256:before": "directory.sha256_of, before hashing this rank's first file",
    "sha256:after": "directory.sha256_of returned",
    "hash_gather:after": "the all_gather_object of the hashes returned (rank 0 goes on to commit alone)",
    "manifest:before": "directory.write_manifest, before it runs",
    "manifest:during": "manifest .tmp written and fsynced, before os.replace",
    "manifest:after": "directory.write_manifest returned (= before directory.commit)",
    "commit:after": "directory.commit returned (iter folder renamed), before directory.write_tracker",
    "tracker:during": "tracker .tmp written and fsynced, before os.replace",
    "tracker:replaced": "os.replace of the tracker returned, before the directory fsync",
    "tracker:after": "directory.write_tracker returned, before directory.prune",
    "prune:during": "directory.prune removed the first file of the folder it prunes",
    "prune:after": "directory.prune returned, before the final collective",
    "resave:between_renames": "re-save of iteration 4 (the tracker's): after renaming the old folder aside, "
                              "before renaming the new one into place",
}


# ----------------------------------------------------------------------------- the kill hooks
def _die(point: str, rank: int, marker_dir: str) -> None:
    Path(marker_dir, f"killed_rank{rank}").write_text(point)  # its mtime is the time of the kill
    os.kill(os.getpid(), signal.SIGKILL)  # a signal a process sends itself is delivered before kill() returns


def _wrap(owner, name: str, before=None, after=None) -> None:
    """Replace owner.name by a wrapper calling before(*args) / after(result, *args) around it."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = real(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def install_hook(point: str, rank: int, marker_dir: str) -> None:
    """Arrange for this process to SIGKILL itself at ``point`` of the next save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from megatron_opt.checkpoint import directory

    if point not in HOOKS:
        raise SystemExit(f"unknown kill point {point!r}; known: {sorted(HOOKS)}")
    die = lambda *a, **k: _die(point, rank, marker_dir)  # noqa: E731
    stage, _, when = point.partition(":")
    if stage in ("write_data", "metadata") and when in ("before", "after"):
        method = "write_data" if stage == "write_data" else "finish"
        _wrap(dcp.FileSystemWriter, method, **{when: die})
    elif point == "write_data:during":
        real_item = dcp_fs._write_item

        def write_item(transforms, stream, *args, **kwargs):
            result = real_item(transforms, stream, *args, **kwargs)
            stream.flush()  # a partial file on disk, as a kill in the middle of the write leaves it
            die()
            return result

        dcp_fs._write_item = write_item
    elif point == "metadata:during":
        real_rename = dcp_fs.FileSystem.rename

        def rename(self, path, new_path):
            if Path(path).name == ".metadata.tmp":
                die()
            return real_rename(self, path, new_path)

        dcp_fs.FileSystem.rename = rename
    elif stage in ("sha256", "manifest") and when in ("before", "after"):
        _wrap(directory, "sha256_of" if stage == "sha256" else "write_manifest", **{when: die})
    elif point == "hash_gather:after":
        armed = []
        _wrap(directory, "sha256_of", after=lambda *a, **k: armed.append(1))
        real_gather = dist.all_gather_object

        def all_gather_object(output, obj, *args, **kwargs):
            real_gather(output, obj, *args, **kwargs)
            if armed and isinstance(obj, dict):  # the {file: sha256} gather, not raise_together's
                die()

        dist.all_gather_object = all_gather_object
    elif point in ("manifest:during", "tracker:during", "tracker:replaced"):
        target = directory.MANIFEST if stage == "manifest" else directory.TRACKER
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            hit = Path(dst).name == target
            if hit and when == "during":
                die()
            real_replace(src, dst, *args, **kwargs)
            if hit and when == "replaced":
                die()

        os.replace = replace
    elif point == "commit:after":
        _wrap(directory, "commit", after=die)
    elif point == "tracker:after":
        _wrap(directory, "write_tracker", after=die)
    elif point == "prune:after":
        _wrap(directory, "prune", after=die)
    elif point == "prune:during":
        pruning = []
        _wrap(directory, "prune", before=lambda *a, **k: pruning.append(1))
        real_unlink = os.unlink

        def unlink(*args, **kwargs):
            real_unlink(*args, **kwargs)
            if pruning:
                die()

        os.unlink = unlink
    elif point == "resave:between_renames":
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            real_rename(src, dst, *args, **kwargs)
            if Path(dst).name.endswith(".replaced"):
                die()

        os.rename = rename
    else:  # pragma: no cover - HOOKS and this function disagree
        raise AssertionError(point)


# ----------------------------------------------------------------------------- the ranks
def _train_and_save(ddp, opt, sched, start: int, stop: int, ckpt_dir: str, before_save=None) -> None:
    """Iterations start+1 .. stop, one optimizer step each, saving every SAVE_EVERY (as a training loop does)."""
    from tests.checkpoint import cases_checkpoint as cc
    import megatron_opt.checkpoint as ckpt

    for it in range(start + 1, stop + 1):
        cc.train(ddp, opt, sched, 1)
        if it % SAVE_EVERY == 0:
            if before_save is not None:
                before_save(it)
            ckpt.save(ckpt_dir, ddp, opt, sched, iteration=it, consumed_samples=it * cc.MB * cc.GA * WORLD,
                      keep_latest_k=KEEP)


def _fresh_run(rank: int, resumed: bool):
    import torch

    from tests.checkpoint import cases_checkpoint as cc

    # The seeding of cases_checkpoint.resume_case: a resumed run starts from another init and another
    # RNG state, so only load() can make it agree with the straight run.
    torch.manual_seed(5 if resumed else 1000 + rank)
    model, ddp, opt, sched = cc.build_run("fp32", seed=99 if resumed else 7)
    return model, ddp, opt, sched


def _digest(model, opt, sched) -> dict:
    from tests.checkpoint import cases_checkpoint as cc

    return cc.digest(model, opt, sched)


def _rank_kill(rank: int, args) -> None:
    from tests.checkpoint import cases_checkpoint as cc
    import megatron_opt.checkpoint as ckpt

    model, ddp, opt, sched = _fresh_run(rank, resumed=False)

    def before_save(it: int) -> None:
        if it == KILL_ITERATION and args.kill_at != "resave:between_renames" and rank == args.kill_rank:
            install_hook(args.kill_at, rank, args.marker_dir)

    _train_and_save(ddp, opt, sched, 0, KILL_ITERATION, args.ckpt, before_save)
    if args.kill_at == "resave:between_renames":
        # Save the iteration the tracker names once more (as an exit handler saving right after a
        # periodic save of the same step does).
        if rank == args.kill_rank:
            install_hook(args.kill_at, rank, args.marker_dir)
        ckpt.save(args.ckpt, ddp, opt, sched, iteration=KILL_ITERATION,
                  consumed_samples=KILL_ITERATION * cc.MB * cc.GA * WORLD, keep_latest_k=KEEP)


def _rank_resume(rank: int, args) -> None:
    import torch

    import megatron_opt.checkpoint as ckpt

    results = {}
    for folder in args.ckpt:
        model, ddp, opt, sched = _fresh_run(rank, resumed=True)
        try:
            state = ckpt.load(folder, ddp, opt, sched)
        except Exception as exc:  # load() raises the same CheckpointError on every rank
            results[folder] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        _train_and_save(ddp, opt, sched, state.iteration, FINAL, folder)
        results[folder] = dict(_digest(model, opt, sched), iteration=state.iteration, rng=state.rng_restored)
    torch.save(results, f"{args.out}.rank{rank}.pt")


def _rank_straight(rank: int, args) -> None:
    import torch

    model, ddp, opt, sched = _fresh_run(rank, resumed=False)
    _train_and_save(ddp, opt, sched, 0, FINAL, args.ckpt[0])
    torch.save(_digest(model, opt, sched), f"{args.out}.rank{rank}.pt")


def _rank_main(rank: int, init_method: str, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        {"kill": _rank_kill, "resume": _rank_resume, "straight": _rank_straight}[args.mode](rank, args)
    except BaseException as exc:
        # A survivor of a killed peer ends here (its next collective fails); say why (the caller
        # checks what it raised, and when), and leave without tearing down a process group whose
        # peer is gone.
        if args.mode == "kill":
            Path(args.marker_dir, f"survivor_rank{rank}.json").write_text(json.dumps(
                {"error": type(exc).__name__, "message": str(exc)[:2000], "at": time.time()}))
        sys.stderr.write(f"--- rank {rank} ---\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    # Leave together and without tearing the gloo groups down: on a loaded machine a rank that
    # destroys its groups while its peer is still closing them can abort in gloo's teardown.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- the launcher
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", dest="mode", action="store_const", const="resume")
    mode.add_argument("--straight", dest="mode", action="store_const", const="straight")
    p.set_defaults(mode="kill")
    p.add_argument("--ckpt", nargs="+", required=True)
    p.add_argument("--kill-at", choices=sorted(HOOKS))
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--marker-dir")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.mode == "kill" and (args.kill_at is None or args.marker_dir is None):
        p.error("a kill run needs --kill-at and --marker-dir")
    if args.mode != "kill" and args.out is None:
        p.error("--resume and --straight need --out")
    if args.mode == "kill":
        args.ckpt = args.ckpt[0]

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ckpt = args.ckpt if args.mode == "kill" else args.ckpt[0]
    store_dir, init_method = file_rendezvous(str(Path(ckpt).resolve().parent))
    try:
        exitcodes, killed = _launch(ctx, init_method, args)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    report = {"exitcodes": exitcodes, "killed_by_launcher": killed}
    print(json.dumps(report), flush=True)
    return 0 if all(code == 0 for code in exitcodes) else 3


def _launch(ctx, init_method: str, args) -> tuple[list, list]:
    """Start the ranks, wait for them (GRACE_S after the first death, kill the rest); their exit codes."""
    from multiprocessing.connection import wait

    procs = [ctx.Process(target=_rank_main, args=(rank, init_method, args)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    running = {proc.sentinel: proc for proc in procs}
    deadline = None  # GRACE_S after the first rank that failed
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ended = wait(list(running), timeout)  # returns when a rank exits, or at the deadline
        if not ended:
            break
        for sentinel in ended:
            proc = running.pop(sentinel)
            proc.join()
            if proc.exitcode != 0 and deadline is None:
                deadline = time.monotonic() + GRACE_S
    killed = []
    for rank, proc in enumerate(procs):
        if proc.sentinel in running:
            proc.kill()
            proc.join()
            killed.append(rank)
    return [proc.exitcode for proc in procs], killed


if __name__ == "__main__":
    sys.exit(main())
