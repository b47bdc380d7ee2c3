"""Muon with partial sharding (DistributedDataParallelConfig.num_distributed_optimizer_instances = k):
each instance (DP / k ranks) shards the model once and exchanges its matrices over its own group;
the instances hold bitwise-equal gradients, so each computes the same update. Checked against the
float64 reference (tests/support/reference_muon.py) on the same global batch (params, momentum, grad
norm, every step), and the instances' params, masters and momentum bitwise equal rank by rank (a
rank and its peers in the other instances own the same shard).

Bounds: test_muon.py's fp32 bounds (FP32) for the Muon matrices and the momentum. AdamW params
(embedding, biases, LayerNorm) get ADAM_PARAM: at DP 6 the embedding's first AdamW step measured
4.2e-5 of the change (elements whose gradient is near eps=1e-8, where Adam's g / (sqrt(v) + eps)
magnifies fp32's summation-order roundings; the same rule as AdamW without Muon, not Muon's).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import cases_muon_layouts as cases
from tests.distributed.test_muon import FP32

TIMEOUT = 240
MUON = ["attn.linear_qkv.weight", "fc1.weight", "fc2.weight", "out.weight"]
ADAM_PARAM = 3e-4


def check_reference(results: list, steps: int, muon: list = MUON) -> None:
    for rank, res in enumerate(results):
        assert res["success"] == [True] * steps
        assert res["muon_names"] == muon
        for step, (perr, merr, nrel) in enumerate(zip(res["param_err"], res["momentum_err"], res["norm_rel"])):
            assert nrel <= FP32["norm"], f"rank {rank} step {step}: grad norm rel {nrel}"
            for name, e in perr.items():
                bound = FP32["param"] if name in muon else ADAM_PARAM
                assert e <= bound, f"rank {rank} step {step} {name}: param error {e} of the change"
            for name, e in merr.items():
                assert e <= FP32["momentum"], f"rank {rank} step {step} {name}: momentum_buffer rel {e}"


def check_instances_bitwise(results: list, k: int) -> None:
    """Every rank's params equal; a rank's state (masters, momentum, Adam moments) equals that of the
    rank holding the same shard in every other instance."""
    size = len(results) // k
    for rank, res in enumerate(results):
        assert res["coords"] == (rank // size, rank % size, size), res["coords"]
        assert torch.equal(res["params"], results[0]["params"]), f"rank {rank}'s params differ from rank 0's"
        peer = results[rank % size]
        assert res["state"].keys() == peer["state"].keys()
        for key, value in res["state"].items():
            assert torch.equal(value, peer["state"][key]), f"rank {rank} and rank {rank % size}: {key} differ"


def straddling_unevenly(results: list, size: int) -> list[str]:
    """The Muon matrices that straddle the ranks of one instance with unequal owned parts."""
    owned = {n: [results[r]["owned"].get(n, 0) for r in range(size)] for n in MUON}
    return [n for n, parts in owned.items() if sum(1 for x in parts if x) > 1 and len(set(parts)) > 1]


def test_muon_partial_sharding_dp4_two_instances(pools):
    """DP 4, 2 instances of 2 ranks: fc1 straddles the instance's shard boundary unevenly (128 and 256
    of 384 elements), the other matrices have one owner each. Verify mode on (every step)."""
    results = pools(4).run(cases.train_partial, 2, 3, verify=True, timeout=TIMEOUT)
    assert all(r["verified"] == 3 for r in results), [r["verified"] for r in results]
    assert straddling_unevenly(results, 2), [r["owned"] for r in results[:2]]
    check_instances_bitwise(results, 2)
    check_reference(results, 3)


@pytest.mark.slow
def test_muon_partial_sharding_dp6_instances_of_three(pools):
    """DP 6, 2 instances of 3 ranks (test_muon.py's DP 3 ownership, replicated twice)."""
    results = pools(6).run(cases.train_partial, 2, 3, timeout=TIMEOUT)
    assert straddling_unevenly(results, 3) or any(sum(1 for r in results[:3] if r["owned"].get(n)) > 1 for n in MUON)
    check_instances_bitwise(results, 2)
    check_reference(results, 3)
