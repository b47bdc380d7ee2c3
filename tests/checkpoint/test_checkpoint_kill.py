"""Kill -9 of one rank at many points of a checkpoint save: the newest complete checkpoint loads and
the run resumes bit-exact.

Each point runs tests/checkpoint/kill_worker.py in its own session: 2 gloo ranks train the fp32 TinyLM run,
save iteration 2 (complete), train to 4 and save again, and one rank SIGKILLs itself at the point
(the survivor fails in its next collective or is killed after a grace period, as a job scheduler
would). Right after the kill the directory is inspected; then fresh ranks (other init, other RNG)
load() whatever it holds, train on to iteration 6 saving every 2 iterations as before, and must
equal the uninterrupted run bitwise (params, optimizer state, scalars, scheduler).

Expected iteration after the kill: 2 for every point before the tracker's os.replace, 4 from
there on; iter_0000004 is visible exactly from directory.commit on (see POINTS).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

import megatron_opt.checkpoint as ckpt
from megatron_opt.checkpoint import directory

TESTS_DIR = Path(__file__).resolve().parent
WORKER = TESTS_DIR / "kill_worker.py"
REPO = TESTS_DIR.parent.parent
KILL_TIMEOUT_S = 120
RESUME_TIMEOUT_S = 240
PARALLEL = 2  # kill runs at once (each is 2 ranks)
FINAL = 6
SURVIVOR_BOUND_S = 15  # gloo: about 2 s; well inside kill_worker's GRACE_S, on a loaded machine


class Point(NamedTuple):
    name: str  # a key of kill_worker.HOOKS
    rank: int  # the rank that is killed
    expect: int  # the iteration the tracker names after the kill, and that load() resumes from
    iter4_visible: bool  # whether iter_0000004 exists (then complete) after the kill


POINTS = [
    # DCP writing the data files: nothing visible changes.
    Point("write_data:before", 0, 2, False),
    Point("write_data:before", 1, 2, False),
    Point("write_data:during", 0, 2, False),
    Point("write_data:during", 1, 2, False),
    Point("write_data:after", 0, 2, False),
    Point("write_data:after", 1, 2, False),
    # DCP's .metadata (rank 0, the coordinator)
    Point("metadata:before", 0, 2, False),
    Point("metadata:during", 0, 2, False),
    Point("metadata:after", 0, 2, False),
    # the SHA-256 of each rank's files and their gather
    Point("sha256:before", 1, 2, False),
    Point("sha256:after", 0, 2, False),
    Point("sha256:after", 1, 2, False),
    # rank 1 dies once it has handed over its hashes: rank 0 commits on its own (no collective
    # until after prune), so iteration 4 becomes the latest.
    Point("hash_gather:after", 1, 4, True),
    # rank 0's commit: manifest, rename, tracker, retention
    Point("manifest:before", 0, 2, False),
    Point("manifest:during", 0, 2, False),
    Point("manifest:after", 0, 2, False),  # = just before directory.commit
    Point("commit:after", 0, 2, True),  # renamed, tracker not yet updated: load() follows the tracker
    Point("tracker:during", 0, 2, True),
    Point("tracker:replaced", 0, 4, True),
    Point("tracker:after", 0, 4, True),
    Point("prune:during", 0, 4, True),
    Point("prune:after", 0, 4, True),
    # Saving the iteration the tracker names once more: directory.commit parks the old folder as
    # iter_N.replaced before renaming the new one in; a kill in between leaves only the parked one,
    # which load() takes and the next save puts back.
    Point("resave:between_renames", 0, 4, False),
]


def _point_id(p: Point) -> str:
    return f"{p.name.replace(':', '-')}-rank{p.rank}"


def _points() -> list[Point]:
    return [p.values[0] if hasattr(p, "values") else p for p in POINTS]


# ----------------------------------------------------------------------------- running the worker
def _run_worker(args: list[str], timeout: float) -> dict:
    """Run kill_worker.py in its own session; on timeout kill the whole process group."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(REPO), env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    report = None
    for line in reversed(out.strip().splitlines()):
        try:
            report = json.loads(line)
            break
        except ValueError:
            continue
    return dict(returncode=proc.returncode, timed_out=timed_out, report=report, stdout=out, stderr=err[-4000:])


def _load_ranks(prefix: Path) -> list:
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(2)]


def _inspect(root: Path) -> dict:
    """What a killed save left: the tracker, and for each iter_* entry whether it is complete and intact."""
    try:
        tracker: Optional[int] = ckpt.latest_iteration(root)
    except ValueError as exc:
        tracker = f"unreadable: {exc}"  # type: ignore[assignment]
    folders = {}
    for child in sorted(root.glob("iter_*")):
        info = dict(manifest=(child / directory.MANIFEST).exists(), verify=None)
        if info["manifest"]:
            try:
                ckpt.verify_files(child, directory.read_manifest(child))
                info["verify"] = "ok"
            except Exception as exc:
                info["verify"] = f"{type(exc).__name__}: {exc}"
        folders[child.name] = info
    return dict(tracker=tracker, folders=folders, listing=sorted(p.name for p in root.iterdir()))


def _selected(request) -> list[Point]:
    """The points whose tests were collected (so `-k` runs only the kills it needs)."""
    names = set()
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if spec is not None and "point" in spec.params and Path(str(item.fspath)) == Path(__file__):
            names.add(spec.params["point"])
    return [p for p in _points() if p in names]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list:
    """The uninterrupted run to iteration FINAL (same seeds, same saves), per rank."""
    tmp = tmp_path_factory.mktemp("straight")
    res = _run_worker(["--straight", "--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "digest")], RESUME_TIMEOUT_S)
    assert res["returncode"] == 0 and not res["timed_out"], \
        f"the uninterrupted run failed: {res['report']} (timed out: {res['timed_out']})\n{res['stderr']}"
    return _load_ranks(tmp / "digest")


@pytest.fixture(scope="module")
def killed(request, tmp_path_factory) -> dict:
    """Every selected point's kill run and the state it left, then one resume of all of them."""
    base = tmp_path_factory.mktemp("killed")

    def one(point: Point) -> tuple[Point, dict]:
        where = base / _point_id(point)
        (where / "markers").mkdir(parents=True)
        res = _run_worker(["--ckpt", str(where / "ckpt"), "--kill-at", point.name, "--kill-rank", str(point.rank),
                           "--marker-dir", str(where / "markers")], KILL_TIMEOUT_S)
        files = sorted((where / "markers").iterdir())
        markers = {p.name: p.read_text() for p in files if p.name.startswith("killed_rank")}
        killed_at = max((p.stat().st_mtime for p in files if p.name.startswith("killed_rank")), default=None)
        survivors = {int(p.stem[len("survivor_rank"):]): json.loads(p.read_text())
                     for p in files if p.name.startswith("survivor_rank")}
        state = _inspect(where / "ckpt") if (where / "ckpt").exists() else None
        return point, dict(run=res, markers=markers, killed_at=killed_at, survivors=survivors, after_kill=state,
                           ckpt=str(where / "ckpt"))

    with ThreadPoolExecutor(PARALLEL) as pool:
        outcomes = dict(pool.map(one, _selected(request)))
    dirs = [o["ckpt"] for o in outcomes.values() if o["after_kill"] is not None]
    resumed = None
    if dirs:
        resumed = _run_worker(["--resume", "--ckpt", *dirs, "--out", str(base / "resumed")], RESUME_TIMEOUT_S)
        if resumed["returncode"] == 0:
            per_rank = _load_ranks(base / "resumed")
            for o in outcomes.values():
                o["resumed"] = [r.get(o["ckpt"]) for r in per_rank]
                o["after_resume"] = _inspect(Path(o["ckpt"]))
    for o in outcomes.values():
        o["resume_run"] = resumed
    return outcomes


# ----------------------------------------------------------------------------- the tests
def _equal(a: dict, b: dict, where: str) -> None:
    assert len(a["params"]) == len(b["params"]), where
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x, y), f"{where}: param {i} differs from the uninterrupted run"
    assert a["state"].keys() == b["state"].keys(), where
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"{where}: optimizer state {k} differs"
    assert a["scalars"] == b["scalars"], where
    assert a["sched"] == b["sched"], where


@pytest.mark.parametrize("point", POINTS, ids=lambda p: _point_id(p) if isinstance(p, Point) else None)
def test_kill_during_save_then_resume_bit_exact(point: Point, killed, reference):
    o = killed[point]
    run = o["run"]
    # 1. The rank really died at the point, by SIGKILL, and the whole run ended in time.
    assert not run["timed_out"], f"the killed run did not end within {KILL_TIMEOUT_S}s: {run}"
    assert o["markers"] == {f"killed_rank{point.rank}": point.name}, \
        f"the hook at {point.name} did not fire on rank {point.rank} (markers {o['markers']}): {run}"
    assert run["report"] is not None and run["report"]["exitcodes"][point.rank] == -signal.SIGKILL, run

    # The survivor raised a CheckpointError on its own soon after the kill (gloo reports the closed
    # connection in its next collective), not the backend's error, and was not left waiting.
    assert list(o["survivors"]) == [1 - point.rank], (o["survivors"], run["stderr"])
    survivor = o["survivors"][1 - point.rank]
    assert survivor["error"] == "CheckpointError", survivor
    assert survivor["at"] - o["killed_at"] < SURVIVOR_BOUND_S, (survivor["at"] - o["killed_at"], survivor)
    assert run["report"]["killed_by_launcher"] == [], run["report"]

    # 2. What is visible on disk: the tracker names a complete, intact folder; iter_0000004 is either
    #    absent or complete; nothing newer than the tracker's folder is broken.
    state = o["after_kill"]
    assert state is not None, "the checkpoint directory is gone"
    assert state["tracker"] == point.expect, f"tracker after a kill at {point.name}: {state}"
    named = f"iter_{point.expect:07d}"
    info = state["folders"].get(named) or state["folders"].get(named + ".replaced", {})
    assert info.get("verify") == "ok", f"the tracker names {named}, which is not intact: {state}"
    assert ("iter_0000004" in state["folders"]) == point.iter4_visible, state
    for name, info in state["folders"].items():
        if name[5:].isdigit() and int(name[5:]) >= point.expect:
            assert info["manifest"] and info["verify"] == "ok", f"{name} is visible but not complete: {state}"
    assert not any(n.endswith(".replaced") for n in state["listing"]) or point.name.startswith("resave"), state

    # 3. A fresh run loads the newest complete checkpoint and resumes bit-exact.
    resume = o["resume_run"]
    assert resume is not None and resume["returncode"] == 0 and not resume["timed_out"], resume
    for rank, (got, want) in enumerate(zip(o["resumed"], reference)):
        assert got is not None and "error" not in got, f"rank {rank}: load after a kill at {point.name}: {got}"
        assert got["iteration"] == point.expect and got["rng"], (rank, got["iteration"], got["rng"])
        _equal(got, want, f"kill at {point.name} on rank {point.rank}, resumed rank {rank}")

    # 4. The resumed run's own saves cleaned up: only iteration FINAL is left (keep_latest_k=1).
    after = o["after_resume"]
    assert after["tracker"] == FINAL and list(after["folders"]) == [f"iter_{FINAL:07d}"], after
    assert after["folders"][f"iter_{FINAL:07d}"]["verify"] == "ok", after
    assert not [n for n in after["listing"] if n.startswith(".tmp_iter_") or n.endswith(".replaced")], after


def test_every_point_is_covered():
    """At least 10 distinct points; both ranks are killed somewhere; each HOOKS entry has a case."""
    from tests.checkpoint import kill_worker

    pts = _points()
    assert {p.name for p in pts} == set(kill_worker.HOOKS)
    assert len({p.name for p in pts}) >= 10 and {p.rank for p in pts} == {0, 1}
