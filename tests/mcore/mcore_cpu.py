"""Running megatron-core's GPTModel, schedules (no-pipeline, 1F1B, interleaved) and its own
DDP + DistributedOptimizer on CPU/gloo (test harness only).

megatron-core assumes CUDA in a few places that matter for a forward/backward on CPU: the patches are
the main job's (megatron_opt_train.components.megatron_core_on_cpu, the one copy), here with its
extras for megatron-core's own optimizer and all-to-all token dispatcher, applied only inside
``cpu_megatron_core()`` and undone on exit, so the package under test and other tests in the same
worker never see them.
The model gets an explicit causal mask. The local LayerNorm ignores ``params_dtype``, so a float64
copy is made by building in fp32 and calling ``.to(torch.float64)``.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

import megatron.core.tensor_parallel.random as tp_random  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron_opt_train.components.megatron_core_on_cpu import on_cpu  # noqa: E402
from megatron_opt_train.components.megatron_core_on_cpu import torch_on_cpu as _torch_on_cpu  # noqa: E402,F401  (cases_checkpoint_mcore)

VOCAB = 64
SEQ = 16


def cpu_megatron_core() -> contextlib.AbstractContextManager:
    """megatron-core's model, schedules, own DDP and optimizer and all-to-all dispatcher on the CPU."""
    return on_cpu(megatron_core_optimizer=True, alltoall_dispatcher=True)


def init_parallel_state(seed: int = 1234) -> None:
    """Data parallelism over the whole world (tensor/pipeline size 1), once per worker process."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    with cpu_megatron_core():
        tp_random.model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def model_parallel_state(seed: int = 1234, **sizes) -> Iterator[None]:
    """megatron-core's parallel_state re-initialised with ``sizes`` (``initialize_model_parallel``'s
    keyword arguments: tensor_model_parallel_size, pipeline_model_parallel_size, ...) for the body,
    then the worker's data-parallel-only state again, also when the body raises. Collective: every
    rank of the world enters it together."""
    parallel_state.destroy_model_parallel()
    try:
        parallel_state.initialize_model_parallel(**sizes)
        with cpu_megatron_core():
            tp_random.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        init_parallel_state(seed)


def transformer_config(per_token: bool, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=per_token,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)


def build_gpt(config: TransformerConfig, seed: int = 0, tied: bool = False) -> GPTModel:
    """A tiny GPTModel with the local layer spec, the same init on every rank; ``tied``: the output layer
    shares the embedding's weight (Megatron-LM's default; GPTModel's default is untied)."""
    torch.manual_seed(seed)
    with cpu_megatron_core():
        return GPTModel(config=config,
                        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts),
                        vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)


def clone_gpt(model: GPTModel, config: TransformerConfig = None) -> GPTModel:
    """A copy with the same weights (deepcopy fails: megatron-core modules hold process groups)."""
    copy = build_gpt(config or model.config, tied=model.share_embeddings_and_output_weights)
    copy.load_state_dict(model.state_dict())
    return copy


def causal_mask() -> torch.Tensor:
    return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]


def microbatch(gen: torch.Generator, size: int) -> dict:
    """Tokens, labels and a loss mask with a ragged number of supervised tokens per sample."""
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    lengths = torch.randint(SEQ // 4, SEQ + 1, (size,), generator=gen)
    loss_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask}


def token_losses(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from megatron-core's GPTModel (it computes the loss when given labels)."""
    position_ids = torch.arange(SEQ)[None].expand_as(batch["tokens"])
    with cpu_megatron_core():
        return model(batch["tokens"], position_ids, causal_mask(), labels=batch["labels"])


__all__ = ["cpu_megatron_core", "init_parallel_state", "transformer_config", "build_gpt", "microbatch",
           "token_losses", "causal_mask", "clone_gpt", "model_parallel_state", "VOCAB", "SEQ"]
