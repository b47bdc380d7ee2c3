#!/usr/bin/env bash
# Fresh-machine test run: create .venv, install torch, the package (building csrc when torch has
# CUDA) and the test dependencies, then run the whole suite.
#   MEGATRON_OPT_TORCH     torch version to install (default 2.13.0, a CPU build; 2.14.1 is a CUDA build
#                          that also compiles the CUDA extension, with no GPU needed)
#   MEGATRON_OPT_REQUIRE_EXT=1   fail unless the CUDA extension was built and imports
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${MEGATRON_OPT_TORCH:-2.13.0}"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade "torch==${TORCH_VERSION}" numpy ninja wheel "setuptools>=64"
# Settings that let torch's CUDA build compile csrc on a machine without a GPU (docs/kernels.md).
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}" MAX_JOBS="${MAX_JOBS:-2}"
.venv/bin/pip install -q -e '.[test]' --no-build-isolation
.venv/bin/python - <<'PY'
import os, megatron_opt.ops as ops
print(f"megatron_opt CUDA extension built: {ops.HAS_CUDA_EXT}" + (f" ({ops.CUDA_EXT_ERROR})" if ops.CUDA_EXT_ERROR else ""))
if os.environ.get("MEGATRON_OPT_REQUIRE_EXT") == "1" and not ops.HAS_CUDA_EXT:
    raise SystemExit("MEGATRON_OPT_REQUIRE_EXT=1 but the CUDA extension did not build/import")
PY
.venv/bin/python -m pytest -q
