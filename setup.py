"""Build megatron_opt; the CUDA extension only when torch was built with CUDA and nvcc exists.

Without CUDA (e.g. the torch CPU wheel) this installs the pure-Python package, whose
megatron_opt.ops falls back to the torch reference implementation.
"""
import glob
import os
import shutil

# Must precede the cpp_extension import: torch reads CUDA_HOME at import time.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
# With no visible GPU torch cannot auto-detect the arch list and raises IndexError.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0+PTX")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402


def _nvidia_wheel_include_dirs() -> list:
    """Headers shipped in torch's nvidia-* wheels (cusparse.h, cublas_v2.h, ...)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for base in nvidia.__path__ for d in glob.glob(os.path.join(base, "*", "include")))


def _want_cuda_build() -> bool:
    if os.environ.get("MEGATRON_OPT_SKIP_CUDA_BUILD") == "1":
        return False
    if torch.version.cuda is None:
        print("megatron_opt: torch has no CUDA; installing the pure-Python package (reference ops).")
        return False
    cuda_home = os.environ.get("CUDA_HOME", "")
    if not (shutil.which("nvcc") or os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))):
        print("megatron_opt: nvcc not found; installing the pure-Python package (reference ops).")
        return False
    return bool(glob.glob("csrc/**/*.cu", recursive=True))


ext_modules, cmdclass = [], {}
if _want_cuda_build():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # csrc/rules/<rule>.cu: one kernel file per update rule, each registering itself (csrc/pass2_registry.h).
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True)) + sorted(glob.glob("csrc/**/*.cu", recursive=True))
    ext_modules = [
        CUDAExtension(
            "megatron_opt._C",
            sources,
            include_dirs=[os.path.abspath("csrc")] + _nvidia_wheel_include_dirs(),
            extra_compile_args={
                "cxx": ["-O3", "-std=c++20"],
                # No --use_fast_math: results must track the float64 oracle.
                "nvcc": ["-O3", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr"],
            },
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}
    print(f"megatron_opt: building the CUDA extension for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")

setup(
    name="megatron_opt",
    version="0.1.0",
    description="Sharded mixed-precision distributed optimizer (ZeRO-1) with Megatron-LM semantics",
    packages=find_packages(include=["megatron_opt", "megatron_opt.*", "megatron_opt_train", "megatron_opt_train.*",
                                    "megatron_opt_bench"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis", "megatron-core", "tensorboard",
                             # the lint scripts/test.sh runs before pytest (pyproject.toml's [tool.ruff])
                             "ruff>=0.6",
                             # megatron-core's own Muon, the calibration of tests/mcore/test_muon_reference.py
                             # (emerging-optimizers needs Python 3.12; on 3.11 that test skips, saying why)
                             "emerging-optimizers; python_version >= '3.12'",
                             # megatron-core's checkpoint writer forks workers that import psutil
                             # before their error handling: without it every dist_checkpointing save hangs
                             "psutil",
                             # the main job's --tokenizer-type HuggingFaceTokenizer (megatron-core loads it with it)
                             "transformers"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
