"""The configs Megatron-LM's own argument parser builds with stock arguments (recorded from core_v0.16.1
and main by tools/megatron_lm_configs.py, replayed here without megatron-core) convert into megatron_opt's,
and every field megatron_opt lacks is decided in core_config_fields (inert, or default-only)."""
from __future__ import annotations

import dataclasses

import pytest

from tests.support import megatron_lm_configs as recorded
from megatron_opt import core_config_fields
from megatron_opt.config import DistributedDataParallelConfig, OptimizerConfig, UnsupportedConfigError
from megatron_opt.config_conversion import as_ddp_config, as_optimizer_config

OURS = {"optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}
CONVERT = {"optimizer": as_optimizer_config, "ddp": as_ddp_config}
CASES = [(label, launch, kind) for label in recorded.LABELS for launch in recorded.LAUNCHES
         for kind in ("optimizer", "ddp")]


def _ours(kind: str) -> set[str]:
    return {f.name for f in dataclasses.fields(OURS[kind])}


@pytest.mark.parametrize("label, launch, kind", CASES)
def test_megatron_lm_stock_config_converts(label, launch, kind):
    item = recorded.entry(label, launch, kind)
    converted = CONVERT[kind](recorded.rebuilt(item))
    for name, value in recorded.passed(item).items():
        if name in _ours(kind) and name != "grad_norm_skip_threshold":  # inf means off: our None
            assert getattr(converted, name) == value, name


@pytest.mark.parametrize("label", recorded.LABELS)
@pytest.mark.parametrize("kind", ["optimizer", "ddp"])
def test_every_recorded_megatron_core_field_is_decided(label, kind):
    """A field of the recorded megatron-core that is neither ours nor in the table would be refused
    whenever Megatron-LM passes a non-default value: decide it in core_config_fields.py."""
    fields = recorded.entry(label, "stock", kind)["defaults"]
    table = core_config_fields.DDP_FIELDS if kind == "ddp" else core_config_fields.OPTIMIZER_FIELDS
    undecided = sorted(set(fields) - _ours(kind) - set(table))
    assert not undecided, f"decide these {label} fields in megatron_opt/core_config_fields.py: {undecided}"


@pytest.mark.parametrize("kind, name, value", [
    ("optimizer", "muon_use_syrk", True),  # inert: a kernel detail of Muon
    ("optimizer", "pin_cpu_grads", False),  # inert: CPU offload only
    ("ddp", "megatron_fsdp_main_grads_dtype", "bf16"),  # inert: Megatron-FSDP only
    ("ddp", "gradient_reduce_div_fusion", False),  # inert: a fusion
])
def test_inert_field_accepts_any_value(kind, name, value):
    """An inert field is accepted at any value and ignored: the converted config is the same."""
    item = recorded.entry("main-d98e8a64", "stock", kind)
    config = recorded.rebuilt(item)
    assert getattr(config, name) != value
    unchanged = CONVERT[kind](config)
    setattr(config, name, value)
    assert CONVERT[kind](config) == unchanged


@pytest.mark.parametrize("kind, name, value, reason", [
    ("ddp", "num_buckets", 4, "bucket_size"),
    ("ddp", "fp4_param_gather", True, "fp4"),
    ("ddp", "param_name_patterns_for_fp32_local_accumulation", ("bias",), "grad_reduce_in_fp32"),
    ("optimizer", "use_layer_wise_distributed_optimizer", True, "layer-wise"),  # with optimizer='adam'
])
def test_default_only_field_is_refused_by_name_with_its_reason(kind, name, value, reason):
    config = recorded.rebuilt(recorded.entry("main-d98e8a64", "stock", kind))
    setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=f"{name}=.*{reason}"):
        CONVERT[kind](config)


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_layer_wise_distributed_muon_is_megatron_opts_sharded_muon(optimizer):
    """Megatron-LM main's --optimizer muon --use-distributed-optimizer: use_layer_wise_distributed_optimizer=True
    with use_distributed_optimizer=False (the model wrapped with the distributed optimizer's DDP) is Muon
    sharded over the data-parallel ranks; the muon_* fields keep Megatron-LM's values."""
    config = recorded.rebuilt(recorded.entry("main-d98e8a64", "stock", "optimizer"))
    config.optimizer, config.use_distributed_optimizer, config.muon_momentum = optimizer, False, 0.9
    assert as_optimizer_config(config).use_distributed_optimizer is False
    config.use_layer_wise_distributed_optimizer = True
    converted = as_optimizer_config(config)
    assert (converted.optimizer, converted.use_distributed_optimizer, converted.muon_momentum) == (optimizer, True, 0.9)


def test_an_undecided_field_is_refused_unless_at_its_default():
    item = recorded.entry("main-d98e8a64", "stock", "optimizer")
    item = {**item, "defaults": {**item["defaults"], "shiny_new_knob": 0}}
    as_optimizer_config(recorded.rebuilt(item))
    item = {**item, "passed": {**item["passed"], "shiny_new_knob": 3}}
    with pytest.raises(UnsupportedConfigError, match="shiny_new_knob=3.*no such setting"):
        as_optimizer_config(recorded.rebuilt(item))


def test_layer_wise_distributed_adaptive_muon_is_megatron_opts_sharded_adaptive_muon():
    """Megatron-LM main's --optimizer adaptive_muon --use-distributed-optimizer (issue 39): accepted by install()'s
    conversion as AdaptiveMuon sharded over the data-parallel ranks, its adaptive_muon_* fields carried."""
    config = recorded.rebuilt(recorded.entry("main-d98e8a64", "stock", "optimizer"))
    config.optimizer, config.use_distributed_optimizer = "adaptive_muon", False
    config.use_layer_wise_distributed_optimizer = True
    config.adaptive_muon_beta2, config.adaptive_muon_eps = 0.9, 1e-6
    converted = as_optimizer_config(config)
    assert (converted.optimizer, converted.use_distributed_optimizer) == ("adaptive_muon", True)
    assert (converted.adaptive_muon_beta2, converted.adaptive_muon_eps) == (0.9, 1e-6)
    config.optimizer = "soap"  # SOAP too: its soap_* fields carried
    config.soap_shampoo_beta, config.soap_use_kl_shampoo = 0.9, False
    converted = as_optimizer_config(config)
    assert (converted.optimizer, converted.use_distributed_optimizer) == ("soap", True)
    assert (converted.soap_shampoo_beta, converted.soap_use_kl_shampoo) == (0.9, False)
    config.optimizer = "lion"  # megatron-core's Lion: the matrices, with the Adam betas (AdamW the rest); sharded too
    config.adam_beta1, config.adam_beta2, config.lion_beta1, config.lion_beta2 = 0.8, 0.9, 0.5, 0.6
    for layer_wise in (True, False):
        config.use_layer_wise_distributed_optimizer = layer_wise
        converted = as_optimizer_config(config)
        assert (converted.optimizer, converted.use_distributed_optimizer) == ("lion", layer_wise)
        assert (converted.lion_beta1, converted.lion_beta2) == (0.8, 0.9)
        assert converted.rule_constants == {"lion_scope": "matrices"}
