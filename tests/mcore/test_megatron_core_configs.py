"""Our configs against the installed megatron-core's (moved from tests/unit, which runs without
megatron-core): the same defaults, declared and constructed; the fields Megatron-LM sets by name exist
in megatron-core's configs too; megatron-core's default instances construct ours; a converted
megatron-core config keeps verify mode off."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatron_opt.config import DistributedDataParallelConfig, OptimizerConfig, config_fields
from megatron_opt.config_conversion import as_optimizer_config
from tests.support.megatron_config_spec import DDP_FIELDS_SET_BY_NAME, OPTIMIZER_FIELDS_SET_BY_NAME, field_default

# CI installs megatron-core: import it unconditionally so that a missing dependency fails loudly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.distributed import DistributedDataParallelConfig as MDDP
    from megatron.core.optimizer import OptimizerConfig as MOC

LR = 1e-3

# Fields whose defaults are documented to differ from megatron-core's in representation only.
# grad_norm_skip_threshold: megatron-core uses inf, we use None; both mean "off" (inf is mapped to None).
DOCUMENTED_DEFAULT_DIFFERENCES = {"grad_norm_skip_threshold"}


def _shared_defaults(ours: type, theirs: type):
    mine = {f.name: f for f in dataclasses.fields(ours)}
    ref = {f.name: f for f in dataclasses.fields(theirs)}
    shared = [n for n in mine if n in ref and n not in DOCUMENTED_DEFAULT_DIFFERENCES]
    return [(n, field_default(mine[n]), field_default(ref[n])) for n in shared]


# --------------------------------------------------------------------------------------------------
# Defaults match megatron-core
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ours, theirs", [(DistributedDataParallelConfig, MDDP), (OptimizerConfig, MOC)])
def test_defaults_equal_megatron_core(ours, theirs):
    shared = _shared_defaults(ours, theirs)
    # Guard against a vacuous comparison (e.g. if fields were renamed on either side).
    assert len(shared) >= 15
    mismatches = [(n, a, b) for n, a, b in shared if a != b]
    assert not mismatches, f"defaults differ from megatron-core: {mismatches}"


@pytest.mark.parametrize("ours, theirs", [(DistributedDataParallelConfig, MDDP), (OptimizerConfig, MOC)])
def test_constructed_defaults_equal_megatron_core(ours, theirs):
    """Compare instances (after __post_init__), not just declared defaults."""
    kwargs = {"lr": LR} if ours is OptimizerConfig else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = theirs(**kwargs)
    mine = ours(**kwargs)
    names = [n for n in config_fields(ours) if hasattr(ref, n) and n not in DOCUMENTED_DEFAULT_DIFFERENCES]
    assert len(names) >= 15
    diffs = {n: (getattr(mine, n), getattr(ref, n)) for n in names if getattr(mine, n) != getattr(ref, n)}
    assert not diffs


def test_megatron_field_names_are_megatron_cores():
    """The fields Megatron-LM's launch code sets by name (ours have them: tests/unit/test_config.py)
    exist in megatron-core's configs with the same spelling."""
    for name in DDP_FIELDS_SET_BY_NAME:
        assert name in {f.name for f in dataclasses.fields(MDDP)}
    for name in OPTIMIZER_FIELDS_SET_BY_NAME:
        assert name in {f.name for f in dataclasses.fields(MOC)}


# --------------------------------------------------------------------------------------------------
# megatron-core's own defaults still construct (and pass the new checks)
# --------------------------------------------------------------------------------------------------


def test_megatron_core_default_instances_construct():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_opt, ref_ddp = MOC(lr=LR), MDDP()
    ours = {n: getattr(ref_opt, n) for n in OptimizerConfig.__dataclass_fields__ if hasattr(ref_opt, n)}
    config = OptimizerConfig(**ours)
    assert config.grad_norm_skip_threshold is None  # megatron-core's inf, if it has the field
    ddp = {n: getattr(ref_ddp, n) for n in DistributedDataParallelConfig.__dataclass_fields__ if hasattr(ref_ddp, n)}
    DistributedDataParallelConfig(**ddp)


def test_megatron_core_config_converts_with_verify_mode_off():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = MOC(lr=1e-3, bf16=True)
    assert not hasattr(core, "verify_interval")
    ours = as_optimizer_config(core)
    assert (ours.verify_interval, ours.verify_action) == (0, "raise")
