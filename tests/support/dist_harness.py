"""Persistent gloo worker pools: one process group per world size, many test cases inside it.

A test calls ``pool.run(func, *args)``; every rank imports ``func``'s module and runs it with the
same arguments, and the per-rank return values come back as a list. An exception on any rank
fails the test with that rank's traceback. A case that hangs (a rank stuck in a collective)
hits the timeout; the pool is then torn down and rebuilt for the next test.

A worker imports ``func``'s module by its package name (``tests.distributed.cases_parity``): a
spawned process starts with its parent's sys.path, which holds the repository root through pytest's
``pythonpath`` setting (pyproject.toml).
"""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

CASE_TIMEOUT_S = float(os.environ.get("MEGATRON_OPT_CASE_TIMEOUT", "180"))
PG_TIMEOUT_S = 60


class RemoteError(AssertionError):
    pass


def file_rendezvous(parent: Optional[str] = None) -> tuple[str, str]:
    """(folder, init_method) for ranks to meet through a FileStore in a fresh folder (inside
    ``parent``, or the system temp folder); the caller removes the folder when the ranks are done.

    Not a TCP port picked up front: a free port found by binding port 0 is released again, and
    until rank 0 binds it for its store (spawn + import torch: seconds on a loaded machine) any
    other process on the machine can take it (a gloo listener, another launcher's store); rank 0
    then dies with EADDRINUSE before anything runs.
    """
    folder = tempfile.mkdtemp(prefix=".megatron_opt_rendezvous_", dir=parent)
    return folder, "file://" + os.path.join(folder, "store")


def _stacks_path(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"stacks.{rank}")


def _live_groups() -> list:
    from torch.distributed import distributed_c10d

    return [pg for pg in distributed_c10d._world.pg_map if pg is not distributed_c10d.GroupMember.WORLD]


def _release_megatron_core_wrappers() -> None:
    """Empty the megatron-core DistributedDataParallel wrappers a case left behind (its calibration
    runs). megatron-core 0.16.1's wrapper is never freed: its grad hooks sit on autograd's C++
    AccumulateGrad nodes, which its fp32 optimizer shards (param views with autograd history) keep
    alive, a cycle Python's collector cannot see. The model, buffers and process groups (with their
    gloo threads) would outlive the case; an empty wrapper holds none of them."""
    module = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    if module is None:
        return
    import gc

    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, module.DistributedDataParallel):
            obj.__dict__.clear()
    gc.collect()


def _destroy_groups_created_since(before: set) -> None:
    """Destroy the process groups a case created (megatron-core's parallel_state alone makes ~37 per
    layout): gloo keeps threads and sockets per group, and over a whole suite a worker kept thousands
    of both. megatron-core's parallel_state is reset with them; cases initialise it when they need it."""
    import torch.distributed as dist

    if all(pg in before for pg in _live_groups()):
        return
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        _release_megatron_core_wrappers()
        parallel_state.destroy_model_parallel()  # also destroys its own gloo groups
        for name, value in list(vars(parallel_state).items()):
            if isinstance(value, dist.ProcessGroup):  # 0.16.1 forgets _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP*
                setattr(parallel_state, name, None)
    for pg in _live_groups():
        if pg not in before:
            dist.destroy_process_group(pg)


def _worker_main(rank: int, world_size: int, init_method: str, store_dir: str, conn) -> None:
    # On a case timeout the pool signals every rank to write its Python stacks: where a hang is.
    stacks_file = open(_stacks_path(store_dir, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
    faulthandler.enable()  # a crashing rank prints its stacks to stderr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args, kwargs = msg
        groups_before = set(_live_groups())
        try:
            fn = getattr(importlib.import_module(module), name)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # report everything, keep serving
            reply = ("err", traceback.format_exc())
        _destroy_groups_created_since(groups_before)
        conn.send(reply)
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._store_dir, init_method = file_rendezvous()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, init_method, self._store_dir, child),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.broken = False

    def run(self, fn: Callable, *args: Any, timeout: float = CASE_TIMEOUT_S, **kwargs: Any) -> list:
        msg = (fn.__module__, fn.__name__, args, kwargs)
        for conn in self._conns:
            conn.send(msg)
        results, errors = [None] * self.world_size, []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self.broken = True
                raise RemoteError(f"rank {rank} did not finish {fn.__name__} within {timeout:.0f}s (hang?)\n"
                                  + self._stacks())
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self.broken = True
                self._procs[rank].join(timeout=5)
                raise RemoteError(f"rank {rank} died in {fn.__name__} (exit code {self._procs[rank].exitcode})")
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RemoteError(f"{fn.__name__} failed at world size {self.world_size}:\n" + "\n".join(errors))
        return results

    def _stacks(self) -> str:
        """Every live rank's Python stacks (and native ones when py-spy is installed), for a hang report."""
        for proc in self._procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        report = []
        for rank, proc in enumerate(self._procs):
            try:
                with open(_stacks_path(self._store_dir, rank)) as f:
                    stacks = f.read()
            except OSError as e:
                stacks = f"(no stacks: {e})"
            report.append(f"--- rank {rank} (pid {proc.pid}, alive {proc.is_alive()}) ---\n{stacks[-6000:]}")
            py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
            if proc.is_alive() and os.path.exists(py_spy):
                try:
                    native = subprocess.run([py_spy, "dump", "--native", "--pid", str(proc.pid)],
                                            capture_output=True, text=True, timeout=60)
                    native_stacks = native.stdout + native.stderr
                except subprocess.TimeoutExpired:  # the hang report itself must not hang or mask the error
                    native_stacks = "(py-spy dump did not finish within 60 s)"
                report.append(f"--- rank {rank} py-spy ---\n{native_stacks[-8000:]}")
        return "\n".join(report)

    def close(self) -> None:
        if not self.broken:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(timeout=5 if not self.broken else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self._store_dir, ignore_errors=True)


class Pools:
    """Lazily started pools, one per world size, shared by the whole test session."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
