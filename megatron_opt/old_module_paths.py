"""Module paths that moved (issue 38: ``optimizer/`` in folders by concern), still importable.

``MOVED`` maps each old dotted path to the module that now holds its code. ``megatron_opt/__init__.py``
installs ``OldModulePaths`` once, so ``import megatron_opt.optimizer.step_driver`` or
``from megatron_opt.optimizer.state_view import OptimizerStateView`` gives the new module itself (the
same module object, not a copy: a monkeypatch or an ``isinstance`` check sees one class). docs/usage.md
("Moved modules") lists the same table; a test keeps the two equal.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Optional, Sequence

MOVED = {
    "megatron_opt.distributed.step_state": "megatron_opt.distributed.grad_sync_state",
    "megatron_opt.optimizer.boxes": "megatron_opt.optimizer.state.boxes",
    "megatron_opt.optimizer.factory": "megatron_opt.optimizer.build.factory",
    "megatron_opt.optimizer.float64_update": "megatron_opt.optimizer.verify.float64_update",
    "megatron_opt.optimizer.grad_multiplier": "megatron_opt.optimizer.step.grad_multiplier",
    "megatron_opt.optimizer.hyperparams": "megatron_opt.optimizer.step.param_group_checks",
    "megatron_opt.optimizer.muon_homes": "megatron_opt.optimizer.whole_tensor.homes",
    "megatron_opt.optimizer.param_groups": "megatron_opt.optimizer.build.param_groups",
    "megatron_opt.optimizer.phase_timers": "megatron_opt.optimizer.step.phase_timers",
    "megatron_opt.optimizer.replica_check": "megatron_opt.optimizer.verify.replica_check",
    "megatron_opt.optimizer.shard_store": "megatron_opt.optimizer.state.shard_store",
    "megatron_opt.optimizer.sharded_layouts": "megatron_opt.optimizer.state.torch_dist_layouts",
    "megatron_opt.optimizer.sharded_state_dict": "megatron_opt.optimizer.state.torch_dist",
    "megatron_opt.optimizer.state_access": "megatron_opt.optimizer.state.piece_state",
    "megatron_opt.optimizer.state_dict": "megatron_opt.optimizer.state.in_memory",
    "megatron_opt.optimizer.state_view": "megatron_opt.optimizer.state.view",
    "megatron_opt.optimizer.stats": "megatron_opt.optimizer.step.global_stats",
    "megatron_opt.optimizer.step_decision": "megatron_opt.optimizer.step.decision",
    "megatron_opt.optimizer.step_driver": "megatron_opt.optimizer.step.driver",
    "megatron_opt.optimizer.tensor_parallel_newton_schulz":
        "megatron_opt.optimizer.whole_tensor.tensor_parallel_newton_schulz",
    "megatron_opt.optimizer.whole_tensor_leaf": "megatron_opt.optimizer.whole_tensor.leaf",
    "megatron_opt.optimizer.whole_tensor_stage": "megatron_opt.optimizer.whole_tensor.matrix_exchange",
}
# ``megatron_opt.optimizer.verify`` was a module and is now the package of verify mode; its names
# (StepVerifier, VerifyReport, Finding, ...) are re-exported there, so the old path needs no entry.


class OldModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of ``MOVED`` and loads it as the new module (already imported or imported now)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


def install() -> None:
    """Put one ``OldModulePaths`` on ``sys.meta_path`` (again, after a reload, it is not added twice)."""
    if not any(type(finder).__name__ == OldModulePaths.__name__ for finder in sys.meta_path):
        sys.meta_path.append(OldModulePaths())
