"""torch.distributed.checkpoint's failures as CheckpointErrors that keep DCP's own causes.

DCP raises ``CheckpointException``, a BaseException (``except Exception`` misses it) whose causes
sit in ``failures`` ({rank: (exception, traceback)}); its ``str()`` is, depending on the torch
version, only the failing ranks' numbers or whole tracebacks. A CheckpointError states each
failing rank's cause on one line instead.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch.distributed.checkpoint import CheckpointException

from ..errors import CheckpointError


def describe(exc: BaseException) -> str:
    """``Type: message``; for DCP's CheckpointException, every failing rank's cause."""
    if isinstance(exc, CheckpointException):
        causes = []
        for rank, failure in sorted(exc.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {describe(cause)}")
        return "torch.distributed.checkpoint failed on " + "; ".join(causes)
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def dcp_failures(what: str) -> Iterator[None]:
    """Raise a DCP failure inside the block as ``CheckpointError("<what>: <causes>")``."""
    try:
        yield
    except CheckpointException as exc:
        raise CheckpointError(f"{what}: {describe(exc)}") from exc


__all__ = ["describe", "dcp_failures"]
