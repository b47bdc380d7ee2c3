"""Muon with Megatron-LM's precision-aware optimizer options: exp_avg_dtype stores the momentum_buffer,
what is not implemented is refused by name with its fix."""
import dataclasses

import pytest
import torch

import megatron_opt as mo
from megatron_opt.optimizer.rules.muon import Muon
from megatron_opt.optimizer.rules.registry import update_rule_from_config


def _cfg(**kw):
    return mo.OptimizerConfig(optimizer="muon", lr=0.01, bf16=True, use_distributed_optimizer=True, **kw)


def test_precision_aware_muon_keeps_a_bf16_momentum_buffer():
    cfg = _cfg(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    assert Muon.from_config(cfg).state_dtypes() == {"momentum_buffer": torch.bfloat16}
    assert Muon.from_config(_cfg()).state_dtypes() == {"momentum_buffer": torch.float32}
    assert not cfg.uses_param_remainders  # Muon's masters stay fp32 ...
    assert dataclasses.replace(cfg, optimizer="adam").uses_param_remainders  # ... AdamW's follow Megatron-LM's default


@pytest.mark.parametrize("extra, named, fix", [
    (dict(main_params_dtype=torch.float16), "main_params_dtype", "leave main_params_dtype at torch.float32"),
    (dict(exp_avg_dtype=torch.float16), "exp_avg_dtype", "torch.bfloat16"),
    (dict(exp_avg_dtype=torch.bfloat16, stochastic_rounding=True), "stochastic_rounding", "leave it False"),
])
def test_precision_aware_muon_refuses_what_is_not_implemented(extra, named, fix):
    config = _cfg(use_precision_aware_optimizer=True, **extra)
    with pytest.raises(mo.UnsupportedConfigError, match=named) as info:
        update_rule_from_config(config)  # where the rule is built
    assert fix in str(info.value)
