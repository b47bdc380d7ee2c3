"""megatron-core's GPTModel and pipeline schedules on CPU/gloo (and without Transformer Engine or apex),
for the main job's model-parallel path (megatron_opt_train/runners/megatron_core.py), and, with the
opt-in extras below, megatron-core's own DDP, optimizer and all-to-all token dispatcher for the tests
that compare with them (tests/mcore/mcore_cpu.py). The one copy of these patches: the library itself
never runs megatron-core's model code on the CPU, and patches of torch's globals are the
application's (or a test's) business, not a library's.

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

Opt-in extras (``patched(..., megatron_core_optimizer=True, alltoall_dispatcher=True)``; the tests):

  * megatron-core's own optimizer: its ``device="cuda"`` buffers (found-inf flag, norm and zero-count
    buffers in ``optimizer.py``, ``clip_grads.py`` and the local ``multi_tensor_l2_norm`` of
    ``utils.py``) land on the CPU, and ``Tensor.type()`` without arguments names a CPU float tensor
    by its CUDA type name (``torch.cuda.FloatTensor`` ...), the only names that optimizer accepts;
  * the MoE all-to-all token dispatcher: CUDA streams are the host (``torch.cuda.Stream()`` and
    ``current_stream()`` answer one object whose ``record_event()`` is already done,
    ``torch.cuda.stream(s)`` does nothing), and its ``maybe_move_tensor_to_cpu(as_numpy=True)``
    turns a tensor already on the CPU into numpy too (all_to_all_single refuses tensor splits).

None of these is reached by megatron_opt's own code on gloo (it asks for a CUDA device only for NCCL
groups), so the patches change nothing megatron_opt computes. Tested in
tests/main_job/test_pretrain_model_parallel.py (applied, undone, a GPTModel forward on CPU) and by every
test of tests/mcore (through tests/mcore/mcore_cpu.py).
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable, Iterator

import torch

# megatron-core modules whose ``torch.zeros(device="cuda")`` must land on the CPU (the optimizer's by
# their dotted names: ``megatron.core.optimizer`` re-exports names that hide its submodules).
CUDA_TENSOR_MODULES = ("megatron.core.pipeline_parallel.schedules",)
OPTIMIZER_CUDA_TENSOR_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                                 "megatron.core.utils")
CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")
Patch = tuple[Any, str, Any]  # (object, attribute, value while patched)


def torch_on_cpu() -> types.SimpleNamespace:
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


class _HostStream:
    """The one 'stream' of the CPU: work on it is done when issued."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda *a, **k: None, query=lambda: True)

    def synchronize(self) -> None:
        return None


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cuda_type_name(original: Callable[..., str]) -> Callable[..., str]:
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1) if name in CPU_FLOAT_TYPES else name
    return type_


def optimizer_patches() -> list[Patch]:
    """megatron-core's own optimizer on the CPU (an extra: the main job runs megatron_opt's)."""
    return [(torch.Tensor, "type", _cuda_type_name(torch.Tensor.type))] + \
        [(importlib.import_module(name), "torch", torch_on_cpu()) for name in OPTIMIZER_CUDA_TENSOR_MODULES]


def alltoall_dispatcher_patches() -> list[Patch]:
    """megatron-core's MoE all-to-all token dispatcher on the CPU (an extra: the main job refuses it there)."""
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    host = _HostStream()
    return [(torch.cuda, "Stream", lambda *a, **k: host), (torch.cuda, "current_stream", lambda *a, **k: host),
            (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
            (token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)]


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
    ] + [(importlib.import_module(name), "torch", torch_on_cpu()) for name in CUDA_TENSOR_MODULES]


def patched(device: torch.device, megatron_core_optimizer: bool = False,
            alltoall_dispatcher: bool = False) -> contextlib.AbstractContextManager:
    """The fallbacks, and on the CPU the CPU patches (and the extras asked for), for the body;
    everything restored after."""
    applied = fallbacks()
    if device.type == "cpu":
        applied += cpu_patches()
        applied += optimizer_patches() if megatron_core_optimizer else []
        applied += alltoall_dispatcher_patches() if alltoall_dispatcher else []
    return _applied(applied)


def on_cpu(megatron_core_optimizer: bool = False,
           alltoall_dispatcher: bool = False) -> contextlib.AbstractContextManager:
    return patched(torch.device("cpu"), megatron_core_optimizer, alltoall_dispatcher)


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


__all__ = ["patched", "on_cpu", "fallbacks", "cpu_patches", "optimizer_patches", "alltoall_dispatcher_patches",
           "torch_on_cpu", "SequenceParallelLayerNorm", "CUDA_TENSOR_MODULES", "OPTIMIZER_CUDA_TENSOR_MODULES"]
