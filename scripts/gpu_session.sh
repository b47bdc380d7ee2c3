#!/usr/bin/env bash
# One device-machine call: build the CUDA extension for sm_90, run the CUDA-marked tests, the kernel
# benchmark and (time permitting) the whole suite. Logs go to $OUT (the device tool's return folder).
#   usage (on the GPU machine, repo root): bash scripts/gpu_session.sh [STAGES]   STAGES: build,cuda,bench,suite,step,precision
#   precision: the precision-aware state tests (CUDA-marked and others), then 16-bit vs fp32 state step times
#     (one command: bash scripts/gpu_session.sh build,precision)
#   The benchmarks (scripts/bench_*.py) are entry points of the megatron_opt_bench package, which the build
#   stage installs with megatron_opt: a stage list without build needs that install already there.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
STAGES="${1:-build,cuda,bench,suite}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
has() { [[ ",$STAGES," == *",$1,"* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; \
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.txt"
if has build; then
  start=$SECONDS
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $((SECONDS-start)) s"
  python3 -c "import megatron_opt.ops as o; print('ext', o.HAS_CUDA_EXT, o.CUDA_EXT_ERROR)"
fi
if has cuda; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda --maxfail 60 --timeout 120 tests 2>&1 | tee "$OUT/cuda_tests.log" | tail -40
fi
if has step; then
  timeout 240 python3 scripts/bench_optimizer_step.py --check --json "$OUT/step.json" --plot "$OUT/step.png" 2>&1 | tee "$OUT/bench_step.log" | tail -30
fi
if has precision; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider --maxfail 60 --timeout 200 \
    tests/kernels/test_ops_precision_cuda.py tests/distributed/test_precision_aware.py 2>&1 | tee "$OUT/precision_tests.log" | tail -30
  plot=(); python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/step_states.png")  # else re-plot with --from-json
  timeout 300 python3 scripts/bench_optimizer_step.py --check --mo-states fp32,bf16,bf16+rem \
    --json "$OUT/step_states.json" "${plot[@]}" 2>&1 | tee "$OUT/bench_step_states.log" | tail -40
fi
if has bench; then
  timeout 200 python3 scripts/bench_kernels.py --log2-sizes 24,26,28 --iters 20 2>&1 | tee "$OUT/bench_kernels.log" | tail -40
fi
if has suite; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests 2>&1 | tee "$OUT/suite.log" | tail -30
fi
