#!/usr/bin/env bash
# Fresh-machine test run, in two interpreters:
#   1. Python 3.12 with megatron-core 0.19.2 (the primary target): .venv, the lint (ruff check ., configured in
#      pyproject.toml; a violation fails the run before any test), then the whole suite.
#   2. Python 3.11 with megatron-core 0.16.1 (still supported): .venv311, tests/mcore only.
# Each creates its venv, installs torch, the package (building csrc when torch has CUDA) and the test
# dependencies, then runs pytest. Settings:
#   MEGATRON_OPT_TORCH          torch for the 3.12 run (default 2.13.0; on Python 3.12 both 2.13.0 and 2.14.1
#                               are CUDA builds, so csrc is compiled, with no GPU needed)
#   MEGATRON_OPT_REQUIRE_EXT=1  fail unless the CUDA extension was built and imports (3.12 run)
#   MEGATRON_OPT_SKIP_CUDA_BUILD=1  do not compile csrc (faster local runs; the CUDA tests then skip)
#   MEGATRON_OPT_ONLY=312|311   run one of the two
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # $1 = 3.12 or 3.11: python3.X on PATH (a working one), else pyenv's newest 3.X
    local want="$1" candidate
    if candidate="$(command -v "python$want")" && "$candidate" -c "" 2>/dev/null; then
        echo "$candidate"; return 0
    fi
    local root
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for candidate in $(ls -d "$root"/versions/"$want".*/bin/"python$want" 2>/dev/null | sort -V -r); do
        if "$candidate" -c "" 2>/dev/null; then echo "$candidate"; return 0; fi
    done
    echo "scripts/test.sh: no Python $want found (neither python$want on PATH nor pyenv's versions/$want.*);" \
         "install Python $want (e.g. pyenv install $want) or run one half with MEGATRON_OPT_ONLY." >&2
    return 1
}

# Settings that let torch's CUDA build compile csrc on a machine without a GPU (docs/kernels.md).
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}" MAX_JOBS="${MAX_JOBS:-2}"

setup_venv() {  # $1 = interpreter, $2 = venv, $3 = torch version, $4 = megatron-core version
    "$1" -m venv "$2"
    "$2/bin/pip" install -q --upgrade "torch==$3" numpy ninja wheel "setuptools>=64"
    "$2/bin/pip" install -q -e '.[test]' "megatron-core==$4" --no-build-isolation
    "$2/bin/python" - <<'PY'
import os, sys, megatron_opt.ops as ops
from megatron.core import package_info
print(f"Python {sys.version.split()[0]}, megatron-core {package_info.__version__}; megatron_opt CUDA extension built: "
      f"{ops.HAS_CUDA_EXT}" + (f" ({ops.CUDA_EXT_ERROR})" if ops.CUDA_EXT_ERROR else ""))
PY
}

ONLY="${MEGATRON_OPT_ONLY:-}"
if [ "$ONLY" != "311" ]; then
    PY312="$(find_python 3.12)"
    setup_venv "$PY312" .venv "${MEGATRON_OPT_TORCH:-2.13.0}" 0.19.2
    if [ "${MEGATRON_OPT_REQUIRE_EXT:-}" = "1" ]; then
        .venv/bin/python -c "import megatron_opt.ops as o, sys; sys.exit(0 if o.HAS_CUDA_EXT else 'MEGATRON_OPT_REQUIRE_EXT=1 but the CUDA extension did not build/import')"
    fi
    .venv/bin/ruff check .
    .venv/bin/python -m pytest -q
fi
if [ "$ONLY" != "312" ]; then
    PY311="$(find_python 3.11)"
    MEGATRON_OPT_SKIP_CUDA_BUILD=1 setup_venv "$PY311" .venv311 2.13.0 0.16.1
    .venv311/bin/python -m pytest -q tests/mcore
fi
