"""Running megatron-core 0.16.1's GPTModel and no-pipeline schedule on CPU/gloo (test harness only).

megatron-core assumes CUDA in a few places that matter for a forward/backward on CPU; every patch
lives here, is applied only inside ``cpu_megatron_core()``, and is undone on exit, so the package
under test and other tests in the same worker never see it:
  * ``torch.cuda.current_device`` answers the CPU device;
  * the CUDA RNG calls (``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and the
    tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) use the CPU generator;
  * the schedule's token counter, created with ``device="cuda"``, is created on the CPU.
The model gets an explicit causal mask. The local LayerNorm ignores ``params_dtype``, so a float64
copy is made by building in fp32 and calling ``.to(torch.float64)``.
"""
from __future__ import annotations

import contextlib
import types
import warnings
from typing import Iterator

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

import megatron.core.pipeline_parallel.schedules as schedules  # noqa: E402
import megatron.core.tensor_parallel.random as tp_random  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB = 64
SEQ = 16


def _torch_on_cpu() -> types.SimpleNamespace:
    """A stand-in for the schedules module's ``torch`` whose zeros(device='cuda') lands on the CPU."""
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)

    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.zeros = zeros
    return shim


@contextlib.contextmanager
def cpu_megatron_core() -> Iterator[None]:
    patches = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (schedules, "torch", _torch_on_cpu()),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def init_parallel_state(seed: int = 1234) -> None:
    """Data parallelism over the whole world (tensor/pipeline size 1), once per worker process."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    with cpu_megatron_core():
        tp_random.model_parallel_cuda_manual_seed(seed)


def transformer_config(per_token: bool, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=per_token,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)


def build_gpt(config: TransformerConfig, seed: int = 0) -> GPTModel:
    """A tiny GPTModel with the local layer spec, the same init on every rank."""
    torch.manual_seed(seed)
    with cpu_megatron_core():
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=SEQ)


def clone_gpt(model: GPTModel, config: TransformerConfig = None) -> GPTModel:
    """A copy with the same weights (deepcopy fails: megatron-core modules hold process groups)."""
    copy = build_gpt(config or model.config)
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
           "token_losses", "causal_mask", "clone_gpt", "VOCAB", "SEQ"]
