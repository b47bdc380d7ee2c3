"""megatron-core 0.16's GPTModel and pipeline schedules on CPU/gloo, for the main job's model-parallel
path (scripts/pretrain_model_parallel.py) when it runs without GPUs.

megatron-core assumes CUDA in a few places that a forward/backward on CPU reaches. ``on_cpu()`` patches
exactly those, only while it is entered (the main job enters it around megatron-core's model
construction and its forward-backward schedule, never around megatron_opt's optimizer step), and
restores every attribute on exit, also when the body raises:

  * ``torch.cuda.current_device`` answers the CPU device (megatron-core asks it for tensor placement);
  * the CUDA RNG calls (``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and the
    RNG tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) use the CPU generator, so
    ``model_parallel_cuda_manual_seed`` and the tracker's ``fork()`` work;
  * ``torch.cuda.synchronize`` is a no-op (the pipeline's p2p calls it after batched isend/irecv);
  * ``Tensor.cuda()`` returns the tensor itself (the last pipeline stage moves the tied output weight
    with it before its all-reduce over the embedding group);
  * the schedules' ``torch.zeros(..., device="cuda")`` (the token counter) lands on the CPU;
  * the local layer spec's norm (``WrappedTorchNorm``) refuses ``sequence_parallel`` and FusedLayerNorm
    needs apex: a ``torch.nn.LayerNorm`` whose params are tagged ``sequence_parallel`` as FusedLayerNorm
    tags them stands in (the same arithmetic; ``finalize_model_grads`` then sums their grads over TP).

None of these is reached by megatron_opt's own code on gloo (it asks for a CUDA device only for NCCL
groups), so the patches change nothing megatron_opt computes. On CUDA the main job does not enter
``on_cpu()``. tests/main_job/test_pretrain_model_parallel.py tests the patches and their undoing.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable, Iterator

import torch

# megatron-core modules whose ``torch.zeros(device="cuda")`` must land on the CPU.
CUDA_TENSOR_MODULES = ("megatron.core.pipeline_parallel.schedules",)


def _torch_on_cpu() -> types.SimpleNamespace:
    """A stand-in for a module's ``torch`` whose zeros/tensor(device='cuda') are created on the CPU."""
    def on_cpu(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return wrapped

    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.zeros, shim.tensor = on_cpu(torch.zeros), on_cpu(torch.tensor)
    return shim


def sequence_parallel_layer_norm(config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
    """megatron-core's ``WrappedTorchNorm`` without its sequence-parallel refusal: a torch LayerNorm whose
    params carry ``sequence_parallel`` (RMSNorm and the rest: megatron-core's own wrapper)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if config.normalization != "LayerNorm":
        return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
    norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


class SequenceParallelLayerNorm:
    """``sequence_parallel_layer_norm`` as a class: megatron-core's build_module instantiates classes."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        return sequence_parallel_layer_norm(config, hidden_size, eps, **kwargs)


def patches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, value while patched) for every patch of ``on_cpu()``."""
    import megatron.core.models.backends as backends
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.transformer_block as transformer_block

    return [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (backends, "LNImpl", SequenceParallelLayerNorm),
        (transformer_block, "LayerNormImpl", SequenceParallelLayerNorm),
    ] + [(importlib.import_module(name), "torch", _torch_on_cpu()) for name in CUDA_TENSOR_MODULES]


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """megatron-core's CUDA assumptions answered on the CPU for the body; everything restored after."""
    applied = patches()
    absent = object()  # an inherited attribute (Tensor.cuda lives on a base class): deleted again on exit
    saved = [(obj, name, vars(obj).get(name, absent)) for obj, name, _ in applied]
    try:
        for obj, name, value in applied:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is absent:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def maybe_on_cpu(device: torch.device) -> contextlib.AbstractContextManager:
    """``on_cpu()`` on the CPU, nothing on CUDA."""
    return on_cpu() if device.type == "cpu" else contextlib.nullcontext()


__all__ = ["on_cpu", "maybe_on_cpu", "patches", "SequenceParallelLayerNorm", "CUDA_TENSOR_MODULES"]
