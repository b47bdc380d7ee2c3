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


@pytest.mark.parametrize("world, dtype, nesterov", [(1, "fp32", False), (3, "fp32", True), (3, "bf16", False)])
def test_muon_device_step_equals_host_step(pools, world, dtype, nesterov):
    """Muon under optimizer_cuda_graph: the step decided on the device (the momentum and masters kept by
    a device-side select, the exchange run on every rank alike) trains bitwise as the host-decided step,
    a one-rank NaN skip included (params, momentum_buffer, Adam moments, step counts)."""
    for rank, res in enumerate(pools(world).run(cds.muon_device_step_equals_host_step, dtype, nesterov, timeout=240)):
        host, dev = res["host"], res["device"]
        assert [r["success"] for r in host] == [True, True, False, True, True], rank
        assert [r["success"] for r in dev] == [r["success"] for r in host], rank
        for i, (h, d) in enumerate(zip(host, dev)):
            assert torch.equal(h["params"], d["params"]), (rank, i, "params must be bitwise equal")
            assert h["skipped"] == d["skipped"], (rank, i)
            assert h["scalars"] == d["scalars"], (rank, i, "update counts, lr / wd, skipped steps")
            assert h["state"].keys() == d["state"].keys() and "momentum_buffer" in h["state"], rank
            for name in h["state"]:
                for key in h["state"][name]:
                    assert torch.equal(h["state"][name][key], d["state"][name][key]), (rank, i, name, key)
            if h["success"]:
                assert h["norm"] == d["norm"] and h["zeros"] == d["zeros"], (rank, i)
            else:
                assert h["norm"] is None and math.isnan(d["norm"])
            assert d["types"] == ("Tensor", "Tensor")
        assert torch.equal(host[1]["params"], host[2]["params"]), "the skipped step changes no param"
