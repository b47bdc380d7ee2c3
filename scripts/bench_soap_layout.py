#!/usr/bin/env python
"""SOAP's per-matrix state on the element-range layout: memory per rank, refresh balance and bytes per step against
megatron-core's LayerWise and AdamW's ZeRO-1 (no device).

The entry point of megatron_opt_bench.matrix_state_layout (options: --help; figures: docs/benchmarks.md)."""
import sys

from megatron_opt_bench.matrix_state_layout import main

if __name__ == "__main__":
    sys.exit(main())
