"""The float64 SOAP reference (tests/support/reference_soap.py, from the formulas) calibrated against
emerging-optimizers 0.3.0's SOAP as megatron-core configures it (fp32, CPU), over five steps.

Where fp32 SOAP is a continuous function of its inputs, they agree: the Kronecker factors always (square matrices;
rectangular ones with plain Shampoo), the params when the gradients are small enough that fp32's rounding noise in
the rotated gradient stays far below eps (docs/muon.md, "SOAP": elsewhere Adam's normalisation lifts that noise to
+-1 and any two roundings differ by O(1) of an update). Measured: params 3.6e-5..3.9e-5 of their change (8 x 8,
gradients ~1e-7), factors <= 4.2e-7 of their norm; bounds 3e-4 and 5e-6.
"""
import pytest
import torch

from tests.support import reference_soap as rs

soap_module = pytest.importorskip("emerging_optimizers.soap.soap")
LR, BETAS, WD = 0.01, (0.9, 0.95), 0.1


def _run(shape, scale, use_kl_shampoo, shampoo_beta=0.95, steps=5):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    p = torch.nn.Parameter(w.clone())
    theirs = soap_module.SOAP([p], lr=LR, betas=BETAS, shampoo_beta=shampoo_beta, eps=1e-8, weight_decay=WD,
                              use_kl_shampoo=use_kl_shampoo)
    ref, state = w.double().clone(), rs.init_state(shape)
    out = []
    for _ in range(steps):
        grad = torch.randn(*shape, generator=g) * scale
        p.grad = grad.clone()
        theirs.step()
        rs.soap_step(ref, grad, state, lr=LR, beta1=BETAS[0], beta2=BETAS[1], shampoo_beta=shampoo_beta, eps=1e-8,
                     weight_decay=WD, use_kl_shampoo=use_kl_shampoo)
        param = float((p.detach().double() - ref).norm() / (ref - w.double()).norm())
        factors = max(float((theirs.state[p][k].double() - state[k]).norm() / state[k].norm()) for k in ("L", "R"))
        out.append((param, factors))
    return out


@pytest.mark.parametrize("use_kl_shampoo, shampoo_beta", [(True, 0.95), (False, 0.95), (False, 0.8)])
def test_reference_matches_megatron_cores_soap_where_it_is_continuous(use_kl_shampoo, shampoo_beta):
    for step, (param, factors) in enumerate(_run((8, 8), 1e-7, use_kl_shampoo, shampoo_beta)):
        assert param <= 3e-4, f"step {step}: params {param} of their change"
        assert factors <= 5e-6, f"step {step}: factors {factors} of their norm"


@pytest.mark.parametrize("shape", [(8, 8), (12, 6), (5, 9)])
def test_reference_factors_match_at_any_gradient_size(shape):
    """Plain Shampoo's factors do not depend on the eigenbases: they agree at unit gradients, any shape."""
    for step, (_, factors) in enumerate(_run(shape, 1.0, use_kl_shampoo=False)):
        assert factors <= 5e-6, f"{shape} step {step}: factors {factors} of their norm"
