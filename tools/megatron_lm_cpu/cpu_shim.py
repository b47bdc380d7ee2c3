"""Make Megatron-LM's training loop run on the CPU (gloo) without changing its arithmetic.

``install()`` is called by run.py before pretrain_gpt.py is imported. It never touches megatron_opt and
changes no computation: it answers CUDA's queries as if there were one device, maps "cuda" placement
onto the CPU, and makes CUDA streams, events and RNG states those of the host.

Two mechanisms:
  * a global ``TorchFunctionMode`` (``_CudaToCpu``): every torch function or Tensor method given a
    CUDA device (``device="cuda"``, ``device=torch.cuda.current_device()``, ``.to("cuda")``) gets the
    CPU instead, ``.cuda()`` returns the tensor, and ``Tensor.type()`` names CPU float tensors by
    their CUDA type name (megatron-core's optimizers accept only ``torch.cuda.*Tensor`` params);
  * plain attribute patches, each with the reason: ``torch.cuda`` and torch's DataLoader
    (``_patches``), megatron-core (``_core_patches``, by ``install()``) and Megatron-LM's training
    package (``_training_patches``, by ``install_training()``, after megatron_opt's install()).
The "CUDA" RNG is the CPU generator (dropout runs on the CPU), so megatron's RNG tracker forks it and
checkpoints save and restore it as on a GPU.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor", "torch.DoubleTensor")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Placement on "cuda" becomes placement on the CPU; nothing else changes."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:  # .cuda(): the tensor already lives on the only device
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # megatron checks 'torch.cuda.FloatTensor'
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name in _CPU_FLOAT_TYPES else name
        if _is_cuda(kwargs.get("device")):  # factories and .to(device=...) with a CUDA device
            kwargs["device"] = _CPU
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros) and any(
                _is_cuda(a) for a in args[1:]):  # .to("cuda"), .to(torch.device("cuda:0"), dtype)
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _HostStream:
    """CUDA stream stand-in: the CPU runs work when it is issued, so every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def record_event(self, event=None):
        return event or _HostEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _HostEvent:
    """CUDA event stand-in; elapsed_time is measured on the host clock (Megatron-LM's timers only)."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        import time
        self._t = time.perf_counter()

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


_HOST_STREAM = _HostStream()


def _patches() -> list[tuple[object, str, object]]:
    cuda = torch.cuda
    return [
        # One device per process: Megatron-LM initializes model parallelism and seeds its RNG
        # tracker only when device_count() > 0.
        (cuda, "device_count", lambda: 1),
        (cuda, "set_device", lambda device: None),  # no device to select
        (cuda, "current_device", lambda: _CPU),  # device=torch.cuda.current_device() means the CPU
        (cuda, "synchronize", lambda device=None: None),  # CPU work is done when issued
        (cuda, "empty_cache", lambda: None),  # no allocator cache
        (cuda, "Stream", _HostStream),  # streams: the host
        (cuda, "current_stream", lambda device=None: _HOST_STREAM),
        (cuda, "default_stream", lambda device=None: _HOST_STREAM),
        (cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (cuda, "set_stream", lambda stream: None),
        (cuda, "Event", _HostEvent),  # events: host timestamps
        # The "CUDA" RNG is the CPU generator: megatron's RNG tracker forks it around dropout and init.
        (cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (cuda, "manual_seed_all", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        # Memory statistics (Megatron-LM's memory report and its logging): none on the host.
        (cuda, "memory_allocated", lambda device=None: 0),
        (cuda, "max_memory_allocated", lambda device=None: 0),
        (cuda, "memory_reserved", lambda device=None: 0),
        (cuda, "max_memory_reserved", lambda device=None: 0),
        (cuda, "reset_peak_memory_stats", lambda device=None: None),
        (cuda, "memory_stats", lambda device=None: {}),
        (torch.utils.data.DataLoader, "__init__",
         _data_loader_with_own_generator(torch.utils.data.DataLoader.__init__)),
    ]


def _core_patches() -> list[tuple[object, str, object]]:
    """Patches of megatron-core names (imported from MEGATRON_LM_DIR, so after sys.path is set)."""
    tp_random = importlib.import_module("megatron.core.tensor_parallel.random")
    return [
        # The RNG tracker's own state accessors: the CPU generator (as torch.cuda.get/set_rng_state above).
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
    ]


def _training_patches() -> list[tuple[object, str, object]]:
    """Patches of Megatron-LM's training package (megatron.training)."""
    initialize = importlib.import_module("megatron.training.initialize")
    torch_with_cuda = _Overlay(torch, cuda=_Overlay(torch.cuda, is_available=lambda: True))
    patches = [
        # initialize_megatron asserts torch.cuda.is_available(); answered True there only, so torch's
        # own code (DataLoader pin_memory, ...) still sees no CUDA.
        (initialize, "torch", torch_with_cuda),
        # validate_args reads the device architecture at TP/CP > 1: answer sm_90 (Hopper), so the
        # pre-Blackwell rule applies (CUDA_DEVICE_MAX_CONNECTIONS=1, set by compare.py as on an H100).
        (importlib.import_module("megatron.training.arguments"), "get_device_arch_version", lambda: 9),
    ]
    try:  # core_v0.16: start-up asks nvcc for its version, then builds no kernel (none is listed)
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
        patches.append((fused_kernels, "load", lambda args: None))
    except ImportError:
        pass
    return patches


class _Overlay(types.SimpleNamespace):
    """A module seen through a few replaced attributes; everything else is the module's, read live."""

    def __init__(self, module, **replaced):
        super().__init__(**replaced)
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)


def _data_loader_with_own_generator(original_init):
    """A DataLoader draws its workers' base seed from the default generator each time an iterator is
    made. On a GPU that is the CPU generator, which dropout (on the GPU) never reads; here the "CUDA"
    generator is the CPU one, so the draw would shift dropout (Megatron-LM makes its train iterator
    after loading a checkpoint: a resumed run would not reproduce). Each loader gets its own generator
    unless given one; it seeds the loader's worker processes only."""
    def __init__(self, *args, generator=None, **kwargs):
        original_init(self, *args, generator=torch.Generator() if generator is None else generator, **kwargs)
    return __init__


def _apply(patches) -> None:
    for obj, name, value in patches:
        setattr(obj, name, value)


def install() -> TorchFunctionMode:
    """torch.cuda and megatron-core: patch, and enter the CUDA-to-CPU mode for the rest of the process
    (returned: the caller keeps it). Imports megatron.core but not megatron.training, so megatron_opt's
    install() can still come before Megatron-LM's training code is imported (where the README puts the
    one line)."""
    _apply(_patches())
    _apply(_core_patches())
    mode = _CudaToCpu()
    mode.__enter__()
    return mode


def install_training() -> None:
    """Megatron-LM's training package (imports megatron.training): after megatron_opt's install()."""
    _apply(_training_patches())
