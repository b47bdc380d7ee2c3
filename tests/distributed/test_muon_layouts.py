"""Muon with expert-parallel params and with overlap_param_gather_with_optimizer_step, against the
float64 reference (tests/support/reference_muon.py) on the same global batch: params, momentum and
grad norm every step (bounds: test_muon_partial_sharding.py's).

Expert parallelism here has no token dispatcher (cases_muon_layouts.ExpertMuonNet: each rank runs its
tokens through its expert-parallel rank's experts), which gives the expert params exactly expert
parallelism's gradients and groups; tests/mcore/test_muon_expert_parallel.py runs megatron-core's MoE.
"""
from __future__ import annotations

import torch

from tests.distributed import cases_muon_layouts as cases
from tests.distributed.test_muon_partial_sharding import TIMEOUT, check_reference

MUON = ["attn.linear_qkv.weight", "fc1.weight", "fc2.weight", "out.weight"]
EXPERT_MUON = ["experts.linear_fc1.weight", "experts.linear_fc2.weight"]


def test_muon_expert_parallel_ep2_under_dp4(pools):
    """DP 4, EP 2: the expert matrices reduce over and are exchanged within expert DP groups of 2
    ({0, 2}, {1, 3}); dense Muon, dense AdamW, expert Muon and expert AdamW under one chain (one norm,
    one clip): each expert DP group's ranks agree bitwise, the two groups hold different experts.
    Verify mode on: every step's update recomputed in float64 (each leaf over its own group)."""
    results = pools(4).run(cases.train_expert_parallel, 2, 3, verify=True, timeout=TIMEOUT)
    assert all(r["verified"] == 3 for r in results), [r["verified"] for r in results]
    check_reference(results, 3, muon=sorted(["dense." + n for n in MUON] + EXPERT_MUON))
    for rank, res in enumerate(results):
        assert res["kinds"] == [("muon", False), ("adam", False), ("muon", True), ("adam", True)], res["kinds"]
        assert res["coords"] == (rank % 2,)
        peer = results[rank % 2]  # the other rank of this expert DP group holds the same params
        assert torch.equal(res["params"], peer["params"])
        # the expert matrices are sharded over the expert DP group: both of its ranks own a part
        owned = [results[r]["owned"] for r in (rank % 2, rank % 2 + 2)]
        assert any(all(o.get(n, 0) for o in owned) for n in EXPERT_MUON), owned
    assert not torch.equal(results[0]["params"], results[1]["params"])


def test_muon_overlap_param_gather_with_optimizer_step(pools):
    """Two model chunks, overlap_param_gather_with_optimizer_step: chain [chunk 0's Muon, chunk 0's
    AdamW, chunk 1's Muon, chunk 1's AdamW]; the first two step (and all-gather) first."""
    results = pools(3).run(cases.train_overlap_with_step, 3, timeout=TIMEOUT)
    check_reference(results, 3)
    for res in results:
        assert res["kinds"] == [("muon", False), ("adam", False), ("muon", False), ("adam", False)]
        assert res["chunk_params"] == [["attn.linear_qkv.weight", "emb.weight"],
                                       ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.bias",
                                        "norm.weight", "out.weight"]]
        assert res["step_dispatches"] == [True, False]
