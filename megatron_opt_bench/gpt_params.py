"""A GPT's parameters as megatron-core's GPTModel registers them: names, shapes, which ones are embedding or output.

Pure shape arithmetic, no tensors, so a 1.3B-parameter model's layout can be computed on any machine. The order is
megatron-core's local layer spec (checked against small GPTModels in tests/mcore/test_bench_gpt_params.py):
word and position embeddings, then per layer input norm, linear_proj, linear_qkv, pre-MLP norm, linear_fc1,
linear_fc2 (each weight followed by its bias), the final norm, and the output layer when it is not tied. (The
Transformer Engine spec fuses the two norms into linear_qkv and linear_fc1: the matrices keep their order and
only 1-D params move.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GptShape:
    """The architecture flags that decide a GPT's parameter shapes (Megatron-LM's names in comments)."""

    num_layers: int
    hidden: int
    heads: int
    vocab: int  # padded vocabulary (--make-vocab-size-divisible-by)
    seq: int  # --max-position-embeddings; used only with a learned position embedding
    ffn: int = 0  # --ffn-hidden-size; 0: 4 * hidden
    query_groups: int = 0  # --num-query-groups; 0: as many as heads
    bias: bool = True  # --disable-bias-linear turns it off
    learned_position: bool = True  # --position-embedding-type learned_absolute (else rope: no param)
    swiglu: bool = False  # --swiglu: linear_fc1 holds the gate and the up projection
    tied: bool = True  # --untie-embeddings-and-output-weights turns it off
    norm_bias: bool = True  # LayerNorm has a bias, RMSNorm has not

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads


@dataclass(frozen=True)
class GptParam:
    name: str
    shape: tuple[int, ...]
    embedding_or_output: bool = False  # megatron-core's is_embedding_or_output_parameter

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def gpt_params(shape: GptShape) -> list[GptParam]:
    """Every trainable param of the GPT, in megatron-core's registration order."""
    h, kv = shape.hidden, shape.hidden // shape.heads
    qkv_rows = (shape.heads + 2 * shape.groups) * kv
    fc1_rows = shape.ffn_size * (2 if shape.swiglu else 1)
    params = [GptParam("embedding.word_embeddings.weight", (shape.vocab, h), True)]
    if shape.learned_position:
        params.append(GptParam("embedding.position_embeddings.weight", (shape.seq, h)))

    def norm(prefix: str) -> list[GptParam]:
        return [GptParam(f"{prefix}.weight", (h,))] + ([GptParam(f"{prefix}.bias", (h,))] if shape.norm_bias else [])

    def linear(prefix: str, rows: int, cols: int) -> list[GptParam]:
        return ([GptParam(f"{prefix}.weight", (rows, cols))]
                + ([GptParam(f"{prefix}.bias", (rows,))] if shape.bias else []))

    for i in range(shape.num_layers):
        layer = f"decoder.layers.{i}"
        params += norm(f"{layer}.input_layernorm")
        params += linear(f"{layer}.self_attention.linear_proj", h, shape.heads * kv)
        params += linear(f"{layer}.self_attention.linear_qkv", qkv_rows, h)
        params += norm(f"{layer}.pre_mlp_layernorm")
        params += linear(f"{layer}.mlp.linear_fc1", fc1_rows, h)
        params += linear(f"{layer}.mlp.linear_fc2", h, shape.ffn_size)
    params += norm("decoder.final_layernorm")
    if not shape.tied:
        params.append(GptParam("output_layer.weight", (shape.vocab, h), True))
    return params


def is_muon_matrix(param: GptParam) -> bool:
    """megatron-core's split: 2-D and not an embedding or output param (a learned position embedding is one)."""
    return len(param.shape) == 2 and not param.embedding_or_output


__all__ = ["GptParam", "GptShape", "gpt_params", "is_muon_matrix"]
