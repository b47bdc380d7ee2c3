#!/usr/bin/env python
"""The optimizer step alone on one device: megatron_opt vs a Megatron-like sequence vs torch fused.

The command-line entry point of megatron_opt_bench.optimizer_step (options: --help; figures: docs/benchmarks.md)."""
import sys

from megatron_opt_bench.optimizer_step import main

if __name__ == "__main__":
    sys.exit(main())
