"""Megatron-LM's own configs, replayed without Megatron-LM.

``megatron_lm_configs.json`` holds, per Megatron-LM version (``core_v0.16.1``, ``main-d98e8a64``) and per
launch line, the OptimizerConfig and DistributedDataParallelConfig that Megatron-LM's argument parser
and ``get_megatron_optimizer_config`` / ``get_megatron_ddp_config`` build: the class's fields with
their defaults, and the values passed that differ from them. It is written by
``tools/megatron_lm_configs.py`` from a Megatron-LM source tree (and checked against one with ``--check``).

``rebuilt(entry)`` makes a dataclass with that class's name, module, fields and defaults, holding the
passed values: what megatron_opt receives from that Megatron-LM, whichever megatron-core is installed.
``core_kwargs(entry, cls)`` gives the passed values for an installed megatron-core class, keeping the
fields it has.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

FIXTURE = Path(__file__).with_name("megatron_lm_configs.json")
LABELS = ("core_v0.16.1", "main-d98e8a64")
LAUNCHES = ("stock", "distributed_optimizer_overlap_bf16")


def installed_label() -> str:
    """The recorded Megatron-LM whose megatron-core generation is installed: 0.16.x is core_v0.16.1's,
    anything newer main's (0.19.2 is checked)."""
    from megatron.core import package_info

    return "core_v0.16.1" if package_info.__version__.startswith("0.16") else "main-d98e8a64"


def load() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def value(encoded: Any) -> Any:
    """The inverse of tools/megatron_lm_configs.py's ``_value``."""
    if not isinstance(encoded, dict):
        return encoded
    if "float" in encoded:
        return float(encoded["float"]) if encoded["float"] not in ("inf", "-inf", "nan") else float(
            encoded["float"].replace("inf", "Infinity").replace("nan", "NaN"))
    if "tuple" in encoded:
        return tuple(value(v) for v in encoded["tuple"])
    if "dtype" in encoded:
        return getattr(torch, encoded["dtype"])
    if "missing" in encoded:
        return dataclasses.MISSING
    raise ValueError(f"cannot rebuild {encoded!r}")


def entry(label: str, launch: str, kind: str) -> dict:
    """kind: 'optimizer' or 'ddp'."""
    return load()[label]["configs"][launch][kind]


def passed(item: dict) -> dict[str, Any]:
    return {name: value(v) for name, v in item["passed"].items()}


def rebuilt(item: dict) -> Any:
    """An instance of a dataclass shaped like the recorded megatron-core class, with the passed values."""
    fields = []
    for name, encoded in item["defaults"].items():
        default = value(encoded)
        if isinstance(default, (list, dict, set)):
            fields.append((name, Any, dataclasses.field(default_factory=lambda d=default: type(d)(d))))
        elif default is dataclasses.MISSING:
            fields.append((name, Any))
        else:
            fields.append((name, Any, dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass(item["class"], fields)
    cls.__module__ = item["module"]
    return cls(**passed(item))


def core_kwargs(item: dict, cls: type) -> dict[str, Any]:
    """The passed values for the installed megatron-core class ``cls`` (fields it lacks are left out)."""
    have = {f.name for f in dataclasses.fields(cls)}
    return {name: v for name, v in passed(item).items() if name in have}



__all__ = ["FIXTURE", "LABELS", "LAUNCHES", "installed_label", "load", "entry", "passed", "rebuilt", "core_kwargs",
           "value"]
