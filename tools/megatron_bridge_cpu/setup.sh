#!/usr/bin/env bash
# Make a Python 3.12 venv in which Megatron-Bridge 0.6.2's training path imports and runs on CPU
# (tools/megatron_bridge_cpu/run.py and compare.py; tests/mcore/test_megatron_bridge.py):
#
#   tools/megatron_bridge_cpu/setup.sh VENV [PYTHON3.12]     # then: export MEGATRON_BRIDGE_PYTHON=VENV/bin/python
#
# Keep VENV outside the repository (or in an ignored folder). megatron_opt itself is not installed: the
# harness runs with the repository on PYTHONPATH. What it installs, and why each way:
#   * torch 2.14.1 with its own dependencies;
#   * requirements.txt with --no-deps: exact versions of what the training path imports (see that file);
#   * nvidia-resiliency-ext 0.6.0 (megatron-core 0.19.2 asserts >= 0.6.0 at import; Bridge's pretrain imports
#     its in-process restart wrapper). From 0.5 on its wheels are built for glibc 2.39 only; the package is pure
#     Python except one CUPTI module that CPU training never loads, so the wheel is unpacked with
#     --platform manylinux_2_39_x86_64 --target into VENV/nvidia-resiliency-ext and put on sys.path by a .pth.
# Not installed: Transformer Engine (CUDA only; bridge_shim.py's scoped placeholder lets megatron.bridge import
# without it), fast-hadamard-transform (imported only by megatron-core's DSA attention, inside try/except; to
# build it at all it needs FAST_HADAMARD_TRANSFORM_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation),
# hydra-core (Bridge's command-line overrides only), and Bridge's other declared dependencies.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$(realpath -m "${1:?usage: setup.sh VENV [PYTHON3.12]}")"
python="${2:-python3.12}"

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" "torch==2.14.1"
"${pip[@]}" --no-deps -r "$here/requirements.txt"
"${pip[@]}" --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 \
    --target "$venv/nvidia-resiliency-ext" "nvidia-resiliency-ext==0.6.0"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$venv/nvidia-resiliency-ext" > "$site/nvidia_resiliency_ext.pth"

# The training path imports, with megatron-core still finding Transformer Engine absent.
PYTHONWARNINGS=ignore "$venv/bin/python" - "$here" <<'PY'
import os, sys
here = sys.argv[1]
sys.path[:0] = [os.path.join(os.path.dirname(here), "megatron_lm_cpu"), here]
import bridge_shim
bridge_shim.stub_transformer_engine_for_lora_layers()
from megatron.bridge.training.pretrain import pretrain  # noqa: F401
from megatron.bridge.training.gpt_step import forward_step  # noqa: F401
from megatron.bridge.recipes.gpt.h100 import gpt3_175b_pretrain_32gpu_h100_bf16_config  # noqa: F401
import megatron.core.extensions.transformer_engine as te_ext
assert not te_ext.HAVE_TE and "transformer_engine" not in sys.modules, "megatron-core sees Transformer Engine"
import megatron.bridge, megatron.core
print(f"Megatron-Bridge {megatron.bridge.__version__}, megatron-core {megatron.core.__version__}: training path imports")
PY
echo "export MEGATRON_BRIDGE_PYTHON=$venv/bin/python"
