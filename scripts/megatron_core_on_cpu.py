"""megatron-core 0.16's GPTModel and pipeline schedules on CPU/gloo (and without Transformer Engine or
apex), for the main job's model-parallel path (scripts/pretrain_model_parallel.py).

megatron-core assumes CUDA in a few places that a forward/backward on CPU reaches. ``patched(device)``
patches exactly those, only while it is entered (the main job enters it around megatron-core's model
construction and its forward-backward schedule, never around megatron_opt's optimizer step), and
restores every attribute on exit, also when the body raises. On the CPU (``cpu_patches``):

  * ``torch.cuda.current_device`` answers the CPU device (megatron-core asks it for tensor placement);
  * the CUDA RNG calls (``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and the
    RNG tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) use the CPU generator, so
    ``model_parallel_cuda_manual_seed`` and the tracker's ``fork()`` work;
  * ``torch.cuda.synchronize`` is a no-op (the pipeline's p2p calls it after batched isend/irecv);
  * ``Tensor.cuda()`` returns the tensor itself (the last pipeline stage moves the tied output weight
    with it before its all-reduce over the embedding group);
  * the schedules' ``torch.zeros(..., device="cuda")`` (the token counter) lands on the CPU.

On any device, where megatron-core lacks its fused kernels (``fallbacks``):

  * without Transformer Engine megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` undefined (its
    import block fails early) and the MoE router's forward raises NameError: it is set to None, the
    value megatron-core's own fallback checks for;
  * without apex, the local layer spec's norm (``WrappedTorchNorm``) refuses ``sequence_parallel``: a
    ``torch.nn.LayerNorm`` whose params are tagged ``sequence_parallel``, as apex's FusedLayerNorm tags
    them, stands in (the same arithmetic; ``finalize_model_grads`` then sums their grads over TP);
  * not a kernel matter but a megatron-core 0.16.1 bug: ``reduce_from_tensor_model_parallel_region``
    over a one-rank group returns its input, and the expert MLP then adds its fc2 bias to that output
    in place, which autograd refuses for a custom Function's returned input (an MoE model at expert
    TP 1 and EP 1 cannot train): over a one-rank group it returns a copy (the same values).

None of these is reached by megatron_opt's own code on gloo (it asks for a CUDA device only for NCCL
groups), so the patches change nothing megatron_opt computes. Tested in
tests/main_job/test_pretrain_model_parallel.py (applied, undone, a GPTModel forward on CPU).
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable, Iterator

import torch

# megatron-core modules whose ``torch.zeros(device="cuda")`` must land on the CPU.
CUDA_TENSOR_MODULES = ("megatron.core.pipeline_parallel.schedules",)
Patch = tuple[Any, str, Any]  # (object, attribute, value while patched)


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


class SequenceParallelLayerNorm:
    """megatron-core's ``WrappedTorchNorm`` without its sequence-parallel refusal: a torch LayerNorm whose
    params carry ``sequence_parallel`` (RMSNorm and the rest: megatron-core's own wrapper). A class,
    because megatron-core's build_module instantiates classes."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if config.normalization != "LayerNorm":
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def fallbacks() -> list[Patch]:
    """megatron-core's own fallbacks where Transformer Engine or apex is missing (nothing where present)."""
    import megatron.core.models.backends as backends
    import megatron.core.tensor_parallel.layers as tp_layers
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.transformer_block as transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norms = [(module, name, SequenceParallelLayerNorm) for module, name in
             ((backends, "LNImpl"), (transformer_block, "LayerNormImpl"))
             if getattr(module, name, None) is WrappedTorchNorm]
    return [(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
            (tp_layers, "reduce_from_tensor_model_parallel_region",
             _copy_on_one_rank(tp_layers.reduce_from_tensor_model_parallel_region))] + norms


def _copy_on_one_rank(reduce: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def reduce_or_copy(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
        if group is not None and group.size() == 1:
            return input_.clone()
        return reduce(input_, group=group)
    return reduce_or_copy


def cpu_patches() -> list[Patch]:
    """megatron-core's CUDA assumptions, answered on the CPU."""
    import megatron.core.tensor_parallel.random as tp_random

    return [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
    ] + [(importlib.import_module(name), "torch", _torch_on_cpu()) for name in CUDA_TENSOR_MODULES]


def patched(device: torch.device) -> contextlib.AbstractContextManager:
    """The fallbacks, and on the CPU the CPU patches, for the body; everything restored after."""
    return _applied(fallbacks() + (cpu_patches() if device.type == "cpu" else []))


def on_cpu() -> contextlib.AbstractContextManager:
    return patched(torch.device("cpu"))


@contextlib.contextmanager
def _applied(applied: list[Patch]) -> Iterator[None]:
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


__all__ = ["patched", "on_cpu", "fallbacks", "cpu_patches", "SequenceParallelLayerNorm", "CUDA_TENSOR_MODULES"]
