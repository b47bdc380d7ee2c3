import os

import pytest
import torch

import megatron_opt.ops as ops
from tests.support.dist_harness import Pools


SLOW = os.environ.get("MEGATRON_OPT_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (long redundant cases and break-on-purpose controls) run only with
    MEGATRON_OPT_SLOW=1, so the default suite stays within its time budget."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow profile: run with MEGATRON_OPT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pools():
    """pools(world_size) -> a persistent gloo WorkerPool of that size."""
    p = Pools()
    yield p
    p.close()



@pytest.fixture(params=["cpu-bypass", "cuda"])
def wrapper(request, monkeypatch):
    """(backend, device) for the tests of the CUDA wrapper (ops.cuda), called through the public
    fronts with backend="cuda-ext": on a GPU, or on the CPU with the wrapper's device check
    (``ops.cuda.cuda_device``) replaced so that CPU tensors reach the compiled module's own checks."""
    if not ops.HAS_CUDA_EXT:
        pytest.skip(f"extension not built: {ops.CUDA_EXT_ERROR}")
    from megatron_opt.ops import cuda as cuda_wrapper

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return "cuda-ext", torch.device("cuda")
    monkeypatch.setattr(cuda_wrapper, "cuda_device", lambda op, grad: grad.device)
    return "cuda-ext", torch.device("cpu")
