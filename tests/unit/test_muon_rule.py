"""Muon's rule and config (pure, one process): megatron-core's field names and defaults, the synonym
and the 0.16.1 name, refusals, and the whole-matrix math against the float64 reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron_opt as mo
from megatron_opt.config_conversion import as_optimizer_config
from megatron_opt.optimizer.rules.muon import Muon, newton_schulz, qkv_split_of, uses_muon
from megatron_opt.optimizer.rules.registry import update_rule_from_config
from tests.support import reference_muon as rm

CORE_DEFAULTS = dict(muon_momentum=0.95, muon_split_qkv=True, muon_nesterov=False, muon_scale_mode="spectral",
                     muon_fp32_matmul_prec="medium", muon_coefficient_type="quintic", muon_num_ns_steps=5,
                     muon_tp_mode="blockwise", muon_extra_scale_factor=1.0)


def test_fields_and_defaults_are_megatron_cores():
    cfg = mo.OptimizerConfig(lr=1e-3, optimizer="muon")
    assert {k: getattr(cfg, k) for k in CORE_DEFAULTS} == CORE_DEFAULTS
    assert update_rule_from_config(cfg) == Muon()
    assert type(update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="dist_muon"))) is Muon


def test_rule_takes_its_constants_from_the_config():
    cfg = mo.OptimizerConfig(lr=1e-3, optimizer="muon", muon_momentum=0.9, muon_nesterov=True, muon_num_ns_steps=7,
                             muon_scale_mode="shape_scaling", muon_extra_scale_factor=0.2, muon_split_qkv=False,
                             muon_fp32_matmul_prec="high")
    assert update_rule_from_config(cfg) == Muon(0.9, True, 7, "shape_scaling", 0.2, False, "high")


@pytest.mark.parametrize("field, value", [("muon_scale_mode", "rms"), ("muon_fp32_matmul_prec", "low"),
                                          ("muon_tp_mode", "sharded"), ("muon_momentum", 1.0),
                                          ("muon_num_ns_steps", 0)])
def test_invalid_muon_values_are_refused(field, value):
    config = mo.OptimizerConfig(lr=1e-3, optimizer="muon", **{field: value})  # the config knows no rule
    with pytest.raises(mo.InvalidConfigError, match=f"OptimizerConfig.{field}={value!r}"):
        update_rule_from_config(config)  # where the rule is built


@pytest.mark.parametrize("field, value", [("muon_coefficient_type", "cubic"), ("fp16", True)])
def test_unimplemented_muon_settings_are_refused_by_name(field, value):
    config = mo.OptimizerConfig(lr=1e-3, optimizer="muon", **{field: value})
    with pytest.raises(mo.UnsupportedConfigError, match=field):
        update_rule_from_config(config)


def test_muon_fields_are_inert_for_other_optimizers():
    assert mo.OptimizerConfig(lr=1e-3, muon_scale_mode="rms").muon_scale_mode == "rms"


def test_megatron_core_0_16_name_of_nesterov_is_converted():
    @dataclasses.dataclass
    class Core016Config:  # the fields that matter of megatron-core 0.16.1's OptimizerConfig
        lr: float = 1e-3
        optimizer: str = "muon"
        muon_use_nesterov: bool = False

    assert as_optimizer_config(Core016Config(muon_use_nesterov=True)).muon_nesterov is True
    assert as_optimizer_config(Core016Config()).muon_nesterov is False


def test_which_params_get_muon():
    w, b = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(3))
    emb = torch.nn.Parameter(torch.ones(5, 4))
    emb.is_embedding_or_output_parameter = True
    assert [uses_muon(p) for p in (w, b, emb)] == [True, False, False]


def test_qkv_split_comes_from_the_param():
    qkv = torch.nn.Parameter(torch.ones(32, 16))
    with pytest.raises(mo.InvalidConfigError, match="qkv_split_shapes"):
        qkv_split_of("decoder.layers.0.self_attention.linear_qkv.weight", qkv, True)
    assert qkv_split_of("decoder.layers.0.self_attention.linear_qkv.weight", qkv, False) is None
    qkv.qkv_split_shapes = (8, 4, 4)
    assert qkv_split_of("x.linear_qkv.weight", qkv, True) == (8, 4, 4)
    qkv.qkv_split_shapes = (8, 4, 3)
    with pytest.raises(mo.InvalidConfigError, match="divides"):
        qkv_split_of("x.linear_qkv.weight", qkv, True)


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
def test_newton_schulz_matches_the_reference_in_float64(shape):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(newton_schulz(u, 5), rm.newton_schulz(u, 5), rtol=0, atol=1e-12)
    assert newton_schulz(u, 5).dtype == torch.float64


@pytest.mark.parametrize("mode", ["spectral", "unit_rms_norm", "shape_scaling"])
@pytest.mark.parametrize("split", [None, (8, 4, 4)])
def test_orthogonalized_update_matches_the_reference(mode, split):
    u = torch.randn(32, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rule = Muon(scale_mode=mode, extra_scale_factor=0.5, num_ns_steps=6, fp32_matmul_prec="highest")
    expected = rm.orthogonalized_update(u, rm.MuonMatrix(qkv_split_shapes=split), tp_mode="blockwise", steps=6,
                                        scale_mode=mode, extra_scale=0.5)
    assert torch.allclose(rule.orthogonalize(u, split), expected, rtol=0, atol=1e-12)
    fp32 = rule.orthogonalize(u.float(), split).double()
    assert (fp32 - expected).norm() <= 1e-5 * expected.norm()
    medium = dataclasses.replace(rule, fp32_matmul_prec="medium").orthogonalize(u.float(), split).double()
    # bf16 iterations: 2^-8 per rounding, amplified on the small singular values (measured 0.2 on this
    # random matrix; 2.45e-2 on a GPT's update, docs/muon.md): clearly not fp32, still the same direction.
    assert 1e-3 * expected.norm() < (medium - expected).norm() <= 0.35 * expected.norm()


def test_momentum_is_the_ema_form_and_nesterov_looks_ahead():
    g, buf = torch.tensor([2.0, -4.0]), torch.tensor([1.0, 1.0])
    u = Muon(momentum=0.5).momentum_direction(g, torch.tensor(0.5), buf)
    assert buf.tolist() == [1.0, -0.5] and u.tolist() == [1.0, -0.5]
    buf = torch.tensor([1.0, 1.0])
    u = Muon(momentum=0.5, nesterov=True).momentum_direction(g, torch.tensor(0.5), buf)
    assert buf.tolist() == [1.0, -0.5] and u.tolist() == [1.0, -1.25]


def test_the_flags_map_megatron_lms_muon_defaults():
    """Megatron-LM main's --muon-* defaults, not megatron-core's config defaults (0.95, blockwise)."""
    import argparse

    from megatron_opt.megatron import arguments as megatron_args
    from megatron_opt.megatron.arguments.mapping import optimizer_config_from_args

    parser = argparse.ArgumentParser()
    megatron_args.add_megatron_args(parser)
    args = parser.parse_args(["--optimizer", "muon", "--lr", "1e-3"])
    config = optimizer_config_from_args(args)
    assert (config.muon_momentum, config.muon_tp_mode) == (0.9, "duplicated")
