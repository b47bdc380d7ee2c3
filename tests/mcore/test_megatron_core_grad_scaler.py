"""megatron-core's own DynamicGradScaler against ours, run on CPU: the same scale and trackers after
every update, for any sequence of overflow flags and settings (moved from tests/unit, which runs
without megatron-core)."""
from __future__ import annotations

import warnings
from types import SimpleNamespace
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_opt.optimizer.grad_scaler import DynamicGradScaler
from tests.support.common import scale_of, trackers

# CI installs megatron-core: import it unconditionally so that a missing dependency fails loudly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.optimizer.grad_scaler as mcore_gs

SETTINGS = settings(max_examples=200, deadline=None)



def _reference(tracker_ops: list[bool], **kw) -> list[tuple[float, int, int]]:
    """megatron-core's scaler hard-codes device='cuda'; run it on CPU by swapping its torch for a shim."""

    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)

    shim = SimpleNamespace(tensor=tensor, max=torch.max, float=torch.float)
    with mock.patch.object(mcore_gs, "torch", shim):
        ref = mcore_gs.DynamicGradScaler(**kw)
        out = []
        for f in tracker_ops:
            ref.update(f)
            sd = ref.state_dict()
            out.append((sd["scale"].item(), sd["growth_tracker"], sd["hysteresis_tracker"]))
    return out


@SETTINGS
@given(
    ops=st.lists(st.booleans(), min_size=1, max_size=80),
    initial_exp=st.integers(0, 24),
    min_exp=st.integers(-4, 0),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5, 3.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75, 0.1]),
    growth_interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
)
def test_matches_megatron_core(ops, initial_exp, min_exp, growth_factor, backoff_factor, growth_interval, hysteresis):
    kw = dict(
        initial_scale=2.0**initial_exp,
        min_scale=2.0 ** (initial_exp + min_exp),
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    want = _reference(ops, **kw)
    s = DynamicGradScaler(**kw)
    for step, (f, (ref_scale, ref_growth, ref_hyst)) in enumerate(zip(ops, want)):
        s.update(f)
        assert scale_of(s) == ref_scale, f"step {step}"
        assert trackers(s) == (ref_growth, ref_hyst), f"step {step}"
