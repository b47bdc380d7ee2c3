"""Record the OptimizerConfig and DistributedDataParallelConfig that Megatron-LM's own code builds from
its argument parser, for a few launch lines, as a JSON fixture the tests replay without Megatron-LM.

Usage (Megatron-LM's source tree on the command line, never inside this repository)::

    python tools/megatron_lm_configs.py /path/to/Megatron-LM LABEL > configs.json
    python tools/megatron_lm_configs.py /path/to/Megatron-LM LABEL --check tests/support/megatron_lm_configs.json

It runs Megatron-LM's ``parse_args`` and ``validate_args`` (world size 2, rank 0) on each launch line
in LAUNCHES, then builds the two configs as Megatron-LM's ``get_model`` and
``setup_model_and_optimizer`` do (``get_megatron_ddp_config`` / ``get_megatron_optimizer_config`` where
that Megatron-LM has them, else the same field-by-field copy from ``args``). Each config is written as
its class's fields with their defaults and the values Megatron-LM passes that differ from them, so a test can rebuild an
equal dataclass whichever megatron-core is installed. ``--check`` compares with the stored entry for
LABEL and exits 1 on a difference (a Megatron-LM that changed its defaults).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from typing import Any

# The model block any GPT launch needs; everything else stays at Megatron-LM's defaults.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--train-iters", "5", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
LAUNCHES = {
    "stock": [],
    "distributed_optimizer_overlap_bf16": ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                                           "--overlap-param-gather", "--log-num-zeros-in-grad"],
}


def _value(value: Any) -> Any:
    """A JSON form of a config value that ``tests/support/megatron_lm_configs.py`` reads back."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # inf and nan survive
    if isinstance(value, tuple):
        return {"tuple": [_value(v) for v in value]}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"dtype": str(value).removeprefix("torch.")}
    return {"repr": repr(value)}


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return _value(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return _value(field.default_factory())  # type: ignore[misc]
    return {"missing": True}


def _describe(config: Any) -> dict:
    cls = type(config)
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls)}
    values = {name: _value(getattr(config, name)) for name in defaults}
    return {"class": cls.__name__, "module": cls.__module__, "defaults": defaults,
            "passed": {name: value for name, value in values.items() if value != defaults[name]}}


def _configs(argv: list[str]) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.training import training
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *MODEL, *argv]
    args = parse_args()
    validate_args(args, {})
    optimizer_config, _ = training.get_megatron_optimizer_config(args)
    if hasattr(training, "get_megatron_ddp_config"):
        ddp_config = training.get_megatron_ddp_config(args)
    else:  # core_v0.16.1 builds it inside get_model, the same way
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)
                  if hasattr(args, f.name)}
        kwargs.update(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                      check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                      check_for_large_grads=args.check_for_large_grads, bucket_size=args.ddp_bucket_size,
                      pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
                      reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
                      average_in_collective=args.ddp_average_in_collective)
        ddp_config = DistributedDataParallelConfig(**kwargs)
    return {"optimizer": _describe(optimizer_config), "ddp": _describe(ddp_config)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("megatron_lm", help="Megatron-LM's source tree (the folder holding megatron/)")
    parser.add_argument("label", help="the key these configs are stored under, e.g. core_v0.16.1 or main-d98e8a64")
    parser.add_argument("--check", metavar="JSON", help="compare with the stored entry instead of printing")
    ns = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    sys.path.insert(0, os.path.abspath(ns.megatron_lm))
    with contextlib.redirect_stdout(sys.stderr):  # validate_args prints the whole argument table
        recorded = {name: _configs(argv) for name, argv in LAUNCHES.items()}
    if ns.check is None:
        json.dump({ns.label: {"launches": {n: MODEL + a for n, a in LAUNCHES.items()}, "configs": recorded}},
                  sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    with open(ns.check) as f:
        stored = json.load(f)[ns.label]["configs"]
    differ = [f"{launch}.{kind}" for launch in recorded for kind in recorded[launch]
              if recorded[launch][kind] != stored.get(launch, {}).get(kind)]
    print(f"{ns.label}: " + (f"differs from {ns.check} in {', '.join(differ)}" if differ else "matches"))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
