#!/usr/bin/env python
"""A training step side by side: megatron_opt vs torch DDP + ZeroRedundancyOptimizer vs FSDP2.

The command-line entry point of megatron_opt_bench.step (options: --help; figures: docs/benchmarks.md)."""
from megatron_opt_bench.step import main

if __name__ == "__main__":
    main()
