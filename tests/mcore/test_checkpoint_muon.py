"""Checkpoints of megatron_opt's Muon on megatron-core's GPTModel (tests/mcore/cases_checkpoint_muon.py)."""
from __future__ import annotations

import pytest
import torch

from tests.mcore import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
from tests.mcore import cases_checkpoint_muon as ccm

BEFORE, AFTER = 2, 2


def test_smoke(pools, tmp_path):
    saved = pools(2).run(ccm.run_save, str(tmp_path), "dp", BEFORE, AFTER)[0]
    print({k: sorted(v) for k, v in saved["saved"].items() if isinstance(v, dict)})
    loaded = pools(3).run(ccm.run_load, str(tmp_path), "dp", ccm.FORMATS, BEFORE, 0)[0]
    for fmt, r in loaded.items():
        for s in (*ccm.STATES, "param"):
            for k, v in saved["saved"][s].items():
                assert torch.equal(v, r["loaded"][s][k]), (fmt, s, k)
