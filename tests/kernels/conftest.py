import pytest


@pytest.fixture(autouse=True)
def _backend_as_named(monkeypatch):
    """The kernel tests name the backend of every call (backend="reference" | "cpu" | "cuda-ext"):
    the debugging override MEGATRON_OPT_OPS would run them all on one and make every comparison moot."""
    monkeypatch.delenv("MEGATRON_OPT_OPS", raising=False)
