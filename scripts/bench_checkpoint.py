#!/usr/bin/env python
"""Checkpoint save and load: megatron_opt.checkpoint vs gather-to-rank-0 + torch.save vs FSDP2 + DCP.

The command-line entry point of megatron_opt_bench.checkpoint (options: --help; figures: docs/benchmarks.md)."""
from megatron_opt_bench.checkpoint import main

if __name__ == "__main__":
    main()
