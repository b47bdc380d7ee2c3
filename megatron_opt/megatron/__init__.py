"""Megatron-LM integration: megatron-core's config objects and call shapes, and ``install()``.

``install()`` switches a Megatron-LM script over to megatron_opt in one line::

    import megatron_opt.megatron; megatron_opt.megatron.install()

It replaces megatron-core's ``DistributedDataParallel`` and ``get_megatron_optimizer`` with megatron_opt's
(for Muon, after tagging the QKV weights as megatron-core does: muon_call.py), in megatron-core's own modules
and wherever a module already imported them by name (Megatron-LM's ``megatron/training/training.py`` does
``from megatron.core.distributed import DistributedDataParallel as DDP``), and in tuples of wrapper classes
(``unwrap_model``'s). It also puts a check in front of megatron-core's ``dist_checkpointing.load``: a
``dp_reshardable`` optimizer checkpoint whose buckets differ from this run's is refused on every rank, naming
both layouts and the fix, before torch.distributed.checkpoint would fail on a missing key
(``checked_load.py``). Call it before Megatron-LM imports its training modules, or after: both are covered.
``uninstall()`` restores megatron-core's objects.

The patch is process-wide, so its undo record lives with it: each patched module keeps the values
it had in its own ``_megatron_opt_originals`` dict (megatron_opt itself holds no state).
"""
from __future__ import annotations

import sys
from typing import Any

_ORIGINALS = "_megatron_opt_originals"  # in a patched module: {attribute: megatron-core's value}


def _targets() -> dict[int, Any]:
    """id(megatron-core object) -> megatron_opt's replacement."""
    import megatron.core.dist_checkpointing as core_dist_checkpointing
    import megatron.core.distributed as core_distributed
    import megatron.core.distributed.distributed_data_parallel as core_ddp
    import megatron.core.optimizer as core_optimizer

    from ..distributed.ddp import DistributedDataParallel
    from . import muon_call
    from .checked_load import checked

    pairs = {
        id(core_ddp.DistributedDataParallel): DistributedDataParallel,
        id(core_distributed.DistributedDataParallel): DistributedDataParallel,
        # megatron_opt's, with megatron-core's QKV tagging for Muon first (muon_call.py)
        id(core_optimizer.get_megatron_optimizer): muon_call.get_megatron_optimizer,
        id(core_dist_checkpointing.load): checked(core_dist_checkpointing.load),
    }
    try:
        import megatron.core.optimizer.muon as core_muon
    except ImportError:  # (emerging-optimizers missing, or a release without the module)
        core_muon = None
    # core_v0.16.1's own Muon builder (its module defines TensorParallelMuon) gets a clear error; later
    # releases keep the name as a shim that calls get_megatron_optimizer, which is ours already.
    if core_muon is not None and hasattr(core_muon, "TensorParallelMuon"):
        pairs[id(core_muon.get_megatron_muon_optimizer)] = muon_call.get_megatron_muon_optimizer
    return pairs


def _megatron_modules() -> list[Any]:
    """megatron-core's (and Megatron-LM's) loaded modules: the namespaces install() may patch."""
    return [module for name, module in list(sys.modules.items())
            if module is not None and name.startswith("megatron") and not name.startswith("megatron_opt")]


def _patch(module: Any, name: str, value: Any) -> None:
    vars(module).setdefault(_ORIGINALS, {})[name] = getattr(module, name)
    setattr(module, name, value)


def install() -> None:
    """Make megatron-core's names resolve to megatron_opt's DistributedDataParallel and
    get_megatron_optimizer (idempotent). Needs megatron-core to be importable."""
    if is_installed():
        return
    try:
        targets = _targets()
    except ImportError as exc:
        raise ImportError(f"megatron_opt.megatron.install() needs megatron-core (pip install megatron-core): "
                          f"{exc}") from exc
    from ..distributed.ddp import DistributedDataParallel

    core_ddp_classes = {k for k, v in targets.items() if v is DistributedDataParallel}
    for module in _megatron_modules():
        for name, value in list(vars(module).items()):
            if id(value) in targets:
                _patch(module, name, targets[id(value)])
            elif isinstance(value, tuple) and value and any(id(v) in core_ddp_classes for v in value):
                # A tuple of wrapper classes (unwrap_model's): ours is a wrapper too.
                _patch(module, name, value + (DistributedDataParallel,))


def uninstall() -> None:
    """Undo install(): megatron-core's objects are back wherever install() replaced them."""
    for module in _megatron_modules():
        for name, original in vars(module).pop(_ORIGINALS, {}).items():
            setattr(module, name, original)


def is_installed() -> bool:
    return any(_ORIGINALS in vars(module) for module in _megatron_modules())


from .checked_load import check_bucket_layout  # noqa: E402  (public: the check install() adds)

__all__ = ["install", "uninstall", "is_installed", "check_bucket_layout"]
