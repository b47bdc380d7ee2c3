"""Megatron-LM's torch_dist checkpoint of megatron_opt at model-parallel layouts: megatron-core's GPTModel at
TP2xDP2 and PP2xDP2 saves ``optimizer.sharded_state_dict(..., 'fully_reshardable')`` with
megatron.core.dist_checkpointing; another layout (another TP/PP and DP size) loads it, and every
param's fp32 master and Adam moments, assembled whole in model space, are bitwise the saved ones."""
from __future__ import annotations

import pytest
import torch

import mcore_cpu  # noqa: F401  (CI installs megatron-core: a missing dependency fails loudly)
import cases_checkpoint_mcore as cc
import cases_checkpoint_model_parallel as ccmp

STEPS = 2


def assert_bitwise_same(saved: dict, loaded: dict, before: dict) -> None:
    for state in (*ccmp.STATES, "param"):
        assert saved[state].keys() == loaded[state].keys(), state
        for name, tensor in saved[state].items():
            assert not tensor.isnan().any(), f"{state} of {name}: some elements were saved by no rank"
            assert torch.equal(tensor, loaded[state][name]), f"{state} of {name} differs after the load"
    # The loading run started elsewhere (other weights, no moments): the load is what made them equal.
    assert not torch.equal(before["master"]["decoder.layers.1.mlp.linear_fc1.weight"],
                           saved["master"]["decoder.layers.1.mlp.linear_fc1.weight"])
    assert saved["steps"] == loaded["steps"] == [(STEPS,)]


@pytest.mark.parametrize("save, save_world, load, load_world", [
    ("tp2", 4, "dp", 2),  # TP2xDP2 -> TP1xDP2
    ("pp2", 4, "dp", 4),  # PP2xDP2 -> PP1xDP4
])
def test_model_parallel_torch_dist_checkpoint_reshards_bitwise(pools, tmp_path, save, save_world, load, load_world):
    path = cc.tmp_folder(str(tmp_path), f"{save}_to_{load}")
    saved = pools(save_world).run(ccmp.run_save, path, save, STEPS)[0]["state"]
    result = pools(load_world).run(ccmp.run_load, path, load)[0]
    assert_bitwise_same(saved, result["state"], result["before"])
