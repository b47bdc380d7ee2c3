"""A dropped DistributedDataParallel is freed with its model, grad buffers and process groups.

The params' post-accumulate-grad hooks live in autograd's C++ storage, which Python's collector
cannot traverse: a hook holding the wrapper strongly made a cycle that was never collected (in the
test pools, ~18 gloo groups per model-parallel case stayed alive with their threads and sockets).
"""
from __future__ import annotations

import pytest

from tests.distributed import cases_lifetime as cases

BOUND_S = 60


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_wrapper_and_its_model_are_freed(pools, overlap):
    for rank, res in enumerate(pools(2).run(cases.run_dropped_wrapper_is_freed, overlap, timeout=BOUND_S)):
        assert res == {"wrapper": True, "model": True}, f"rank {rank}: still alive after gc: {res}"
