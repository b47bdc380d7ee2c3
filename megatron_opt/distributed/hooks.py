"""The hooks DistributedDataParallel installs on its module.

* One post-accumulate-grad hook per trainable param: it moves autograd's gradient into the param's
  ``main_grad`` (``DistributedDataParallel.add_grad``).
* With ``overlap_param_gather``, one forward pre-hook per submodule that owns params: its forward
  waits for the all-gather of those params' buckets (``ForwardPreHooks``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch

from ..errors import StepOrderError
from .buffers import Bucket, ParamAndGradBuffer


class _GradReceiver(Protocol):
    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None: ...


def grad_accumulated_hook(ddp: "weakref.ref[_GradReceiver]") -> Callable[[torch.nn.Parameter], None]:
    """The param's post-accumulate-grad hook, holding the wrapper weakly: a strong reference (a bound
    method) makes param -> hook -> wrapper -> module -> param a cycle through autograd's C++ hook
    storage, which Python's collector cannot see, so a dropped wrapper, its model, grad buffers and
    process groups were never freed."""
    def hook(param: torch.nn.Parameter) -> None:
        wrapper = ddp()
        if wrapper is not None:
            wrapper._on_grad_accumulated(param)
    return hook


def install_grad_hooks(wrapper: _GradReceiver, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p._megatron_opt_wrapped = True  # a second wrapper would fight over the same params
        p.register_post_accumulate_grad_hook(grad_accumulated_hook(weakref.ref(wrapper)))


class ForwardPreHooks:
    """overlap_param_gather's forward pre-hooks: each submodule's forward waits for the all-gather of
    its params' buckets. Installed at construction; Megatron-LM removes them around evaluation and saves."""

    def __init__(self, module: torch.nn.Module, buffer_of: dict[int, ParamAndGradBuffer]) -> None:
        self.module = module
        self.buffer_of = buffer_of
        self.handles: list[Any] = []

    def enable(self) -> None:
        if self.handles:
            raise StepOrderError("enable_forward_pre_hook(): the forward pre-hooks are already enabled; call "
                                 "disable_forward_pre_hook() first.")
        for module in self.module.modules():
            buckets: dict[int, Bucket] = {}
            for p in module.parameters(recurse=False):
                if id(p) in self.buffer_of:
                    bucket = self.buffer_of[id(p)].bucket_of(p)
                    buckets[id(bucket)] = bucket
            if buckets:
                self.handles.append(module.register_forward_pre_hook(_param_wait_hook(list(buckets.values()))))

    def disable(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _param_wait_hook(buckets: list[Bucket]) -> Callable[[torch.nn.Module, Any], None]:
    def hook(module: torch.nn.Module, args: Any) -> None:
        for bucket in buckets:
            bucket.finish_param_sync()
    return hook


__all__ = ["grad_accumulated_hook", "install_grad_hooks", "ForwardPreHooks"]
