"""What Megatron-Bridge 0.6.2 needs, beyond tools/megatron_lm_cpu/cpu_shim.py, to import and train on CPU.

Never touches megatron_opt and changes no arithmetic. Two parts:

* ``stub_transformer_engine_for_lora_layers()`` (before ``import megatron.bridge``): ``import
  megatron.bridge`` reaches ``megatron.bridge.peft.lora_layers``, which does ``import
  transformer_engine.pytorch as te`` unconditionally (Transformer Engine is CUDA-only). A meta-path hook
  loads that one module with a placeholder ``transformer_engine.pytorch`` in ``sys.modules`` and takes
  the placeholder out again right after, so megatron-core (and the rest of Bridge) still find
  Transformer Engine absent and choose their local implementations. The module's own imports are
  loaded first, without the placeholder, and any module that is first imported during the placeholder's
  window is refused, so nothing else can capture it.
* ``install_training()`` (after cpu_shim.install()): Bridge's start-up asserts
  ``torch.cuda.is_available()`` and compiles the dataset helpers with ``make`` (the wheel ships no
  Makefile, only the built helpers_cpp extension, which megatron-core imports).
"""
from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import cpu_shim  # tools/megatron_lm_cpu, put on sys.path by run.py

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


class _Placeholder(type):
    """Any attribute of a placeholder is another placeholder class: lora_layers only names TE's classes
    at import time (isinstance tuples, annotations such as ``te.ops.Sequential``); an instance of a
    placeholder never exists, so the isinstance checks are False, as without Transformer Engine."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{cls.__name__}.{name}", (), {})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}", (), {})


def _absolute_imports(source: str) -> list[str]:
    """The top-level absolute imports of a module's source, in order."""
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


class _LoraLayersLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.machinery.SourceFileLoader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        # Its dependencies first, with Transformer Engine absent, so they choose as they would without it.
        for name in _absolute_imports(self.real.get_source(module.__name__)):
            if name.split(".")[0] != "transformer_engine":
                importlib.import_module(name)
        te = _PlaceholderModule("transformer_engine")
        te.pytorch = _PlaceholderModule("transformer_engine.pytorch")
        before = set(sys.modules)
        sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
        try:
            self.real.exec_module(module)
        finally:
            for name in _TE_NAMES:
                del sys.modules[name]
        leaked = sorted(set(sys.modules) - before - set(_TE_NAMES))
        if leaked:
            raise ImportError(f"{LORA_LAYERS} first imported {leaked} while the Transformer Engine placeholder "
                              f"was in sys.modules; bridge_shim must import them before it")


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        spec.loader = _LoraLayersLoader(spec.loader)
        return spec


def stub_transformer_engine_for_lora_layers() -> None:
    """Before ``import megatron.bridge``; a no-op where Transformer Engine is installed."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    if not any(isinstance(f, _LoraLayersFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())


def _training_patches() -> list[tuple[object, str, object]]:
    initialize = importlib.import_module("megatron.bridge.training.initialize")
    torch = initialize.torch
    return [
        # initialize_megatron asserts torch.cuda.is_available(): answered True there only (torch's own code
        # still sees no CUDA), as cpu_shim does for Megatron-LM's initialize.
        (initialize, "torch", cpu_shim._Overlay(torch, cuda=cpu_shim._Overlay(torch.cuda, is_available=lambda: True))),
        # compile_helpers() runs make in megatron/core/datasets, where the wheel has helpers_cpp built
        # and no Makefile.
        (initialize, "compile_helpers", lambda: None),
    ]


def install_training() -> None:
    """Bridge's training package (imports megatron.bridge): after cpu_shim.install()."""
    for obj, name, value in _training_patches():
        setattr(obj, name, value)
