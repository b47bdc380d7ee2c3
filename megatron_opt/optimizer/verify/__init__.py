"""Verify mode: the step's checks (``step_verifier``), the replicas' checksums (``replica_check``) and what a
rule's float64 recomputation takes and returns (``float64_update``).

``megatron_opt.optimizer.verify`` was one module before issue 38; its public names (``StepVerifier``,
``VerifyReport``, ``Finding``, ...) are still read from here, loaded on first use (the rules import
``float64_update`` from this package while the verifier imports the rules, so nothing is imported eagerly).
"""
from __future__ import annotations

from typing import Any

STEP_VERIFIER_NAMES = ("StepVerifier", "VerifyReport", "Finding", "recompute_of", "cast_findings", "update_findings",
                       "unchanged_findings")


def __getattr__(name: str) -> Any:
    if name in STEP_VERIFIER_NAMES:
        from . import step_verifier
        return getattr(step_verifier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
