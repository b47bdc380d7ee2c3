"""SOAP's float64 recomputation for verify mode (optimizer/rules/soap_float64.py), on one matrix: its bounds hold
for every correct fp32 step (KL-Shampoo and plain, square and rectangular matrices, so rank-deficient factors,
gradients of scales 1e-4..10 mixed within a step), and a stored state off by a little is found."""
import pytest
import torch

from megatron_opt.optimizer.rules.soap import SOAP

SHAPES = [(10, 10), (7, 13), (12, 10), (2, 30)]


def _gradient(shape, generator):
    parts = [torch.randn(shape, generator=generator) * 10.0 ** float(torch.randint(-4, 2, (), generator=generator))
             for _ in range(3)]
    return sum(parts) * torch.tensor(1 / 3)


def _steps(rule, shape, seed, steps=5):
    """(gradient, state before, state after (fp32, as computed), step, update) of ``steps`` fp32 steps; the state
    goes on as the leaf keeps it (16-bit moments rounded)."""
    g = torch.Generator().manual_seed(seed)
    state = rule.new_matrix_state(shape, torch.device("cpu"))
    for step in range(1, steps + 1):
        grad = _gradient(shape, g)
        update, new = rule.matrix_step(grad, None, state, step)
        yield grad, state, new, step, update
        state = {k: v.to(state[k].dtype, copy=True) for k, v in new.items()}


def _worst(checks):
    return {name: float(((got - want).abs() / tol).max()) for name, (got, want, tol) in checks.items()}


@pytest.mark.parametrize("use_kl_shampoo, shampoo_beta", [(True, 0.95), (False, 0.95), (True, 0.8)])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_bound_holds_for_correct_steps(shape, use_kl_shampoo, shampoo_beta):
    rule = SOAP(use_kl_shampoo=use_kl_shampoo, shampoo_beta=shampoo_beta)
    for seed in range(6):
        for grad, before, after, step, update in _steps(rule, shape, seed):
            want, bound, checks = rule.recompute_matrix_step(grad.double(), before, after, step)
            worst = _worst(checks)
            worst["D"] = float(((update.double() - want).abs() / bound).max())
            assert max(worst.values()) <= 1.0, f"seed {seed} step {step}: {worst}"


@pytest.mark.parametrize("name", ["L", "R", "Q_L", "Q_R", "exp_avg", "exp_avg_sq"])
def test_a_stored_state_off_by_a_little_is_found(name):
    """One element of the stored state, 1e-3 of that tensor's largest off, at the third step (after the first
    eigendecomposition, in the power-step regime), is found by some check. (A KL-Shampoo factor's own bound is loose
    while the other factor has noise eigenvalues; its error shows in its basis's QR structure check.)"""
    rule = SOAP()
    for grad, before, after, step, _ in _steps(rule, (7, 13), seed=3, steps=3):
        if step < 3:
            continue
        bad = {k: v.clone() for k, v in after.items()}
        bad[name][1, 2] += 1e-3 * float(bad[name].abs().max())
        _, _, checks = rule.recompute_matrix_step(grad.double(), before, bad, step)
        assert max(_worst(checks).values()) > 1.0, _worst(checks)
        _, _, clean = rule.recompute_matrix_step(grad.double(), before, after, step)
        assert max(_worst(clean).values()) <= 1.0


@pytest.mark.parametrize("shape", SHAPES)
def test_bounds_hold_with_bf16_moments(shape):
    """The precision-aware optimizer: exp_avg / exp_avg_sq stored in bf16 (rounded once, to nearest, by the commit;
    the update reads the unrounded fp32 moments), the bounds widened by the store's half ulp."""
    rule = SOAP(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for seed in range(4):
        for grad, before, after, step, update in _steps(rule, shape, seed):
            stored = {k: v.to(before[k].dtype) for k, v in after.items()}  # what the leaf's commit keeps
            assert stored["exp_avg"].dtype == torch.bfloat16 and stored["L"].dtype == torch.float32
            want, bound, checks = rule.recompute_matrix_step(grad.double(), before, stored, step)
            worst = _worst(checks)
            worst["D"] = float(((update.double() - want).abs() / bound).max())
            assert max(worst.values()) <= 1.0, f"seed {seed} step {step}: {worst}"
