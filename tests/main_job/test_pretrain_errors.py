"""scripts/pretrain_gpt.py: invalid flags fail early with a message naming the flag, a diverged run
stops (--check-for-nan-in-loss-and-grad) while an fp16 scaler backoff does not, and the step
watchdog ends a rank whose peer has stopped instead of letting it wait for the collective timeout.

Flag checks run in this process (parse_args of the imported script, which is what the script runs
first) and, for a few, through the real command line: plain python and torchrun. The watchdog tests
run the script with a fault put in (pretrain_with_faults.py): 2 ranks under torchrun, rank 1 stops
itself outside its train step and rank 0 must exit with the watchdog's code and message within
--watchdog-min-seconds plus some slack; a checkpoint save slower than that must not trip it.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.main_job.main_job_script import ENV, ROOT, SCRIPT, TORCHRUN, log_lines
from megatron_opt_train.flags import parse_args

SMALL = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--micro-batch-size", "2"]


# (flags, strings stderr must contain)
BAD = [
    (["--heads", "3"], ["--hidden 128", "--heads 3", "not divisible"]),
    (["--hidden", "30", "--heads", "4"], ["--hidden 30", "--heads 4"]),
    (["--steps", "3", "--warmup-steps", "5"],
     ["--warmup-steps 5", "--steps 3", "lower --warmup-steps or raise --steps"]),
    (["--steps", "10", "--warmup-steps", "-1"], ["--warmup-steps -1"]),
    (["--fp16", "--initial-loss-scale", "inf"], ["--initial-loss-scale", "got inf"]),
    (["--fp16", "--initial-loss-scale", "nan"], ["--initial-loss-scale", "got nan"]),
    (["--fp16", "--initial-loss-scale", "0"], ["--initial-loss-scale", "got 0"]),
    (["--fp16", "--initial-loss-scale", "-8"], ["--initial-loss-scale", "got -8"]),
    (["--steps", "0"], ["--steps must be a positive integer, got 0"]),
    (["--steps", "-5"], ["--steps must be a positive integer, got -5"]),
    (["--micro-batch-size", "0"], ["--micro-batch-size must be a positive integer"]),
    (["--num-microbatches", "0"], ["--num-microbatches must be a positive integer"]),
    (["--seq-len", "0"], ["--seq-len must be a positive integer"]),
    (["--hidden", "0"], ["--hidden must be a positive integer"]),
    (["--layers", "0"], ["--layers must be a positive integer"]),
    (["--heads", "0"], ["--heads must be a positive integer"]),
    (["--save-interval", "0"], ["--save-interval must be a positive integer"]),
    (["--exit-interval", "0"], ["--exit-interval must be a positive integer"]),
    (["--exit-interval", "-2"], ["--exit-interval must be a positive integer, got -2"]),
    (["--keep-latest-k", "0"], ["--keep-latest-k must be a positive integer"]),
    (["--bucket-size", "0"], ["--bucket-size must be a positive integer"]),
    (["--lr", "1e-4", "--min-lr", "1e-3"], ["--min-lr", "--lr"]),
    (["--lr", "nan"], ["--lr nan"]),
    (["--weight-decay", "-0.1"], ["--weight-decay"]),
    (["--distributed-timeout-minutes", "0"], ["--distributed-timeout-minutes must be a positive integer"]),
    (["--watchdog-multiple", "-1"], ["--watchdog-multiple"]),
    (["--watchdog-multiple", "inf"], ["--watchdog-multiple"]),
    (["--watchdog-min-seconds", "0"], ["--watchdog-min-seconds"]),
]


@pytest.mark.parametrize("flags, expected", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_invalid_flag_is_a_parser_error(monkeypatch, capsys, flags, expected):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    with pytest.raises(SystemExit) as exc:
        parse_args()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pretrain_gpt.py: error:" in err
    for text in expected:
        assert text in err, err


def test_valid_flags_pass(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *SMALL, "--steps", "6", "--warmup-steps", "0", "--fp16",
                                      "--initial-loss-scale", "1", "--save-interval", "1", "--exit-interval", "3",
                                      "--watchdog-multiple", "0", "--distributed-timeout-minutes", "1"])
    args = parse_args()
    assert args.watchdog_multiple == 0 and args.distributed_timeout_minutes == 1
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])  # the README command's defaults
    args = parse_args()
    assert (args.distributed_timeout_minutes, args.watchdog_multiple, args.watchdog_min_seconds) == (10, 20, 60)


def test_command_line_errors_exit_early():
    """The real command lines: plain python, and torchrun (the rank exits 2 before any process group)."""
    out = subprocess.run([sys.executable, SCRIPT, "--fp16", "--initial-loss-scale", "inf"], capture_output=True,
                         text=True, timeout=120, env=ENV, cwd=ROOT)
    assert out.returncode == 2 and "--initial-loss-scale" in out.stderr, out.stderr[-3000:]
    assert "TypeError" not in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*TORCHRUN, "--nproc_per_node=1", SCRIPT, "--heads", "3"], capture_output=True, text=True,
                         timeout=120, env=ENV, cwd=ROOT)
    assert out.returncode != 0, out.stderr[-3000:]
    assert "error: --hidden 128 is not divisible by --heads 3" in out.stderr, out.stderr[-3000:]
    assert "RuntimeError" not in out.stderr and "is invalid for input of size" not in out.stderr


# ----------------------------------------------------------------------------- NaN stop
TINY = ["--hidden-size", "32", "--num-layers", "1", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2"]


def _run(tmp_path, world: int, flags: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = tmp_path / "log.jsonl"
    out = subprocess.run([*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *TINY, *flags, "--log-json", str(log)],
                         capture_output=True, text=True, timeout=240, env=ENV, cwd=ROOT)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return out, records


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]],
                         ids=["fp32", "bf16", "fp16"])
def test_diverged_run_stops_with_a_clear_message(tmp_path, precision):
    """--lr 1e10 diverges: the first non-finite loss stops every rank with exit code 4 and a message
    (Megatron-LM's --check-for-nan-in-loss-and-grad, on by default), and no "done" line hides it."""
    out, records = _run(tmp_path, 2, ["--lr", "1e10", "--train-iters", "20", *precision])
    assert out.returncode != 0, out.stdout[-2000:]
    match = re.search(r"pretrain_gpt.py: stopping at iteration (\d+): (lm loss is nan|lm loss is inf|the gradients "
                      r"are non-finite).*--check-for-nan-in-loss-and-grad.*Exiting with code 4", out.stderr)
    assert match, out.stderr[-3000:]
    stopped = int(match[1])
    assert stopped < 20 and [r["iteration"] for r in records] == list(range(1, stopped + 1)), records
    last = records[-1]
    assert not math.isfinite(last["lm loss"]) or last["skip_reason"] == "non-finite", last
    assert "done:" not in out.stdout, out.stdout[-2000:]
    assert out.stderr.count("pretrain_gpt.py: stopping") == 1  # rank 0 only
    assert re.search(r"exitcode\s*:\s*4\b", out.stderr), out.stderr[-3000:]  # torchrun's report of the rank


def test_nan_check_off_trains_on_and_says_so(tmp_path):
    out, records = _run(tmp_path, 1, ["--lr", "1e10", "--train-iters", "8", "--no-check-for-nan-in-loss-and-grad"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(records) == 8 and not math.isfinite(records[-1]["lm loss"]), records
    done = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"done: loss [\d.]+ -> [\d.]+; \d+ iterations? had a non-finite loss or gradients "
                        r"\(first \d+, last 8\), the last loss nan", done), done


def test_fp16_backoff_is_not_a_nan_stop(tmp_path):
    """fp16 from Megatron-LM's initial loss scale 2**32: the dynamic scaler skips steps while it backs
    off (overflow); that is not divergence, and the run ends normally."""
    out, records = _run(tmp_path, 2, ["--fp16", "--train-iters", "24"])
    assert out.returncode == 0, out.stderr[-3000:]
    reasons = [r["skip_reason"] for r in records]
    assert "overflow" in reasons and "non-finite" not in reasons and len(records) == 24, reasons
    assert None in reasons, reasons  # the scale came down far enough for steps to update
    assert all(math.isfinite(r["lm loss"]) for r in records)
    done = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"done: loss [\d.]+ -> [\d.]+", done), done
    # the skips are counted in Megatron-LM's log line, and summed up in one stderr line per interval (no
    # line per skipped step)
    lines = log_lines(out.stdout)
    skipped = [r["iteration"] for r in records if not r["success"]]
    assert [int(m["skipped"]) for m in lines] == [int(r["iteration"] in skipped) for r in records], out.stdout
    assert "step skipped" not in out.stderr, out.stderr[-3000:]
    summaries = re.findall(r"pretrain_gpt.py: 1 of the 1 iterations up to (\d+) skipped their update \(overflow 1\); "
                           r"loss scale now [\d.e+]+", out.stderr)
    assert [int(i) for i in summaries] == skipped, out.stderr[-3000:]


# ----------------------------------------------------------------------------- watchdog
MIN_SECONDS, MULTIPLE, SLACK_S = 5, 3, 15
START_TIMEOUT_S = 90
STOP_AT = 10  # past the watchdog's 3 warm-up steps
FAULTY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain_with_faults.py")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on: [0] state, [1] ppid, [19] start time."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _children_by_rank(launcher_pid: int) -> dict[int, tuple[int, str]]:
    """RANK -> (pid, start time) of the launcher's worker processes (read from /proc)."""
    workers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _stat(int(entry))
            if int(stat[1]) != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, IndexError, ValueError):
            continue
        if b"RANK" in env:
            workers[int(env[b"RANK"])] = (int(entry), stat[19])
    return workers


def _kill_workers(workers: dict[int, tuple[int, str]]) -> None:
    """SIGCONT + SIGKILL each worker that is still the process we found (same start time, so never a
    reused pid). torchrun starts its workers in sessions of their own: killing its group misses them."""
    for pid, started in workers.values():
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                if _stat(pid)[19] == started:
                    os.kill(pid, sig)
            except (OSError, IndexError):
                pass


def _running(pid: int) -> bool:
    """False once the process is gone or a zombie (it has exited; its parent has not reaped it yet)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.mark.timeout(240)
def test_watchdog_ends_a_rank_whose_peer_is_stopped(tmp_path):
    # Rank 1 stops itself after its train step of STOP_AT, so rank 0 waits in the log line's all-reduce,
    # outside the train step: the watchdog has to watch the whole iteration (CI once caught it watching
    # only the step, when a SIGSTOP sent from outside happened to land there).
    cmd = [*TORCHRUN, "--nproc_per_node=2", FAULTY_SCRIPT, *SMALL, "--steps", "100000", "--warmup-steps", "1",
           "--watchdog-min-seconds", str(MIN_SECONDS), "--watchdog-multiple", str(MULTIPLE)]
    env = {**ENV, "FAULT_STOP_RANK": "1", "FAULT_STOP_ITERATION": str(STOP_AT)}
    stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=ROOT, start_new_session=True)
    logs = lambda: stdout_path.read_text()[-2000:] + stderr_path.read_text()[-4000:]  # noqa: E731
    workers: dict[int, tuple[int, str]] = {}
    try:
        # Rank 0 prints every step; the last line it can print is the one before STOP_AT.
        assert _wait_for(lambda: f"iteration {STOP_AT - 1:8d}/" in stdout_path.read_text() or proc.poll() is not None,
                         START_TIMEOUT_S, 0.2), "training did not start:\n" + logs()
        stopped_at = time.monotonic()
        assert proc.poll() is None, "the job ended early:\n" + logs()
        workers = _children_by_rank(proc.pid)
        assert sorted(workers) == [0, 1], (workers, logs())
        (rank0, _), (rank1, _) = workers[0], workers[1]

        exited = _wait_for(lambda: not _running(rank0), MIN_SECONDS + SLACK_S)
        waited = time.monotonic() - stopped_at
        assert exited, f"rank 0 still running {waited:.0f} s after rank 1 stopped (no watchdog?):\n" + logs()
        assert _stat(rank1)[0] == "T", "rank 1 did not stop itself where the test put the fault"

        os.kill(rank1, signal.SIGCONT)  # let the launcher tear the job down
        returncode = proc.wait(timeout=90)
        err = stderr_path.read_text()
        assert returncode != 0, logs()
        match = re.search(r"\[watchdog\] rank 0: iteration (\d+) has been running for ([\d.]+) s, longer than "
                          r"max\(--watchdog-min-seconds 5, --watchdog-multiple 3 x median step time ([\d.]+) s\) "
                          r"= ([\d.]+) s\..*Exiting with code 3", err)
        assert match, logs()
        iteration, elapsed, median, limit = int(match[1]), float(match[2]), float(match[3]), float(match[4])
        assert iteration == STOP_AT and abs(limit - max(MIN_SECONDS, MULTIPLE * median)) < 0.1, match[0]
        assert limit <= elapsed < limit + 2, match[0]
        # torchrun's failure report names rank 0 with the watchdog's exit code
        assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s+exitcode\s*:\s*3\b", err), logs()
        print(f"rank 0 exited {waited:.1f} s after rank 1 stopped (iteration {iteration}, median {median:.3f} s)")
    finally:
        _kill_workers({**(_children_by_rank(proc.pid) if proc.poll() is None else {}), **workers})
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def test_a_slow_checkpoint_save_does_not_trip_the_watchdog(tmp_path):
    """Saves (and evaluation) run inside the iteration but unwatched: a save slower than
    --watchdog-min-seconds finishes, and the run with it."""
    out = subprocess.run([*TORCHRUN, "--nproc_per_node=1", FAULTY_SCRIPT, *SMALL, "--steps", "8", "--warmup-steps", "1",
                          "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
                          "--watchdog-min-seconds", "2", "--watchdog-multiple", "3"],
                         capture_output=True, text=True, timeout=180, env={**ENV, "FAULT_SLOW_SAVE_SECONDS": "3"},
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[watchdog]" not in out.stderr and "done:" in out.stdout, out.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000004", "iter_0000008"]


def test_unwatched_time_is_not_step_time():
    """The median the limit scales with leaves out unwatched time, so a slow save cannot raise it."""
    from megatron_opt_train.components.watchdog import StepWatchdog

    watchdog = StepWatchdog(rank=0, multiple=0, min_seconds=1, warmup=0)  # multiple 0: no watching thread
    with watchdog.step(1):
        time.sleep(0.05)
        with watchdog.unwatched():
            assert watchdog.current is None
            time.sleep(1.0)
        assert watchdog.current is not None and watchdog.current[0] == 1
    assert len(watchdog.durations) == 1 and 0.04 < watchdog.durations[0] < 0.9, list(watchdog.durations)
