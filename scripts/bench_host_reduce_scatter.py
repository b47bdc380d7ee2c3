#!/usr/bin/env python
"""One bucket's gradient reduction on gloo: all-reduce vs gloo's reduce-scatter vs megatron_opt's host reduce-scatter.

The entry point of megatron_opt_bench.host_reduce_scatter (options: --help; figures: docs/benchmarks.md)."""
from megatron_opt_bench.host_reduce_scatter import main

if __name__ == "__main__":
    main()
