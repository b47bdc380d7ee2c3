#!/usr/bin/env bash
# Fill .carry/ (ignored by git) with what scripts/gpu_session.sh needs on the GPU machine that the
# repository does not hold and the machine cannot download: Megatron-LM's own source tree (megatron/,
# pretrain_gpt.py, gpt_builders.py, model_provider.py) and a build of its dataset helpers.
#   usage: bash tools/gpu_carry.sh [MEGATRON_LM_DIR] [PYTHON]
#     MEGATRON_LM_DIR  an extracted Megatron-LM tree (default /work/mlm/main, main at d98e8a64)
#     PYTHON           a Python 3.12 with megatron-core installed, whose helpers_cpp build is copied when its
#                      helpers.cpp is the tree's (default /work/main/.venv312/bin/python)
# No wheels: Megatron-LM's pretrain_gpt.py with --mock-data imports torch, numpy, packaging (and optionally
# einops, pyyaml, tensorboard), all in the GPU machine's image; emerging-optimizers and nvidia-modelopt are
# optional imports there. The device tool carries at most 64 MiB in all; this prints the size.
set -euo pipefail
cd "$(dirname "$0")/.."
MLM="${1:-/work/mlm/main}"
PY="${2:-/work/main/.venv312/bin/python}"
for f in megatron pretrain_gpt.py gpt_builders.py model_provider.py; do
  [[ -e "$MLM/$f" ]] || { echo "gpu_carry: $MLM has no $f (not a Megatron-LM tree)" >&2; exit 1; }
done
rm -rf .carry/mlm && mkdir -p .carry/mlm
tar -C "$MLM" --exclude=__pycache__ --exclude='*.pyc' -cf - megatron pretrain_gpt.py gpt_builders.py model_provider.py \
  | tar -C .carry/mlm -xf -
# Megatron-LM compiles helpers.cpp with make, python3-config and pybind11 at start-up; bring a build instead
# (x86-64, CPython 3.12: the GPU machine's kind) when the installed megatron-core's helpers.cpp is the same.
"$PY" - .carry/mlm/megatron/core/datasets <<'PYEOF'
import filecmp, glob, importlib.metadata, os, shutil, sys
ours = sys.argv[1]
try:
    theirs = str(importlib.metadata.distribution("megatron-core").locate_file("megatron/core/datasets"))
except importlib.metadata.PackageNotFoundError:
    sys.exit("gpu_carry: no megatron-core here; Megatron-LM will compile its dataset helpers itself")
builds = glob.glob(os.path.join(theirs, "helpers_cpp*.so"))
if builds and filecmp.cmp(os.path.join(ours, "helpers.cpp"), os.path.join(theirs, "helpers.cpp"), shallow=False):
    shutil.copy(builds[0], ours)
    print("gpu_carry: dataset helpers build", os.path.basename(builds[0]))
else:
    print("gpu_carry: helpers.cpp differs from megatron-core's; Megatron-LM will compile it itself")
PYEOF
grep -qx '/.carry/' .gitignore || echo '/.carry/' >> .gitignore
echo "gpu_carry: .carry holds $(du -sm .carry | cut -f1) MiB ($(du -sb .carry | cut -f1) bytes; the device tool carries 64 MiB in all)"
