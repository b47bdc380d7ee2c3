"""optimizer_cuda_graph: the step decided on the device gives bitwise the same training as the
host-decided step (clipping, a one-rank overflow with a dynamic loss scaler, a norm-threshold skip,
an lr that changes every step), returns device tensors, and keeps the skip count. On CPU the device
path runs eagerly; the CUDA-graph capture and replay are checked in tests/kernels/test_cuda_graph_step.py."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import cases_device_step as cds


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("precision,threshold", [("fp32", 100.0), ("fp16", None), ("fp16", 100.0)])
def test_device_step_equals_host_step(pools, world, precision, threshold):
    for rank, res in enumerate(pools(world).run(cds.device_step_equals_host_step, precision, threshold)):
        host, dev = res["host"], res["device"]
        assert [r["success"] for r in host] == [r["success"] for r in dev], rank
        assert not all(r["success"] for r in host), "the schedule must skip at least one step"
        assert any(r["success"] for r in host)
        for i, (h, d) in enumerate(zip(host, dev)):
            assert torch.equal(h["params"], d["params"]), (rank, i, "params must be bitwise equal")
            assert h["scale"] == d["scale"] and h["skipped"] == d["skipped"], (rank, i, h["scale"], d["scale"])
            if h["success"]:
                assert h["norm"] == d["norm"] and h["zeros"] == d["zeros"], (rank, i)
            else:
                assert h["norm"] is None and math.isnan(d["norm"])
            assert d["types"] == ("Tensor", "Tensor"), "the device step returns device tensors, read lazily"
        norms = [r["norm"] for r in host if r["success"]]
        assert any(1.0 < n < 2.0 for n in norms), ("a clip coefficient in (0.5, 1) must occur", norms)
        if threshold is not None:
            assert any(r["success"] for r in host[6:]), "steps after a norm skip must still apply"
        if precision == "fp16":
            scales = [r["scale"] for r in host]
            assert len(set(scales)) > 1, "the schedule must move the dynamic loss scale"
