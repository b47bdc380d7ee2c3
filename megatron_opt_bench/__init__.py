"""megatron_opt's benchmarks, as a package the scripts and tests import.

Each benchmark is one module with a ``main``; its command-line entry point is a thin script in
``scripts/`` (docs/benchmarks.md gives the commands):

  step             scripts/bench_step.py: a training step, megatron_opt vs torch DDP + ZeRO vs FSDP2
  optimizer_step   scripts/bench_optimizer_step.py: the optimizer step alone on one device
  checkpoint       scripts/bench_checkpoint.py: save and load, megatron_opt.checkpoint vs torch.save vs DCP
  kernels          scripts/bench_kernels.py: the fused CUDA passes alone

The rest is what they share: timing, machine, ranks, peak_memory, adamw (flags, config, param groups)
and fsdp (the FSDP2 baseline's sharding).
"""
