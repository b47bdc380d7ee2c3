"""Megatron-Bridge as a client: its own ``pretrain()`` (GPTModelProvider, ConfigContainer, gpt_step.forward_step)
with the one line ``import megatron_opt.megatron; megatron_opt.megatron.install()`` trains like megatron-core's
own optimizer and DDP, per iteration, through tools/megatron_bridge_cpu/compare.py (CPU, gloo, 2 ranks, fp32).

Opt-in: Bridge needs its own venv (tools/megatron_bridge_cpu/setup.sh: Python 3.12, torch 2.14.1,
megatron-bridge 0.6.2, megatron-core 0.19.2, about 2 minutes to make) and the run takes about 10 minutes of
CPU, so the default suite and CI skip it. Run it with

    tools/megatron_bridge_cpu/setup.sh /work/venv-bridge
    MEGATRON_BRIDGE_PYTHON=/work/venv-bridge/bin/python \
        .venv/bin/python -m pytest -q tests/mcore/test_megatron_bridge.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARE = os.path.join(ROOT, "tools", "megatron_bridge_cpu", "compare.py")
BRIDGE_PYTHON = os.environ.get("MEGATRON_BRIDGE_PYTHON", "")
CASES = ["DP2", "TP2", "PP2", "DP2-late", "DP2-muon", "DP2-recipe-ddp", "resume mo->mo", "resume core->mo"]


def _bridge_missing() -> str | None:
    if not BRIDGE_PYTHON:
        return ("opt-in: set MEGATRON_BRIDGE_PYTHON to the python of a venv made by "
                "tools/megatron_bridge_cpu/setup.sh (Megatron-Bridge 0.6.2; about 10 minutes of CPU)")
    if not os.access(BRIDGE_PYTHON, os.X_OK):
        return f"MEGATRON_BRIDGE_PYTHON={BRIDGE_PYTHON} is not an executable"
    return None


@pytest.mark.skipif(_bridge_missing() is not None, reason=str(_bridge_missing()))
def test_megatron_bridge_pretrain_with_install_matches_megatron_core(tmp_path):
    """Every case within megatron-core's fp32 calibration (compare.py's bounds: |Δ loss| <= 1e-6, relative
    |Δ grad norm| <= 1e-6, equal loss scale, no skipped iteration, zero counts within 2 + 2%), Bridge's setup
    built megatron_opt's optimizer and DDP in every megatron_opt run and megatron-core's in every reference
    run, and megatron_opt resumes from its own torch_dist checkpoint bitwise."""
    summary = tmp_path / "summary.json"
    # compare.py puts this checkout on the Bridge runs' PYTHONPATH (megatron_opt is not installed there)
    out = subprocess.run([sys.executable, COMPARE, "--python", BRIDGE_PYTHON, "--logs", str(tmp_path / "logs"),
                          "--summary", str(summary)], capture_output=True, text=True, timeout=2400, cwd=ROOT,
                         check=False)
    report = out.stdout[-6000:] + out.stderr[-3000:]
    assert summary.exists(), report
    result = json.loads(summary.read_text())
    assert not result["failed_launch"], report
    cases = result["cases"]
    assert sorted(cases) == sorted(CASES), report
    for name, case in cases.items():
        reference = "megatron_opt" if name == "resume mo->mo" else "megatron"
        assert not case["missing"], f"{name}: iterations missing {case['missing']}\n{report}"
        assert {o.split(".")[0] for o, d in case["mo_classes"]} == {"megatron_opt"}, f"{name}: {case['mo_classes']}"
        assert {d.split(".")[0] for o, d in case["mo_classes"]} == {"megatron_opt"}, f"{name}: {case['mo_classes']}"
        assert {o.split(".")[0] for o, d in case["core_classes"]} == {reference}, f"{name}: {case['core_classes']}"
        assert {d.split(".")[0] for o, d in case["core_classes"]} == {reference}, f"{name}: {case['core_classes']}"
        assert case["ok"], f"{name} out of bounds: {case}\n{report}"
    assert cases["resume mo->mo"]["dloss"] == 0 and cases["resume mo->mo"]["dnorm"] == 0, report
    assert out.returncode == 0, report
