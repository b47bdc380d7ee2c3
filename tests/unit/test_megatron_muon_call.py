"""install()'s Muon entry (megatron_opt.megatron.muon_call): the QKV weights get megatron-core's
``qkv_split_shapes`` from their chunk's TransformerConfig, exactly where megatron-core's own Muon path tags them."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_opt.megatron.muon_call import qkv_split_shapes, tag_qkv_split_shapes


class _Chunk(torch.nn.Module):
    def __init__(self, config, qkv_rows: int) -> None:
        super().__init__()
        self.config = config
        self.linear_qkv = torch.nn.Linear(8, qkv_rows)  # names: linear_qkv.weight, linear_qkv.bias
        self.linear_proj = torch.nn.Linear(8, 8)


def test_split_shapes_follow_megatron_cores_formula():
    gqa = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=4)
    assert qkv_split_shapes(gqa) == (16, 4, 4)
    assert qkv_split_shapes(SimpleNamespace(num_attention_heads=4, num_query_groups=None, kv_channels=2)) == (2, 2, 2)
    gated = SimpleNamespace(num_attention_heads=4, num_query_groups=4, kv_channels=2, attention_output_gate=True)
    assert qkv_split_shapes(gated) == (2, 2, 2, 2)
    assert qkv_split_shapes(None) is None


def test_only_2d_qkv_weights_whose_rows_divide_are_tagged():
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=2)  # split (4, 2, 2): 8 rows
    chunk = _Chunk(config, qkv_rows=16)
    assert tag_qkv_split_shapes([chunk]) == 1
    assert chunk.linear_qkv.weight.qkv_split_shapes == (4, 2, 2)
    assert not hasattr(chunk.linear_qkv.bias, "qkv_split_shapes") and not hasattr(chunk.linear_proj.weight,
                                                                                  "qkv_split_shapes")
    odd = _Chunk(config, qkv_rows=12)  # 12 rows are not query groups of 8: megatron-core skips it too
    assert tag_qkv_split_shapes([odd]) == 0 and not hasattr(odd.linear_qkv.weight, "qkv_split_shapes")
