#!/usr/bin/env python
"""Megatron-LM's own pretrain_gpt.py, megatron-core's optimizer vs install(): Megatron-LM's timers side by side.

The command-line entry point of tools/megatron_lm_cpu/bench.py (options: --help; figures: docs/benchmarks.md,
"Inside Megatron-LM's loop")."""
import os
import runpy
import sys

if __name__ == "__main__":
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "megatron_lm_cpu", "bench.py")
    sys.argv[0] = bench
    runpy.run_path(bench, run_name="__main__")
