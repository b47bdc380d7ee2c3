"""torchrun multi-node: two launchers on this machine (--nnodes=2 --nproc_per_node=1, c10d rendezvous
through a file) train exactly as one launcher with two processes: the per-step values that
scripts/pretrain_gpt.py logs (--log-json: loss, grad norm, loss scale, lr, skipped iterations, token
count; and the text log without its timings) are equal bit for bit.

Every subprocess is bounded: the rendezvous by its join timeout, the collectives by
--distributed-timeout-minutes, a stuck step by the script's watchdog, and each launcher by a wall-clock
limit after which the test kills it (and its workers) and fails.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.main_job.main_job_script import ENV, ROOT, SCRIPT

RUN_TIMEOUT_S = 180
TRAIN = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--lr-warmup-iters", "1",
         "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2",
         "0.95", "--clip-grad", "1.0", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather", "--calculate-per-token-loss", "--log-num-zeros-in-grad", "--device", "cpu",
         "--distributed-timeout-minutes", "2", "--watchdog-min-seconds", "60", "--watchdog-multiple", "20"]


def _file_rendezvous(folder) -> list[str]:
    """torchrun's c10d rendezvous through a FileStore in ``folder`` instead of a TCP endpoint: a port
    picked up front by binding port 0 is released again, and another process can take it before the
    first launcher binds it (EADDRINUSE). After the rendezvous, the launcher of node 0 opens the
    workers' TCPStore on a port the kernel assigns while it binds (port 0), which cannot race."""
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={folder / 'rendezvous'}",
            "--rdzv-conf=store_type=file,join_timeout=60", "--rdzv-id=megatron_opt_multinode", "--local-addr=127.0.0.1"]


def _launch(launcher_args: list[str], log_json, out_dir, name: str) -> tuple[subprocess.Popen, str, str]:
    stdout, stderr = out_dir / f"{name}.out", out_dir / f"{name}.err"
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, SCRIPT, *TRAIN, "--log-json", str(log_json)]
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=ENV, cwd=ROOT, start_new_session=True)
    return proc, stdout, stderr


def _stop(proc: subprocess.Popen) -> None:
    """A launcher still running: SIGTERM it (torchrun then stops its workers), SIGKILL its process group
    if it lingers (while it is alive and unreaped, so the group id is still ours)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _run_launchers(launchers: list[list[str]], log_json, out_dir, name: str) -> list[str]:
    """Start every launcher, wait for all of them under one deadline; return their stdouts."""
    procs = [_launch(args, log_json, out_dir, f"{name}{i}") for i, args in enumerate(launchers)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        logs = "".join(f"--- {name}{i} stdout ---\n{out.read_text()[-3000:]}\n"
                       f"--- stderr ---\n{err.read_text()[-3000:]}\n"
                       for i, (_, out, err) in enumerate(procs))
        hung = [i for i, (proc, _, _) in enumerate(procs) if proc.poll() is None]
        assert not hung, f"launcher(s) {hung} still running after {RUN_TIMEOUT_S} s:\n{logs}"
        assert all(proc.returncode == 0 for proc, _, _ in procs), logs
    finally:
        for proc, _, _ in procs:
            _stop(proc)
    return [out.read_text() for _, out, _ in procs]


def _step_lines(log: str) -> list[str]:
    """Megatron-LM's per-iteration log lines without their date, timings and memory."""
    timing = re.compile(r"^ \[[^]]*\]| elapsed time per iteration \(ms\): [\d.]+ \|| mem [^|]*\|")
    return [timing.sub("", line) for line in log.splitlines() if re.match(r" \[[^]]*\] iteration\s+\d+/", line)]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_two_nodes_equal_one_node_with_two_processes(tmp_path):
    one_json, two_json = tmp_path / "one_node.jsonl", tmp_path / "two_nodes.jsonl"
    (one_out,) = _run_launchers([["--standalone", "--nproc_per_node=2"]], one_json, tmp_path, "one_node")

    node = ["--nnodes=2", "--nproc_per_node=1", *_file_rendezvous(tmp_path), "--max-restarts=0"]
    two_outs = _run_launchers([node, node], two_json, tmp_path, "two_nodes")

    assert "DP=2, 1 node, " in one_out, one_out
    rank0_out = [out for out in two_outs if "megatron_opt pretrain_gpt:" in out]
    assert len(rank0_out) == 1, two_outs  # global rank 0 is on one launcher, its peer on the other
    assert "DP=2, 2 nodes, " in rank0_out[0], rank0_out[0]

    one = [json.loads(line) for line in one_json.read_text().splitlines()]
    two = [json.loads(line) for line in two_json.read_text().splitlines()]
    assert [r["iteration"] for r in one] == list(range(1, 6))
    assert all(r["success"] and r["grad_norm"] > 0 for r in one)
    # json writes floats as repr(), which reads back to the same double: equal records are bit-identical
    for a, b in zip(one, two, strict=True):
        assert a == b, (a, b)
    lines_one, lines_two = _step_lines(one_out), _step_lines(rank0_out[0])
    assert len(lines_one) == 5 and lines_one == lines_two, (lines_one, lines_two)
