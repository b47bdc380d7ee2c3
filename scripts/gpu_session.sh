#!/usr/bin/env bash
# One GPU-machine call (issue #31): four stages, each under its own timeout so that one stage's hang cannot
# eat the next, all results in $OUT (the device tool brings back at most 8 files, 16 MiB each).
#   usage: bash scripts/gpu_session.sh [--dry-run] [--stages env,tests,megatron,step] [--megatron-iters N]
#   1 env       (140 s) nvidia-smi, Python/torch/CUDA versions, build csrc for sm_90 (MAX_JOBS=16), whether
#                       the extension imports
#   2 tests     (140 s) every CUDA-marked test (-m cuda; pytest-xdist when there), counts per area
#   3 megatron  (200 s) Megatron-LM's own pretrain_gpt.py (the tree tools/gpu_carry.sh put in .carry/mlm), one
#                       GPU, --transformer-impl local --mock-data, 12 layers, hidden 2048, sequence 2048, bf16,
#                       both overlaps: megatron-core's optimizer and the one-line install(), alternating, for
#                       Adam and for Muon (megatron-core's LayerWise): tools/megatron_lm_cpu/bench.py --gpu
#                       (Megatron-LM's own timers side by side, and each pair's loss / grad-norm agreement)
#   4 step      ( 60 s) bench_optimizer_step.py at 2^22, 2^24, 2^26: eager and optimizer_cuda_graph, fp32 and
#                       16-bit state, each against its byte floor
# --dry-run runs all of it but the CUDA work on the CPU: no build, the test selection with --collect-only,
# the Megatron-LM command lines for the GPU, then the pairs through the CPU shim (2 ranks, gloo, the same
# flags at 100M parameters, 4 iterations), the benchmark at 2^12 and 2^14 on the CPU.
# Before the GPU run: bash tools/gpu_carry.sh; docs/benchmarks.md has the device call.
# $OUT: session.log (everything printed), stages.json (rc and seconds per stage), cuda_tests.json,
# megatron.json + megatron.md (timers, agreement), step.json + step.png, logs.tgz (build, pytest, Megatron-LM logs).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0 STAGES=env,tests,megatron,step MEGATRON_ITERS=20
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) STAGES="$2"; shift ;;
    --megatron-iters) MEGATRON_ITERS="$2"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_session: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
for s in ${STAGES//,/ }; do
  [[ " env tests megatron step " == *" $s "* ]] || { echo "gpu_session: unknown stage $s" >&2; exit 2; }
done
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
WORK="$(mktemp -d)"
export DRY OUT WORK MEGATRON_ITERS PYTHON="${PYTHON:-python3}" MLM="${MLM:-.carry/mlm}"
[[ -d "$MLM" ]] || MLM=/work/mlm/main  # a dry run before tools/gpu_carry.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  MAX_JOBS="${MAX_JOBS:-16}"
exec > >(tee -a "$OUT/session.log") 2>&1

stage_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', \
torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  local build=("$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .)
  if ((DRY)); then
    echo "dry run: build skipped: ${build[*]} (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS)"
  else
    local start=$SECONDS
    "${build[@]}" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; return 1; }
    echo "build: $((SECONDS - start)) s"
  fi
  "$PYTHON" -c "import megatron_opt.ops as o; print('extension imports:', o.HAS_CUDA_EXT, o.CUDA_EXT_ERROR or ''); \
raise SystemExit(0 if o.HAS_CUDA_EXT or $DRY else 1)"
}

stage_tests() {
  local args=(-q -p no:cacheprovider -m cuda tests)
  if ((DRY)); then
    "$PYTHON" -m pytest "${args[@]}" --collect-only > "$WORK/cuda_tests.log" 2>&1 || { tail -20 "$WORK/cuda_tests.log"; return 1; }
    tail -1 "$WORK/cuda_tests.log"
    "$PYTHON" tools/cuda_test_counts.py --collected "$WORK/cuda_tests.log" --json "$OUT/cuda_tests.json"
    return
  fi
  "$PYTHON" -c "import xdist" 2>/dev/null && args+=(-n 8)
  timeout 165 "$PYTHON" -m pytest "${args[@]}" --timeout 60 --junitxml "$WORK/cuda_tests.xml" > "$WORK/cuda_tests.log" 2>&1
  local rc=$?
  tail -3 "$WORK/cuda_tests.log"
  [[ -f "$WORK/cuda_tests.xml" ]] && "$PYTHON" tools/cuda_test_counts.py "$WORK/cuda_tests.xml" --json "$OUT/cuda_tests.json"
  return $rc
}

stage_megatron() {
  # tools/megatron_lm_cpu/bench.py: the same comparison as on the CPU (Megatron-LM's own timers side by
  # side, alternating runs, plus each pair's loss / grad-norm agreement); one GPU, so DP1: Adam bf16 with
  # both overlaps, and Muon against megatron-core's LayerWise optimizer
  local args=(tools/megatron_lm_cpu/bench.py --main "$MLM" "$PYTHON" --configs adam-bf16-overlap muon-bf16-overlap
              --logs "$WORK/megatron" --out "$OUT/megatron.json")
  local gpu=(--gpu --nproc 1 --sizes gpu --pairs 1 --iters "$MEGATRON_ITERS" --launch-timeout 60)
  if ((DRY)); then  # the GPU command lines, then the pairs through the CPU shim: 2 ranks (gloo), the 100M model
    "$PYTHON" "${args[@]}" "${gpu[@]}" --dry-run || return 1
    args+=(--sizes 100M --pairs 1 --iters 4 --launch-timeout 150)
  else
    args+=("${gpu[@]}")
  fi
  "$PYTHON" "${args[@]}"
  local rc=$?
  [[ -f "$OUT/megatron.md" ]] && cat "$OUT/megatron.md"
  return $rc
}

stage_step() {
  local args=(scripts/bench_optimizer_step.py --mo-states fp32,bf16,bf16+rem --json "$OUT/step.json")
  "$PYTHON" -c "import matplotlib" 2>/dev/null && args+=(--plot "$OUT/step.png")
  if ((DRY)); then
    args+=(--device cpu --log2-sizes 12,14 --iters 2 --warmup 1)
  else
    args+=(--device cuda --log2-sizes 22,24,26 --iters 20 --warmup 5)
  fi
  "$PYTHON" "${args[@]}"
}
export -f stage_env stage_tests stage_megatron stage_step

declare -A BUDGET=([env]=140 [tests]=140 [megatron]=200 [step]=60)
((DRY)) && BUDGET[megatron]=400  # four CPU launches of Megatron-LM at 100M, ~60 s each on two shared cores
RESULTS=()
for s in env tests megatron step; do
  [[ ",$STAGES," == *",$s,"* ]] || continue
  echo "=== stage $s (<= ${BUDGET[$s]} s)$( ((DRY)) && echo ', dry run') === $(date -u +%T)"
  start=$SECONDS
  timeout -k 5 "${BUDGET[$s]}" bash -c "stage_$s"
  rc=$?
  echo "=== stage $s: rc $rc$( ((rc == 124)) && echo ' (timed out)'), $((SECONDS - start)) s"
  RESULTS+=("\"$s\": {\"rc\": $rc, \"seconds\": $((SECONDS - start))}")
  [[ $s == env && $rc != 0 ]] && ! ((DRY)) && echo "no extension: the CUDA stages would only skip" && break
done
(IFS=,; echo "{\"dry_run\": $DRY, ${RESULTS[*]}}") > "$OUT/stages.json"
tar -C "$WORK" -czf "$OUT/logs.tgz" . && rm -rf "$WORK"
cat "$OUT/stages.json"
ls -la "$OUT"
! grep -q '"rc": [1-9]' "$OUT/stages.json"
