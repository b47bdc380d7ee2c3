"""The whole-tensor family (rules/whole_tensor_rule.py): Muon's cost model gives the homes bitwise what
Newton-Schulz's cost did (so its homes, hence its steps, are unchanged); AdaptiveMuon is one more rule of it."""
from __future__ import annotations

import pytest

import megatron_opt as mo
from megatron_opt.optimizer.rules.adaptive_muon import AdaptiveMuon
from megatron_opt.optimizer.rules.muon import Muon
from megatron_opt.optimizer.rules.registry import update_rule_from_config
from megatron_opt.optimizer.rules.whole_tensor_rule import WholeTensorRule
from megatron_opt.optimizer.whole_tensor.homes import MatrixPlacement, placement_cost


@pytest.mark.parametrize("shape, pieces, steps", [((32, 16), 1, 5), ((96, 64), 3, 5), ((7, 300), 1, 7),
                                                  ((40, 40), 3, 3)])
def test_muons_home_cost_is_newton_schulz_cost_bitwise(shape, pieces, steps):
    rule = Muon(num_ns_steps=steps)
    placement = MatrixPlacement(shape, (shape[0] * shape[1],), pieces)
    assert rule.home_cost(shape, pieces) == placement_cost(placement, steps)


def test_adaptive_muon_is_a_whole_tensor_rule_with_elementwise_state():
    rule = update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon"))
    assert isinstance(rule, WholeTensorRule) and type(rule) is AdaptiveMuon
    assert rule.state_dtypes().keys() == {"momentum_buffer", "moment2_buffer"}
    assert (rule.direction_state, rule.finish_state) == (("momentum_buffer",), ("moment2_buffer",))
    assert rule.matrix_state((4, 4)) == {}
    assert (rule.beta2, rule.eps) == (0.95, 1e-8)


@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_adaptive_muon_other_moment2_methods_are_refused_by_name(method):
    config = mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon", adaptive_muon_moment2_method=method)
    with pytest.raises(mo.UnsupportedConfigError, match=f"adaptive_muon_moment2_method='{method}'.*'adamuon'"):
        update_rule_from_config(config)


def test_adaptive_muon_refuses_the_precision_aware_optimizer():
    config = mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon", use_precision_aware_optimizer=True)
    with pytest.raises(mo.UnsupportedConfigError, match="use_precision_aware_optimizer"):
        update_rule_from_config(config)
