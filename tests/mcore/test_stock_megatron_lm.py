"""Megatron-LM's stock arguments with the one-line switch: the configs Megatron-LM's own parser builds
(recorded from core_v0.16.1 and main, tests/support/megatron_lm_configs.json) train megatron-core's
GPTModel through install() exactly as megatron-core's own DDP + optimizer do on the same harness, with
main's ``full_param_layout`` passed to the DDP; and every field of the installed megatron-core's configs
is decided (core_config_fields.py), so a field a new release adds fails here, not in a user's run."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (patches megatron-core for CPU only inside its context manager)
from tests.mcore import cases_stock
from tests.support import megatron_lm_configs as recorded

from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig
import megatron.core.optimizer as core_optimizer

import megatron_opt as mo
from megatron_opt import core_config_fields

OURS, CORE = "megatron_opt", "megatron_core"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config_classes() -> list[tuple[str, type]]:
    classes = [("ddp", CoreDDPConfig), ("optimizer", core_optimizer.OptimizerConfig)]
    for name in ("AdamOptimizerConfig", "SGDOptimizerConfig"):
        if hasattr(core_optimizer, name):
            classes.append(("optimizer", getattr(core_optimizer, name)))
    return classes


@pytest.mark.parametrize("kind, cls", _config_classes(), ids=lambda x: getattr(x, "__name__", x))
def test_every_field_of_the_installed_megatron_core_is_decided(kind, cls):
    ours = {f.name for f in dataclasses.fields(mo.OptimizerConfig if kind == "optimizer"
                                               else mo.DistributedDataParallelConfig)}
    undecided = sorted(f.name for f in dataclasses.fields(cls)
                       if f.name not in ours and core_config_fields.treatment(kind, f.name) is None)
    assert not undecided, (f"megatron-core's {cls.__name__} has fields megatron_opt has not decided; add each to "
                           f"megatron_opt/core_config_fields.py (Inert or DefaultOnly): {undecided}")


@pytest.mark.parametrize("launch", ["stock", "distributed_optimizer_overlap_bf16"])
def test_stock_megatron_lm_configs_train_like_megatron_core(pools, launch):
    core = pools(2).run(cases_stock.run_stock, launch, CORE)
    ours = pools(2).run(cases_stock.run_stock, launch, OURS)
    assert {r["optimizer_module"].split(".")[0] for r in ours} == {"megatron_opt"}, ours[0]["optimizer_module"]
    assert {r["optimizer_module"].split(".")[0] for r in core} == {"megatron"}, core[0]["optimizer_module"]
    bf16 = launch.endswith("bf16")
    for rank, (a, b) in enumerate(zip(ours, core)):
        for step, (mine, theirs) in enumerate(zip(a["steps"], b["steps"])):
            assert mine[0] and theirs[0], f"rank {rank} step {step} skipped: {mine} {theirs}"
            assert mine[1] == pytest.approx(theirs[1], rel=5e-3 if bf16 else 1e-6), f"grad norm, step {step}"
            if theirs[2] is None:
                assert mine[2] is None, f"num_zeros logged without --log-num-zeros-in-grad, step {step}"
            else:
                assert abs(mine[2] - theirs[2]) <= 2 + 0.02 * theirs[2], f"num_zeros, step {step}: {mine} {theirs}"
            assert mine[3] == theirs[3], f"loss scale, step {step}"
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-3 if bf16 else 1e-6)
        difference = float((a["params"] - b["params"]).abs().max())
        assert difference <= (2 ** -7 if bf16 else 1e-6), f"rank {rank}: final params differ by {difference}"
    assert torch.equal(ours[0]["params"], ours[1]["params"]), "data-parallel replicas differ"


def test_megatron_lm_main_muon_flags_train_megatron_opts_sharded_muon_like_megatron_cores_muon(pools):
    """Megatron-LM main's --optimizer muon --use-distributed-optimizer --overlap-grad-reduce
    --overlap-param-gather as its get_model and optimizer setup see them (use_layer_wise_distributed_optimizer,
    the DDP forced to the distributed optimizer, LayerWise's param layout) train megatron_opt's sharded Muon
    through install() like megatron-core's own (non-distributed) Muon, fp32 Newton-Schulz: params, losses,
    grad norms to fp32 reduction order. The QKV weights must be tagged as megatron-core tags them
    (install()'s get_megatron_optimizer), or megatron_opt refuses to guess their split."""
    if recorded.installed_label() != "main-d98e8a64":
        pytest.skip("Megatron-LM main's Muon flags need megatron-core >= 0.17 (installed: core_v0.16.1's generation, "
                    "whose Megatron-LM refuses Muon with the distributed optimizer)")
    core = pools(2).run(cases_stock.run_stock, "stock", CORE, muon=True)
    ours = pools(2).run(cases_stock.run_stock, "stock", OURS, muon=True)
    assert {r["optimizer_module"].split(".")[0] for r in ours} == {"megatron_opt"}, ours[0]["optimizer_module"]
    for rank, (a, b) in enumerate(zip(ours, core)):
        for step, (mine, theirs) in enumerate(zip(a["steps"], b["steps"])):
            assert mine[0] and theirs[0], f"rank {rank} step {step} skipped: {mine} {theirs}"
            assert mine[1] == pytest.approx(theirs[1], rel=1e-6), f"grad norm, step {step}"
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
        difference = float((a["params"] - b["params"]).abs().max())
        assert difference <= 1e-6, f"rank {rank}: final params differ by {difference}"
    assert torch.equal(ours[0]["params"], ours[1]["params"]), "data-parallel replicas differ"


def test_core_v0161_muon_entry_point_is_refused_with_the_fix():
    """core_v0.16.1's Megatron-LM builds Muon with get_megatron_muon_optimizer: install() replaces it by an
    error saying Muon needs Megatron-LM main; later releases keep the name as a shim to get_megatron_optimizer
    (already megatron_opt's), which install() leaves alone."""
    import megatron.core.optimizer.muon as core_muon
    import megatron_opt.megatron

    own = core_muon.get_megatron_muon_optimizer
    megatron_opt.megatron.install()
    try:
        if hasattr(core_muon, "TensorParallelMuon"):  # core_v0.16.1's own Muon builder
            with pytest.raises(mo.UnsupportedConfigError, match="needs Megatron-LM main"):
                core_muon.get_megatron_muon_optimizer(None, [])
        else:
            assert core_muon.get_megatron_muon_optimizer is own
    finally:
        megatron_opt.megatron.uninstall()
    assert core_muon.get_megatron_muon_optimizer is own


# Megatron-LM main's own pretrain_gpt.py (a source tree: MEGATRON_LM_MAIN, default /work/mlm/main) with
# --optimizer muon --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, through
# tools/megatron_lm_cpu/compare.py: megatron-core's Muon against megatron_opt's sharded Muon via install().
MEGATRON_LM_MAIN = os.environ.get("MEGATRON_LM_MAIN", "/work/mlm/main")


def _megatron_lm_muon_missing() -> Optional[str]:
    if not os.path.exists(os.path.join(MEGATRON_LM_MAIN, "pretrain_gpt.py")):
        return f"needs a Megatron-LM main source tree at MEGATRON_LM_MAIN ({MEGATRON_LM_MAIN})"
    if importlib.util.find_spec("emerging_optimizers") is None:
        return "Megatron-LM main's Muon needs emerging-optimizers (pip install emerging-optimizers)"
    return None


@pytest.mark.slow  # two launches of Megatron-LM (30-120 s); the in-process test above checks the same path
@pytest.mark.skipif(_megatron_lm_muon_missing() is not None, reason=str(_megatron_lm_muon_missing()))
def test_megatron_lm_main_pretrain_gpt_muon_sharded_matches_megatron_core(tmp_path):
    """fp32 (--muon-fp32-matmul-prec high: fp32 Newton-Schulz on the CPU): the runs differ by the order of
    fp32 sums only. megatron-core's reference is its non-distributed Muon (its LayerWise chain fails at
    start-up in fp32 on main d98e8a64; compare.py's docstring), megatron_opt's run shards Muon with both
    overlaps."""
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "megatron_lm_cpu", "compare.py"), "--main", MEGATRON_LM_MAIN,
           sys.executable, "--versions", "main", "--layouts", "DP2-muon", "--no-resume", "--fp32", "--iters", "3",
           "--logs", str(tmp_path / "logs"), "--summary", str(summary)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    (pair,) = json.loads(summary.read_text())
    curve = pair["megatron_opt"]["curve"]
    assert len(curve) == 3 and pair["diff"]["n"] == 3, out.stdout[-2000:]
    assert (pair["args"][pair["args"].index("--optimizer") + 1] == "muon"
            and "--use-distributed-optimizer" in pair["args"])
    assert pair["diff"]["dloss"] <= 1e-6 and pair["diff"]["dnorm"] <= 1e-5, pair["diff"]
    assert pair["diff"]["lines_same"], out.stdout[-2000:]
