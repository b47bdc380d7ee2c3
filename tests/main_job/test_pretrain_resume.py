"""The main job never loses a run: --load of a missing, empty or tracker-less folder, --save over newer
iterations, the schedule and batch on resume (--override-opt_param-scheduler), --no-save-optim and
--exit-signal-handler.

The --load/--save rules are decided before anything runs (parse_args, checked here in-process on
folders laid out as megatron_opt.checkpoint lays them out); then torchrun runs: a first run into a
missing --load folder, a resume without the tracker at another DP size with the command line's
schedule, and a run ended by SIGTERM that saves first.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

import megatron_opt as mo
import megatron_opt.checkpoint as ckpt
from tests.main_job.main_job_script import ENV, ROOT, SCRIPT, TORCHRUN, log_lines, write_fake_manifest
from megatron_opt_train.flags import parse_args
from megatron_opt.megatron import arguments as megatron_args

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "12", "--lr", "3e-3", "--lr-warmup-iters", "1",
         "--eval-iters", "0"]
TRACKER = ckpt.TRACKER


def _fake_checkpoint(root, iterations: list[int], tracker: bool = True) -> None:
    """iter_* folders with a manifest (what marks one complete), and the tracker at the newest."""
    for it in iterations:
        write_fake_manifest(root / f"iter_{it:07d}", it)
    if tracker:
        (root / ckpt.TRACKER).write_text(f"{max(iterations)}\n")


def _parse(monkeypatch, flags: list[str]):
    monkeypatch.setenv("WORLD_SIZE", "2")
    return parse_args(flags)


def _refused(monkeypatch, capsys, flags: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("error:") == 1, err
    return err


def test_load_and_save_rules(tmp_path, monkeypatch, capsys):
    newer = tmp_path / "newer"
    _fake_checkpoint(newer, [20, 40])
    missing, empty = tmp_path / "typo", tmp_path / "empty"
    empty.mkdir()
    # --save over a newer checkpoint: refused before anything runs, saying why and what to do
    err = _refused(monkeypatch, capsys, ["--load", str(missing), "--save", str(newer)])
    assert (f"--save {newer} already holds iteration 40, newer than this run's start (it trains from scratch "
            f"(--load {missing}: the folder does not exist))") in err, err
    assert f"Resume it (--load {newer})" in err and "--overwrite-newer-checkpoints" in err, err
    err = _refused(monkeypatch, capsys, ["--save", str(newer)])
    assert "(it trains from scratch (no --load))" in err, err
    args = _parse(monkeypatch, ["--load", str(missing), "--save", str(newer), "--overwrite-newer-checkpoints"])
    assert args.load_iteration is None and args.load_note == "the folder does not exist"
    # resuming the folder itself is fine; so is an empty or missing --save folder
    assert _parse(monkeypatch, ["--load", str(newer), "--save", str(newer)]).load_iteration == 40
    assert _parse(monkeypatch, ["--load", str(empty), "--save", str(empty)]).load_note == "the folder is empty"
    # no tracker: the newest complete folder, as megatron_opt.checkpoint.load takes it
    (newer / TRACKER).unlink()
    assert _parse(monkeypatch, ["--load", str(newer)]).load_iteration == 40
    err = _refused(monkeypatch, capsys, ["--load", str(newer / "iter_0000020"), "--save", str(newer)])
    assert "already holds iteration 40, newer than this run's start (it resumes from iteration 20" in err, err
    # a tracker naming a folder that is gone is an error, not a fresh start
    (newer / TRACKER).write_text("60\n")
    assert "the tracker points at a checkpoint that is not there" in _refused(monkeypatch, capsys,
                                                                             ["--load", str(newer)])
    # Megatron-LM's --exit-on-missing-checkpoint
    err = _refused(monkeypatch, capsys, ["--load", str(empty), "--exit-on-missing-checkpoint"])
    assert f"--load {empty}: no checkpoint (the folder is empty); --exit-on-missing-checkpoint is set" in err, err


def test_resume_warnings_name_what_differs(monkeypatch):
    from megatron_opt_train.components import resume as pretrain_resume

    args = _parse(monkeypatch, [*SMALL, "--train-iters", "8", "--override-opt_param-scheduler"])
    sched = megatron_args.scheduler_from_args(type("Groups", (), {"param_groups": []})(), args)
    command_line = pretrain_resume.schedule_values(sched)
    saved = {**command_line, "lr_decay_steps": 48, "max_lr": 1e-3}
    out = pretrain_resume.resume_warnings(args, {"global_batch_size": 24, "schedule": saved}, sched, command_line)
    assert len(out) == 2, out
    assert "trained at global batch size 24, this run uses 12" in out[0], out
    assert "max_lr 0.001 -> 0.003; lr_decay_steps 48 -> 96" in out[1], out
    assert "follows the command line's (--override-opt_param-scheduler)" in out[1], out
    args = _parse(monkeypatch, [*SMALL, "--train-iters", "8"])
    out = pretrain_resume.resume_warnings(args, {"global_batch_size": 12, "schedule": saved}, sched, command_line)
    assert len(out) == 1 and "keeps the checkpoint's (--use-checkpoint-opt_param-scheduler" in out[0], out
    assert pretrain_resume.resume_warnings(args, {"global_batch_size": 12, "schedule": command_line}, sched,
                                           command_line) == []


def _run(world: int, flags: list[str]) -> str:
    out = subprocess.run([*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *SMALL, *flags], capture_output=True,
                         text=True, timeout=240, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(600)
def test_resume_without_tracker_at_another_dp_with_the_command_lines_schedule(tmp_path, monkeypatch):
    folder, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    first = _run(2, ["--train-iters", "4", "--load", str(folder), "--save", str(folder), "--save-interval", "2",
                     "--no-save-optim", "--verify-interval", "1"])  # verify mode checks every step, end to end
    assert f"pretrain_gpt.py: --load {folder}: no checkpoint (the folder does not exist); training from scratch" \
        in first, first
    assert ckpt.latest_iteration(folder) == 4
    (folder / TRACKER).unlink()  # as if the tracker had been lost: the newest complete folder is taken
    flags = ["--train-iters", "8", "--load", str(folder), "--save", str(folder), "--override-opt_param-scheduler",
             "--log-json", str(log)]
    second = _run(3, flags)
    assert "resumed from iteration 4 (saved at DP=2, now DP=3)" in second, second
    assert f"note: {folder} has no optimizer state (saved with --no-save-optim)" in second, second
    assert re.search(r"warning: the checkpoint's LR/weight-decay schedule differs from the command line's "
                     r"\(checkpoint -> command line, lengths in samples: .*lr_decay_steps 48 -> 96.*\): this run "
                     r"follows the command line's \(--override-opt_param-scheduler\)", second), second
    assert [int(m["iteration"]) for m in log_lines(second)] == [5, 6, 7, 8]
    # the lr of iterations 5-8 is the command line's 8-iteration schedule after 48 samples, not 0
    monkeypatch.setenv("WORLD_SIZE", "3")
    args = parse_args([*SMALL, *flags])
    group = {"params": [], "wd_mult": 1.0}
    sched = mo.OptimizerParamScheduler(type("G", (), {"param_groups": [group]})(),
                                       **megatron_args.scheduler_kwargs_from_args(args))
    sched.step(48)
    expected = []
    for _ in range(4):
        sched.step(12)
        expected.append(group["lr"])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["learning_rate"] for r in records] == expected and expected[0] > 0, (records, expected)
    assert ckpt.latest_iteration(folder) == 8


@pytest.mark.timeout(300)
def test_exit_signal_handler_saves_then_exits(tmp_path):
    folder, stdout_path = tmp_path / "ckpt", tmp_path / "stdout"
    cmd = [*TORCHRUN, "--nproc_per_node=2", SCRIPT, *SMALL, "--train-iters", "100000", "--save", str(folder),
           "--exit-signal-handler"]
    with open(stdout_path, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "iteration        3/" not in stdout_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, stdout_path.read_text()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to every rank
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = stdout_path.read_text()
    match = re.search(r"exiting after iteration (\d+): received SIGTERM \(--exit-signal-handler\)", out)
    assert match, out[-3000:] + err[-3000:]
    stopped = int(match[1])
    assert f"saved iteration {stopped} to {folder}" in out and ckpt.latest_iteration(folder) == stopped, out[-3000:]
    assert not re.search(r"exitcode\s*:\s*[1-9]", err), err[-3000:]  # no rank failed
