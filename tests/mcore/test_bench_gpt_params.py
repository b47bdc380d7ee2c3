"""megatron_opt_bench.gpt_params (the param list scripts/bench_muon_layout.py lays out) against megatron-core's own
GPTModel (local layer spec, one process): the same names, in the same registration order, with the same shapes and
the same ``is_embedding_or_output_parameter`` marks, for the GPT-2 style and the SwiGLU style flags."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_opt_bench.gpt_params import GptShape, gpt_params
from tests.mcore import mcore_cpu

# Small versions of the benchmark's two presets (mcore_cpu's harness: vocab 64, 16 positions, 4 heads).
SHAPES = {
    "gpt": GptShape(num_layers=2, hidden=32, heads=4, vocab=mcore_cpu.VOCAB, seq=mcore_cpu.SEQ),
    # The harness' norm is a LayerNorm, so the norms keep their bias here.
    "swiglu": GptShape(num_layers=2, hidden=32, heads=4, vocab=mcore_cpu.VOCAB, seq=mcore_cpu.SEQ, ffn=48,
                       query_groups=2, bias=False, learned_position=False, swiglu=True, tied=False),
}


def core_params(name: str) -> list[tuple[str, tuple[int, ...], bool]]:
    shape = SHAPES[name]
    mcore_cpu.init_parallel_state()
    config = dataclasses.replace(
        mcore_cpu.transformer_config(per_token=False), num_layers=shape.num_layers, hidden_size=shape.hidden,
        num_attention_heads=shape.heads, num_query_groups=shape.query_groups or None, ffn_hidden_size=shape.ffn_size,
        add_bias_linear=shape.bias, gated_linear_unit=shape.swiglu)
    model = mcore_cpu.build_gpt(config, tied=shape.tied) if shape.learned_position else _rope_gpt(config, shape)
    return [(n, tuple(p.shape), bool(getattr(p, "is_embedding_or_output_parameter", False)))
            for n, p in model.named_parameters()]


def _rope_gpt(config, shape: GptShape):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    with mcore_cpu.cpu_megatron_core():
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shape.vocab,
                        max_sequence_length=shape.seq, share_embeddings_and_output_weights=shape.tied,
                        position_embedding_type="rope")


@pytest.mark.parametrize("name", list(SHAPES))
def test_param_list_matches_megatron_core_gpt_model(pools, name):
    got = [(p.name, p.shape, p.embedding_or_output) for p in gpt_params(SHAPES[name])]
    assert got == pools(1).run(core_params, name)[0]
