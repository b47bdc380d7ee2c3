import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_harness import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """pools(world_size) -> a persistent gloo WorkerPool of that size."""
    p = Pools()
    yield p
    p.close()
