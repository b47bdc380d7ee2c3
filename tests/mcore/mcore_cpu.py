"""Running megatron-core 0.16.1's GPTModel, schedules (no-pipeline, 1F1B, interleaved) and its own
DDP + DistributedOptimizer on CPU/gloo (test harness only).

megatron-core assumes CUDA in a few places that matter for a forward/backward on CPU; every patch
lives here, is applied only inside ``cpu_megatron_core()``, and is undone on exit, so the package
under test and other tests in the same worker never see it:
  * ``torch.cuda.current_device`` answers the CPU device;
  * the CUDA RNG calls (``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and the
    tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) use the CPU generator;
  * tensors created with ``device="cuda"`` by the schedules (the token counter) and by megatron-core's
    own optimizer (found-inf flag, norm and zero-count buffers in ``optimizer.py``, ``clip_grads.py``
    and the local ``multi_tensor_l2_norm`` in ``utils.py``)
    are created on the CPU;
  * ``torch.cuda.synchronize`` is a no-op (the pipeline's p2p calls it after batched isend/irecv);
  * ``Tensor.cuda()`` returns the tensor (the tied output weight is moved with it before its
    all-reduce over the embedding group);
  * ``Tensor.type()`` without arguments names a CPU float tensor as its CUDA type
    (``torch.cuda.FloatTensor`` ...): megatron-core's optimizers accept only those names;
  * CUDA streams are the host: ``torch.cuda.Stream()`` and ``torch.cuda.current_stream()`` answer one
    object whose ``record_event()`` gives an event that is already done, ``torch.cuda.stream(s)`` does
    nothing (the MoE all-to-all token dispatcher copies its split sizes to the host on a side stream),
    and that dispatcher's ``maybe_move_tensor_to_cpu(as_numpy=True)`` turns a tensor already on the
    CPU into numpy too (it converts only CUDA tensors, and all_to_all_single refuses tensor splits);
  * ``moe_utils.te_general_gemm`` is None: without Transformer Engine megatron-core 0.16.1 leaves the
    name undefined (its import block fails early) and the MoE router's forward raises NameError;
  * not a CPU matter: ``reduce_from_tensor_model_parallel_region`` over a one-rank group returns a
    copy, not its input: megatron-core 0.16.1's expert MLP adds its fc2 bias in place to that output,
    which autograd refuses for a custom Function's returned input (an MoE model with biases at expert
    TP 1 without expert parallelism, i.e. the single-process reference, cannot train otherwise);
  * the local spec's norm (``WrappedTorchNorm``) refuses ``sequence_parallel`` and FusedLayerNorm needs
    apex: a ``torch.nn.LayerNorm`` whose params are tagged ``sequence_parallel`` (as FusedLayerNorm
    tags them) stands in; no arithmetic change, and untagged when sequence parallel is off.
The model gets an explicit causal mask. The local LayerNorm ignores ``params_dtype``, so a float64
copy is made by building in fp32 and calling ``.to(torch.float64)``.
"""
from __future__ import annotations

import contextlib
import importlib
import types
import warnings
from typing import Iterator

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

import megatron.core.models.backends as backends  # noqa: E402
import megatron.core.tensor_parallel.layers as tp_layers  # noqa: E402
import megatron.core.tensor_parallel.random as tp_random  # noqa: E402
import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
import megatron.core.transformer.moe.token_dispatcher as token_dispatcher  # noqa: E402
import megatron.core.transformer.transformer_block as transformer_block  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB = 64
SEQ = 16


# megatron-core modules that create tensors with device="cuda" (the optimizer modules by their dotted
# name: ``megatron.core.optimizer`` re-exports names that hide the submodules as attributes).
CUDA_TENSOR_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer.optimizer",
                       "megatron.core.optimizer.clip_grads", "megatron.core.utils")


def _torch_on_cpu() -> types.SimpleNamespace:
    """A stand-in for a module's ``torch`` whose zeros/tensor(device='cuda') land on the CPU."""
    def on_cpu(make):
        def wrapped(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return wrapped

    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.zeros, shim.tensor = on_cpu(torch.zeros), on_cpu(torch.tensor)
    return shim


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class _HostStream:
    """The one 'stream' of the CPU: work on it is done when issued."""

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, *args, **kwargs) -> types.SimpleNamespace:
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda *a, **k: None, query=lambda: True)

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


def _reduce_copying_on_one_rank(original):
    def reduce(input_, group=None):
        if group is not None and group.size() == 1:
            return input_.clone()
        return original(input_, group=group)
    return reduce


def _cuda_type_name(original):
    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1) if name in _CPU_FLOAT_TYPES else name
    return type_


_CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")


class SequenceParallelTorchNorm:
    """megatron-core's ``WrappedTorchNorm`` without its sequence-parallel refusal: a torch LayerNorm
    whose params carry ``sequence_parallel`` as FusedLayerNorm sets it (finalize_model_grads then sums
    their grads over TP)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "LayerNorm":
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


@contextlib.contextmanager
def cpu_megatron_core() -> Iterator[None]:
    patches = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "Stream", lambda *a, **k: _HOST_STREAM),
        (torch.cuda, "current_stream", lambda *a, **k: _HOST_STREAM),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _to_host),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.Tensor, "type", _cuda_type_name(torch.Tensor.type)),
        (backends, "LNImpl", SequenceParallelTorchNorm),
        (transformer_block, "LayerNormImpl", SequenceParallelTorchNorm),
        (moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
        (tp_layers, "reduce_from_tensor_model_parallel_region",
         _reduce_copying_on_one_rank(tp_layers.reduce_from_tensor_model_parallel_region)),
    ] + [(importlib.import_module(name), "torch", _torch_on_cpu()) for name in CUDA_TENSOR_MODULES]
    absent = object()  # an attribute inherited, not set on the object itself (Tensor.cuda): deleted again
    saved = [(obj, name, vars(obj).get(name, absent)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is absent:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


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
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts),
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
