"""Verify mode without processes: its config fields, the error type, the float64 recomputations and
their tolerances (against torch.optim in float64, and against the fp32 ops they bound), the
custom-rule requirement and the replica checksums (a converted megatron-core config keeps verify mode
off: tests/mcore/test_megatron_core_configs.py)."""
from __future__ import annotations

import pytest
import torch

import megatron_opt as mo
import megatron_opt.errors
from megatron_opt import ops
from megatron_opt.ops.piece_table import full_table
from megatron_opt.optimizer.verify import float64_update as f64
from megatron_opt.optimizer.verify.float64_update import Float64Inputs
from megatron_opt.optimizer.rules import sgd as sgd_rule
from megatron_opt.optimizer.verify.replica_check import Checksums
from megatron_opt.optimizer.verify.step_verifier import recompute_of
from tests.support.common import ReferenceLion


# ---------------------------------------------------------------------------------------------- config
def test_defaults_are_off_and_raise():
    cfg = mo.OptimizerConfig(lr=1e-3)
    assert (cfg.verify_interval, cfg.verify_action) == (0, "raise")
    assert (mo.OptimizerConfig(lr=1e-3, verify_interval=100, verify_action="warn").verify_interval) == 100


@pytest.mark.parametrize("kwargs, match", [
    (dict(verify_interval=-1), "verify_interval=-1 is out of range"),
    (dict(verify_interval=2.5), "verify_interval=2.5 is out of range"),
    (dict(verify_interval=True), "verify_interval=True is out of range"),
    (dict(verify_interval="10"), "verify_interval='10' is not a number"),
    (dict(verify_interval=float("nan")), "verify_interval=nan"),
    (dict(verify_action="ignore"), "verify_action='ignore' is not one of 'raise', 'warn'"),
    (dict(verify_action=None), "verify_action=None"),
])
def test_invalid_values_raise(kwargs, match):
    with pytest.raises(mo.InvalidConfigError, match=match):
        mo.OptimizerConfig(lr=1e-3, **kwargs)


def test_verification_error_is_the_packages_error():
    assert mo.VerificationError is megatron_opt.errors.VerificationError
    assert issubclass(mo.VerificationError, mo.MegatronOptError)
    assert not issubclass(mo.VerificationError, mo.RankError)
    for error in (mo.ConfigError, mo.StepOrderError, mo.RankError, mo.CheckpointError):
        assert issubclass(error, mo.MegatronOptError)


# ---------------------------------------------------------------------------------------------- formulas
def _inputs(n: int = 4000, seed: int = 0, state=("exp_avg", "exp_avg_sq"), lr=1e-2, wd=0.1, step=3):
    g = torch.Generator().manual_seed(seed)
    state_values = {name: (torch.randn(n, generator=g, dtype=torch.float64) * 1e-2).abs()
                    if name == "exp_avg_sq" else torch.randn(n, generator=g, dtype=torch.float64) * 1e-1
                    for name in state}
    return Float64Inputs(master=torch.randn(n, generator=g, dtype=torch.float64),
                         grad=torch.randn(n, generator=g, dtype=torch.float64), state=state_values, lr=lr,
                         weight_decay=wd, step=step)


def _torch_step(opt_cls, inp: Float64Inputs, state_names: dict, **kwargs):
    """One step of a torch optimizer in float64 from the same state: (new master, new state)."""
    w = torch.nn.Parameter(inp.master.clone())
    opt = opt_cls([w], lr=inp.lr, weight_decay=inp.weight_decay, **kwargs)
    w.grad = inp.grad.clone()
    if state_names:
        opt.state[w].update({theirs: inp.state[ours].clone() for ours, theirs in state_names.items()})
        if "step" in state_names.values() or opt_cls is torch.optim.AdamW:
            opt.state[w]["step"] = torch.tensor(float(inp.step - 1), dtype=torch.float64)
    opt.step()
    return w.detach(), {ours: opt.state[w][theirs] for ours, theirs in state_names.items()}


def test_adamw_recompute_equals_torch_adamw_in_float64():
    inp = _inputs()
    out = mo.AdamW(beta1=0.9, beta2=0.95, eps=1e-8).float64_update(inp)
    w, state = _torch_step(torch.optim.AdamW, inp, {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
                           betas=(0.9, 0.95), eps=1e-8)
    torch.testing.assert_close(out.values["master"], w, rtol=1e-13, atol=1e-15)
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(out.values[name], state[name], rtol=1e-13, atol=1e-18)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_recompute_equals_torch_sgd_in_float64(nesterov):
    inp = _inputs(state=("momentum_buffer",))
    out = mo.SGD(momentum=0.9, nesterov=nesterov).float64_update(inp)
    w, state = _torch_step(torch.optim.SGD, inp, {"momentum_buffer": "momentum_buffer"}, momentum=0.9,
                           nesterov=nesterov)
    torch.testing.assert_close(out.values["master"], w, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(out.values["momentum_buffer"], state["momentum_buffer"], rtol=1e-13, atol=1e-15)


def test_lion_recompute_equals_the_reference_lion():
    inp = _inputs(state=("exp_avg",))
    out = mo.Lion(beta1=0.9, beta2=0.99).float64_update(inp)
    w = torch.nn.Parameter(inp.master.clone())
    opt = ReferenceLion([w], lr=inp.lr, betas=(0.9, 0.99), weight_decay=inp.weight_decay)
    opt.state[w]["exp_avg"] = inp.state["exp_avg"].clone()
    w.grad = inp.grad.clone()
    opt.step()
    torch.testing.assert_close(out.values["master"], w.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(out.values["exp_avg"], opt.state[w]["exp_avg"], rtol=1e-13, atol=1e-15)


# (rule, the single-shard op, state names): the fp32 op lies within the bound, which is tight enough
# that a change of a few parts in a million of any element is caught.
def _run_op(rule, inp: Float64Inputs, raw_grad: torch.Tensor, grad_scale: float, backend: str) -> dict:
    """The fp32 op on ``inp``'s (fp32-representable) masters and state, with ``raw_grad * grad_scale``."""
    n = inp.master.numel()
    master = inp.master.float()
    state = {k: v.float() for k, v in inp.state.items()}
    plan = ops.StepPlan((ops.ShardOperands(full_table(n), raw_grad, master,
                                           tuple(state[k] for k in rule.state_dtypes())),))
    rule.apply(plan, lr_wd=ops.lr_wd_table([inp.lr], [inp.weight_decay], master.device),
               grad_scale=torch.tensor([grad_scale]), step=torch.tensor([inp.step]), backend=backend)
    return {"master": master, **state}


# The fp32 ops lie within the bound, and the bound is tight: a few parts in a million of a typical
# element (so a fault of that size is caught).
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("rule, state", [
    (mo.AdamW(), ("exp_avg", "exp_avg_sq")), (mo.AdamW(beta2=0.95), ("exp_avg", "exp_avg_sq")),
    (mo.SGD(momentum=0.9), ("momentum_buffer",)), (mo.SGD(momentum=0.9, nesterov=True), ("momentum_buffer",)),
    (mo.Lion(), ("exp_avg",)),
])
def test_fp32_ops_lie_within_the_bound_and_the_bound_is_tight(backend, rule, state):
    grad_scale = float(torch.tensor(1 / 3, dtype=torch.float32))  # a multiplier whose product rounds
    for step in (1, 7):
        drawn = _inputs(n=20000, seed=step, state=state, step=step)
        raw_grad = drawn.grad.float()
        inp = Float64Inputs(master=drawn.master.float().double(), grad=raw_grad.double() * grad_scale,
                            state={k: v.float().double() for k, v in drawn.state.items()}, lr=drawn.lr,
                            weight_decay=drawn.weight_decay, step=step)
        want = rule.float64_update(inp)
        got = _run_op(rule, inp, raw_grad, grad_scale, backend)
        for name, values in got.items():
            err = (values.double() - want.values[name]).abs()
            tol = want.tolerance[name]
            assert bool((err <= tol).all()), f"{name}: error {float((err / tol).max()):.3g} x the bound"
            if not isinstance(rule, mo.Lion) or name != "master":  # Lion's master bound has 2 lr near c = 0
                rel = tol / want.values[name].abs().clamp_min(1e-30)
                assert float(rel.median()) < 2e-5, f"{name}: the bound is loose ({float(rel.median()):.3g} relative)"


def test_bounds_come_from_the_terms_not_the_result():
    """m' = b1 m + (1-b1) g cancels to 0, yet the bound keeps the rounding of both terms."""
    inp = Float64Inputs(master=torch.ones(1, dtype=torch.float64), grad=torch.tensor([-9.0], dtype=torch.float64),
                        state={"exp_avg": torch.ones(1, dtype=torch.float64),
                               "exp_avg_sq": torch.ones(1, dtype=torch.float64)}, lr=1e-3, weight_decay=0.0, step=5)
    out = mo.AdamW(beta1=0.9).float64_update(inp)
    assert float(out.values["exp_avg"].abs()) < 1e-15
    assert float(out.tolerance["exp_avg"]) >= f64.SLACK * f64.FP32_UNIT * 1.7


# ---------------------------------------------------------------------------------------------- custom rules
class _NoRecompute(mo.UpdateRule):
    name = "no-recompute"

    def state_dtypes(self):
        return {}

    def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None):
        pass


class _WithRecompute(_NoRecompute):
    def float64_update(self, inputs):
        return sgd_rule.recompute(inputs, 0.0, False)


class _AdamWWithOwnApply(mo.AdamW):
    def apply(self, plan, **kwargs):
        super().apply(plan, **kwargs)


def test_a_rule_needs_its_own_recompute():
    for rule in (_NoRecompute(), _AdamWWithOwnApply()):
        with pytest.raises(mo.UnsupportedConfigError, match="float64_update"):
            recompute_of(rule)
    assert recompute_of(_WithRecompute()).__func__ is _WithRecompute.float64_update
    for rule in (mo.AdamW(), mo.SGD(), mo.Lion()):
        assert recompute_of(rule).__func__ is type(rule).float64_update


# ---------------------------------------------------------------------------------------------- checksums
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksums_see_a_changed_bit_and_a_swap(dtype):
    sums = Checksums()
    t = torch.randn(3_000_000, generator=torch.Generator().manual_seed(1)).to(dtype)  # several chunks
    base = sums.of_param(t)
    assert torch.equal(base, sums.of_param(t.clone()))
    flipped = t.clone()
    flipped.view(torch.int16 if dtype != torch.float32 else torch.int32)[2_500_000] ^= 1  # the lowest bit
    assert not torch.equal(base, sums.of_param(flipped))
    swapped = t.clone()
    swapped[[10, 1_500_000]] = t[[1_500_000, 10]]
    assert not torch.equal(base, sums.of_param(swapped))
    signed_zero = torch.zeros(8, dtype=dtype)
    negative = signed_zero.clone()
    negative[3] = -0.0
    assert not torch.equal(sums.of_param(signed_zero), sums.of_param(negative))
