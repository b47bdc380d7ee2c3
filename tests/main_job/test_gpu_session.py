"""scripts/gpu_session.sh (issue 31's GPU session): its syntax and argument checks, and the per-area test
counts of tools/cuda_test_counts.py. The stages themselves run in the dry run (docs/benchmarks.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def _session(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)


def test_syntax_and_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    help_text = _session("--help")
    assert help_text.returncode == 0
    for stage in ("env", "tests", "megatron", "step", "--dry-run"):
        assert stage in help_text.stdout
    assert _session("--bogus").returncode == 2
    bad_stage = _session("--stages", "env,bench")
    assert bad_stage.returncode == 2 and "unknown stage bench" in bad_stage.stderr


def test_cuda_test_counts_per_area(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text("""<testsuites><testsuite>
      <testcase classname="tests.kernels.test_ops_lion" name="test_cuda_lion[1]"/>
      <testcase classname="tests.kernels.test_ops_lion" name="test_cuda_lion[2]"><failure/></testcase>
      <testcase classname="tests.kernels.test_ops_precision_cuda" name="test_a"><skipped/></testcase>
      <testcase classname="tests.kernels.test_cuda_graph_step" name="test_b"/>
      <testcase classname="tests.kernels.test_ops" name="test_c"><error/></testcase>
    </testsuite></testsuites>""")
    out = tmp_path / "counts.json"
    rc = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_test_counts.py"), str(junit), "--json", str(out)],
                        capture_output=True, text=True, timeout=30).returncode
    counts = json.loads(out.read_text())
    assert rc == 1, "failures make the exit status 1"
    assert counts["areas"] == {"lion": {"passed": 1, "failed": 1}, "precision": {"skipped": 1},
                               "graph": {"passed": 1}, "other": {"error": 1}}
    assert counts["failed"] == ["tests.kernels.test_ops_lion::test_cuda_lion[2]", "tests.kernels.test_ops::test_c"]
