"""Loss scalers: Megatron-LM's DynamicGradScaler / ConstantGradScaler semantics (reference notes, section 3).
Parity with megatron-core's own scaler: tests/mcore/test_megatron_core_grad_scaler.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_opt.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from tests.support.common import scale_of, trackers

SETTINGS = settings(max_examples=200, deadline=None)


def dyn(initial=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=4, hysteresis=1):
    return DynamicGradScaler(
        initial_scale=initial,
        min_scale=min_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )


# --------------------------------------------------------------------------------------------------
# Trajectories
# --------------------------------------------------------------------------------------------------


def test_growth_once_per_interval():
    s = dyn(growth_interval=4, hysteresis=1)
    expected = [2**16, 2**16, 2**16, 2**17, 2**17, 2**17, 2**17, 2**18]
    for step, want in enumerate(expected):
        s.update(False)
        assert scale_of(s) == want, f"after {step + 1} clean updates"
    # exactly 2**18 after 8 clean updates (a double update per step would give 2**20)
    assert scale_of(s) == 2.0**18
    assert trackers(s) == (0, 1)


def test_growth_tracker_counts_up():
    s = dyn(growth_interval=4)
    for i in range(1, 4):
        s.update(False)
        assert trackers(s)[0] == i
    s.update(False)
    assert trackers(s)[0] == 0


def test_hysteresis_two_first_inf_keeps_second_halves():
    s = dyn(hysteresis=2)
    s.update(True)
    assert scale_of(s) == 2.0**16
    assert trackers(s) == (0, 1)
    s.update(True)
    assert scale_of(s) == 2.0**15
    assert trackers(s) == (0, 0)
    # once the budget is used up, every later inf backs off until the next growth
    s.update(True)
    assert scale_of(s) == 2.0**14
    s.update(True)
    assert scale_of(s) == 2.0**13


def test_non_consecutive_infs_count_toward_hysteresis():
    s = dyn(growth_interval=4, hysteresis=2)
    s.update(True)
    for _ in range(3):  # fewer than growth_interval: no growth, hysteresis not restored
        s.update(False)
    assert scale_of(s) == 2.0**16
    assert trackers(s) == (3, 1)
    s.update(True)
    assert scale_of(s) == 2.0**15


def test_inf_resets_growth_tracker():
    s = dyn(growth_interval=4, hysteresis=10)
    for _ in range(3):
        s.update(False)
    s.update(True)  # within hysteresis: no backoff, but the clean streak restarts
    assert scale_of(s) == 2.0**16
    for _ in range(3):
        s.update(False)
    assert scale_of(s) == 2.0**16
    s.update(False)
    assert scale_of(s) == 2.0**17


def test_min_scale_clamps():
    s = dyn(initial=8.0, min_scale=2.0, hysteresis=1)
    s.update(True)
    assert scale_of(s) == 4.0
    s.update(True)
    assert scale_of(s) == 2.0
    s.update(True)
    assert scale_of(s) == 2.0
    # the clamp applies to a backoff that would overshoot min_scale, not only to repeated ones
    t = dyn(initial=3.0, min_scale=2.0, hysteresis=1)
    t.update(True)
    assert scale_of(t) == 2.0
    u = dyn(initial=1.0, min_scale=1.0, backoff_factor=0.25, hysteresis=1)
    for _ in range(5):
        u.update(True)
        assert scale_of(u) == 1.0


def test_growth_restores_hysteresis():
    s = dyn(growth_interval=4, hysteresis=2)
    s.update(True)
    s.update(True)
    assert scale_of(s) == 2.0**15
    assert trackers(s) == (0, 0)
    for _ in range(4):
        s.update(False)
    assert scale_of(s) == 2.0**16
    assert trackers(s) == (0, 2)
    s.update(True)  # budget restored: no backoff on the first inf after growth
    assert scale_of(s) == 2.0**16
    s.update(True)
    assert scale_of(s) == 2.0**15


def test_no_upper_cap():
    s = dyn(initial=2.0**100, growth_interval=1)
    for _ in range(20):
        s.update(False)
    assert scale_of(s) == 2.0**120


def test_non_power_of_two_factors():
    s = dyn(initial=1000.0, min_scale=1.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2, hysteresis=1)
    s.update(False)
    s.update(False)
    assert scale_of(s) == 3000.0
    s.update(True)
    assert scale_of(s) == 750.0


def test_found_inf_as_tensor():
    s = dyn(hysteresis=1)
    s.update(torch.tensor(True))
    assert scale_of(s) == 2.0**15
    s.update(torch.tensor([1.0]))
    assert scale_of(s) == 2.0**14
    s.update(torch.tensor(False))
    s.update(torch.tensor([0.0]))
    assert scale_of(s) == 2.0**14
    assert trackers(s)[0] == 2


def test_scale_is_one_element_fp32():
    s = dyn()
    for _ in range(5):
        t = s.scale
        assert t.dtype == torch.float32 and t.shape == (1,)
        s.update(False)


# --------------------------------------------------------------------------------------------------
# inv_scale
# --------------------------------------------------------------------------------------------------


def test_inv_scale():
    s = dyn(initial=2.0**16)
    inv = s.inv_scale
    assert inv.dtype == torch.float32 and inv.shape == (1,)
    assert inv.item() == 2.0**-16
    for _ in range(4):
        s.update(False)
    assert s.inv_scale.item() == 2.0**-17  # recomputed on each access
    c = ConstantGradScaler(3.0)
    want = torch.tensor([1.0 / 3.0], dtype=torch.float64).float()
    assert torch.equal(c.inv_scale, want)
    assert torch.equal(c.inv_scale, torch.tensor([3.0]).double().reciprocal().float())


# --------------------------------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------------------------------


def test_state_dict_keys_and_values():
    s = dyn(hysteresis=3, growth_interval=5)
    s.update(True)
    s.update(False)
    s.update(False)
    sd = s.state_dict()
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}
    assert sd["growth_tracker"] == 2
    assert sd["hysteresis_tracker"] == 2
    assert torch.equal(sd["scale"], torch.tensor([2.0**16]))


def test_state_dict_is_a_snapshot():
    s = dyn(hysteresis=1)
    sd = s.state_dict()
    s.update(True)
    assert sd["scale"].item() == 2.0**16
    assert scale_of(s) == 2.0**15


flags = st.lists(st.booleans(), min_size=0, max_size=60)


@SETTINGS
@given(before=flags, after=flags, hysteresis=st.integers(1, 4), interval=st.integers(1, 6))
def test_state_dict_round_trip_restores_trajectory(before, after, hysteresis, interval):
    a = dyn(initial=2.0**20, min_scale=2.0**10, growth_interval=interval, hysteresis=hysteresis)
    for f in before:
        a.update(f)
    sd = a.state_dict()
    # a fresh scaler with different starting state picks up exactly where `a` was
    b = dyn(initial=2.0**12, min_scale=2.0**10, growth_interval=interval, hysteresis=hysteresis)
    b.update(True)
    b.update(False)
    b.load_state_dict(sd)
    assert scale_of(b) == scale_of(a)
    assert trackers(b) == trackers(a)
    for f in after:
        a.update(f)
        b.update(f)
        assert scale_of(b) == scale_of(a)
        assert trackers(b) == trackers(a)


def test_load_state_dict_sets_scale_and_trackers():
    s = dyn()
    s.load_state_dict({"scale": torch.tensor([512.0]), "growth_tracker": 3, "hysteresis_tracker": 1})
    assert s.scale.shape == (1,) and s.scale.dtype == torch.float32
    assert scale_of(s) == 512.0
    assert trackers(s) == (3, 1)
    s.update(False)  # the loaded growth tracker counts: 4 == interval
    assert scale_of(s) == 1024.0


# --------------------------------------------------------------------------------------------------
# Constructor validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(initial=0.0),
        dict(initial=-1.0, min_scale=-2.0),
        dict(min_scale=0.0),
        dict(min_scale=-1.0),
        dict(initial=4.0, min_scale=8.0),
        dict(growth_factor=1.0),
        dict(growth_factor=0.5),
        dict(backoff_factor=0.0),
        dict(backoff_factor=1.0),
        dict(backoff_factor=1.5),
        dict(backoff_factor=-0.5),
        dict(growth_interval=0),
        dict(growth_interval=-1),
        dict(hysteresis=0),
        dict(hysteresis=-2),
    ],
)
def test_dynamic_invalid_args_raise(kw):
    with pytest.raises(ValueError):
        dyn(**kw)


def test_dynamic_boundary_args_accepted():
    s = dyn(initial=4.0, min_scale=4.0)  # min_scale == initial_scale is allowed
    s.update(True)
    assert scale_of(s) == 4.0


@pytest.mark.parametrize("initial", [0.0, -1.0])
def test_constant_invalid_scale_raises(initial):
    with pytest.raises(ValueError):
        ConstantGradScaler(initial)


# --------------------------------------------------------------------------------------------------
# ConstantGradScaler
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(ops=st.lists(st.booleans(), max_size=50), initial=st.floats(1e-3, 1e9))
def test_constant_never_changes(ops, initial):
    c = ConstantGradScaler(initial)
    want = torch.tensor([initial], dtype=torch.float32)
    for f in ops:
        c.update(f)
        assert torch.equal(c.scale, want)
    assert c.state_dict() == {}
    c.load_state_dict({})
    assert torch.equal(c.scale, want)
    assert torch.equal(c.inv_scale, want.double().reciprocal().float())
