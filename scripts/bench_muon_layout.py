#!/usr/bin/env python
"""Muon on megatron_opt's element-range layout: bytes per step vs AdamW's ZeRO-1 and Newton-Schulz balance (no device).

The command-line entry point of megatron_opt_bench.muon_layout (options: --help; figures: docs/benchmarks.md)."""
import sys

from megatron_opt_bench.muon_layout import main

if __name__ == "__main__":
    sys.exit(main())
