#!/usr/bin/env python
"""The fused step kernels (megatron_opt._C) on one GPU against PyTorch's own ops.

The command-line entry point of megatron_opt_bench.kernels (options: --help; figures: docs/benchmarks.md)."""
import sys

from megatron_opt_bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
