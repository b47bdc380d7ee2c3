"""The whole-tensor family (rules/whole_tensor_rule.py): Muon's cost model gives the homes bitwise what
Newton-Schulz's cost did (so its homes, hence its steps, are unchanged); AdaptiveMuon is one more rule of it."""
from __future__ import annotations

import pytest
import torch

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


def test_adaptive_muon_other_moment2_methods_are_refused_by_name():
    config = mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon", adaptive_muon_moment2_method="namo")
    with pytest.raises(mo.UnsupportedConfigError, match="adaptive_muon_moment2_method='namo'.*'adamuon' and 'normuon'"):
        update_rule_from_config(config)


def test_normuon_keeps_its_second_moment_per_matrix_after_the_update():
    rule = update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon",
                                                      adaptive_muon_moment2_method="normuon"))
    assert rule.state_dtypes().keys() == {"momentum_buffer"}
    assert (rule.direction_state, rule.finish_state) == (("momentum_buffer",), ())
    assert {n: s for n, (s, _) in rule.matrix_state((6, 4)).items()} == {"moment2_buffer": (6, 1)}
    assert {n: s for n, (s, _) in rule.matrix_state((4, 6)).items()} == {"moment2_buffer": (1, 6)}
    assert rule.state_follows_update
    with pytest.raises(mo.UnsupportedConfigError, match="optimizer_cuda_graph=True.*'normuon'"):
        update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon", optimizer_cuda_graph=True,
                                                   adaptive_muon_moment2_method="normuon"))


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_normuon_update_with_state_is_emerging_optimizers_bitwise(shape):
    """update_with_state on O against emerging-optimizers' own normalisation of the same O and V (fp32)."""
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.adaptive_muon")
    rule = update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon",
                                                      adaptive_muon_moment2_method="normuon", adaptive_muon_beta2=0.9))
    theirs = eo.AdaptiveMuon([torch.nn.Parameter(torch.zeros(shape))], lr=1e-3, momentum=0.9, weight_decay=0.0,
                             moment2_method="normuon", beta2=0.9, eps=1e-8)
    g = torch.Generator().manual_seed(0)
    state = rule.new_matrix_state(shape, torch.device("cpu"))
    v_theirs = state["moment2_buffer"].clone()
    for _ in range(3):
        o = torch.randn(shape, generator=g) * 0.1
        mine, state = rule.update_with_state(o, state)
        expected = theirs._apply_moment2_normalization(o, v_theirs, 0.9, 1e-8)
        assert torch.equal(mine, expected) and torch.equal(state["moment2_buffer"], v_theirs)


def test_adaptive_muon_refuses_the_precision_aware_optimizer():
    config = mo.OptimizerConfig(lr=1e-3, optimizer="adaptive_muon", use_precision_aware_optimizer=True)
    with pytest.raises(mo.UnsupportedConfigError, match="use_precision_aware_optimizer"):
        update_rule_from_config(config)


def test_soap_is_a_whole_tensor_rule_whose_state_is_all_per_matrix():
    from megatron_opt.optimizer.rules.soap import SOAP

    config = mo.OptimizerConfig(lr=1e-3, optimizer="soap", adam_beta1=0.8, adam_beta2=0.9, soap_shampoo_beta=0.7,
                                soap_use_kl_shampoo=False)
    rule = update_rule_from_config(config)
    assert isinstance(rule, WholeTensorRule) and type(rule) is SOAP
    assert (rule.beta1, rule.beta2, rule.shampoo_beta, rule.use_kl_shampoo, rule.eps) == (0.8, 0.9, 0.7, False, 1e-8)
    assert rule.state_dtypes() == {}
    assert {n: s for n, (s, _) in rule.matrix_state((3, 5)).items()} == {
        "exp_avg": (3, 5), "exp_avg_sq": (3, 5), "L": (3, 3), "R": (5, 5), "Q_L": (3, 3), "Q_R": (5, 5)}
    assert rule.home_cost((64, 8), 1) > rule.home_cost((8, 64), 1) / 2  # both factors cost: cube of each side


@pytest.mark.parametrize("field, value, match", [
    ("fp16", True, "fp16=True with optimizer='soap'"),
    ("optimizer_cuda_graph", True, "optimizer_cuda_graph=True with optimizer='soap'"),
    ("exp_avg_dtype", "fp16", "exp_avg_dtype=torch.float16 with optimizer='soap'"),
    ("exp_avg_sq_dtype", "fp16", "exp_avg_sq_dtype=torch.float16 with optimizer='soap'"),
])
def test_soap_refuses_what_it_does_not_run_by_name(field, value, match):
    if value == "fp16":  # a precision-aware moment dtype
        config = mo.OptimizerConfig(lr=1e-3, optimizer="soap", use_precision_aware_optimizer=True,
                                    **{field: torch.float16})
    else:
        config = mo.OptimizerConfig(lr=1e-3, optimizer="soap", **{field: value})
    with pytest.raises(mo.UnsupportedConfigError, match=match):
        update_rule_from_config(config)


def test_soap_precision_aware_stores_the_moments_in_bf16_and_the_factors_in_fp32():
    config = mo.OptimizerConfig(lr=1e-3, optimizer="soap", use_precision_aware_optimizer=True,
                                exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    rule = update_rule_from_config(config)
    assert {n: d for n, (_, d) in rule.matrix_state((3, 5)).items()} == {
        "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "L": torch.float32, "R": torch.float32,
        "Q_L": torch.float32, "Q_R": torch.float32}
    plain = update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer="soap", exp_avg_dtype=torch.float32))
    assert all(d == torch.float32 for _, d in plain.matrix_state((3, 5)).values())


def test_soap_matrix_step_is_emerging_optimizers_soap():
    """megatron-core's SOAP (emerging-optimizers', configured as megatron-core does) and the rule's three parts, in
    fp32 on one matrix over several steps (first-step eigh, then QR): the same factors and eigenbases bitwise, the
    params within a few fp32 ulps of their change (emerging's inner Adam is torch.compile'd, whose lerp rounds
    differently from eager's: measured 4e-9 absolute at step 4)."""
    torch = pytest.importorskip("torch")
    soap_module = pytest.importorskip("emerging_optimizers.soap.soap")
    from megatron_opt.optimizer.rules.soap import SOAP

    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 7, generator=g)
    p = torch.nn.Parameter(w.clone())
    theirs = soap_module.SOAP([p], lr=0.01, betas=(0.9, 0.999), shampoo_beta=0.95, eps=1e-8, weight_decay=0.1,
                              use_kl_shampoo=True)
    rule, master = SOAP(), w.clone()
    state = rule.new_matrix_state((7, 7), torch.device("cpu"))
    for t in range(1, 6):
        grad = torch.randn(7, 7, generator=g)
        p.grad = grad.clone()
        theirs.step()
        update, state = rule.matrix_step(rule.direction(grad, torch.ones(()), {}), None, state, t)
        rule.finish(master, update, {}, 0.01, 0.1, None)
        change = float((p.detach() - w).abs().max())
        assert float((master - p.detach()).abs().max()) <= 1e-5 * change, f"step {t}"
        for name in ("L", "R"):
            assert torch.equal(state[name], theirs.state[p][name]), f"step {t} {name}"


def test_megatron_cores_soap_moves_by_o1_for_a_one_ulp_gradient_change():
    """The calibration of every SOAP comparison across roundings (docs/muon.md, "SOAP"): emerging-optimizers' SOAP
    as megatron-core configures it, on an 8 x 8 matrix with a full-rank gradient, moves its first update by O(1)
    when the gradient changes by one ulp: the gradient rotated into its own factors' eigenbases is diagonal, and
    Adam's normalisation lifts the off-diagonal rounding noise (~1e-7 of it, above eps=1e-8) to +-1. So the
    distributed tests feed exact gradients, and the real-loop figures differ after the first update."""
    torch = pytest.importorskip("torch")
    soap_module = pytest.importorskip("emerging_optimizers.soap.soap")

    def first_update(grad: torch.Tensor) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(8, 8))
        opt = soap_module.SOAP([p], lr=1.0, betas=(0.9, 0.999), weight_decay=0.0, use_kl_shampoo=True)
        p.grad = grad
        opt.step()
        return -p.detach()

    grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 1e-2
    a = first_update(grad.clone())
    b = first_update(torch.nextafter(grad, torch.full_like(grad, 1.0)))
    assert float((a - b).norm() / a.norm()) > 0.1
