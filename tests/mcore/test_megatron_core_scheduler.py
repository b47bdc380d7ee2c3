"""megatron-core's OptimizerParamScheduler against ours: the same lr / wd histories for every decay and
wd style (and random schedules), the same state dict, each loading the other's checkpoint; and
megatron-core's scheduler driving megatron_opt's optimizer (moved from tests/unit, which runs without
megatron-core)."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_opt as mo
from megatron_opt.scheduler import OptimizerParamScheduler
from tests.support.common import FakeOptimizer, Probe, TinyLM, build, sgd_exact

# CI installs megatron-core: import it unconditionally so that a missing dependency fails loudly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", deprecations
    from megatron.core.optimizer_param_scheduler import (
        OptimizerParamScheduler as MCoreScheduler,
    )

REL = 1e-12

PARITY_GROUPS = [
    {"default_config": True},
    {"wd_mult": 0.0},
    {"max_lr": 3e-3, "min_lr": 1e-5},
    {"wd_mult": 0.5, "lr_mult": 4.0},
]
DECAY_STYLES = [
    ("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
    ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "exponential"), ("WSD", "minus_sqrt"),
]


def run_both(groups: list[dict[str, Any]], steps: int, increment: int, **kwargs: Any):
    """Drive megatron-core's scheduler and ours side by side; return both (lr, wd) histories."""
    histories = []
    for cls in (MCoreScheduler, OptimizerParamScheduler):
        opt = FakeOptimizer(*groups)
        sched = cls(opt, **kwargs)
        history = [[(g["lr"], g["weight_decay"]) for g in opt.param_groups]]
        for _ in range(steps):
            sched.step(increment)
            history.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        histories.append((sched, [x for row in history for pair in row for x in pair]))
    return histories


@pytest.mark.parametrize("wd_incr_style", ["linear", "cosine"])
@pytest.mark.parametrize("decay_style,wsd_style", DECAY_STYLES)
def test_parity_with_megatron_core(decay_style: str, wsd_style: str, wd_incr_style: str) -> None:
    # 100 steps of 8 samples = 800 samples: warmup to 96, decay ends at 720 (WSD anneals from 520),
    # wd reaches end_wd at 640, so every phase, including the tail past the decay, is visited.
    kwargs = dict(
        init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=96, lr_decay_steps=720,
        lr_decay_style=decay_style, start_wd=0.01, end_wd=0.1, wd_incr_steps=640,
        wd_incr_style=wd_incr_style, wsd_decay_steps=200, lr_wsd_decay_style=wsd_style,
    )
    (mcore, expected), (ours, got) = run_both(PARITY_GROUPS, 100, 8, **kwargs)
    assert len(set(expected)) > 8  # the schedule actually moves
    assert got == pytest.approx(expected, rel=REL, abs=0)
    assert ours.state_dict() == mcore.state_dict()


def test_parity_constant_wd_and_checkpoint_load() -> None:
    kwargs = dict(
        init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=96, lr_decay_steps=720,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=640,
        wd_incr_style="constant",
    )
    (mcore, expected), (ours, got) = run_both(PARITY_GROUPS, 100, 8, **kwargs)
    assert got == pytest.approx(expected, rel=REL, abs=0)
    sd = mcore.state_dict()
    fresh_ours = OptimizerParamScheduler(FakeOptimizer(*PARITY_GROUPS), **kwargs)
    fresh_mcore = MCoreScheduler(FakeOptimizer(*PARITY_GROUPS), **kwargs)
    fresh_ours.load_state_dict(sd)
    fresh_mcore.load_state_dict(sd)
    assert fresh_ours.optimizer.param_groups == fresh_mcore.optimizer.param_groups


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, Any]:
    min_lr = draw(st.floats(0.0, 1e-3))
    max_lr = draw(st.floats(min_lr, 1e-2))
    decay_steps = draw(st.integers(1, 2000))
    style = draw(st.sampled_from(DECAY_STYLES))
    start_wd = draw(st.floats(0.0, 0.1))
    return dict(
        init_lr=draw(st.floats(0.0, max_lr)), max_lr=max_lr, min_lr=min_lr,
        lr_warmup_steps=draw(st.integers(0, decay_steps - 1)), lr_decay_steps=decay_steps,
        lr_decay_style=style[0], lr_wsd_decay_style=style[1],
        wsd_decay_steps=draw(st.integers(1, decay_steps)),
        start_wd=start_wd, end_wd=draw(st.floats(start_wd, 0.2)),
        wd_incr_steps=draw(st.integers(1, 2000)),
        wd_incr_style=draw(st.sampled_from(["linear", "cosine"])),
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(kwargs=schedules(), increment=st.integers(1, 64))
def test_parity_random_schedules(kwargs: dict[str, Any], increment: int) -> None:
    groups = [{}, {"wd_mult": 0.0}, {"max_lr": kwargs["max_lr"] * 2, "min_lr": kwargs["min_lr"] / 2}]
    (_, expected), (_, got) = run_both(groups, 60, increment, **kwargs)
    assert got == pytest.approx(expected, rel=REL, abs=0)


# ----------------------------------------------------------------------- megatron-core's scheduler drives ours
KW = dict(init_lr=1e-4, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=80, lr_decay_steps=800, lr_decay_style="cosine",
          start_wd=0.01, end_wd=0.1, wd_incr_steps=800, wd_incr_style="linear")


def test_megatron_core_scheduler_drives_our_param_groups():
    model = TinyLM()
    _, opt = build(model, lr=1e-2, min_lr=1e-3, weight_decay=0.1)
    twin_groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    twin = type("Twin", (), {"param_groups": [dict(g, params=[]) for g in twin_groups]})()
    ours, core = mo.OptimizerParamScheduler(twin, **KW), MCoreScheduler(opt, **KW)
    assert any(g["wd_mult"] == 0.0 for g in opt.param_groups) and any(g["wd_mult"] == 1.0 for g in opt.param_groups)
    for _ in range(100):
        ours.step(increment=8)
        core.step(increment=8)
        for a, b in zip(opt.param_groups, twin.param_groups):
            assert a["lr"] == b["lr"] and a["weight_decay"] == b["weight_decay"]


def test_optimizer_applies_the_scheduled_lr():
    """SGD, lr set by megatron-core's scheduler: the update is exactly -lr * gradient."""
    model = Probe(numel=300)
    ddp, opt = build(model, **sgd_exact())
    core = MCoreScheduler(opt, **{**KW, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant"})
    for step in range(3):
        core.step(increment=8)
        lr = opt.param_groups[0]["lr"]
        before = model.w.detach().clone()
        res = mo.train_step(ddp, opt, None, [(2.0, 1)], lambda m, b: (m(b[0]) * b[1], b[1]))
        assert res.success and res.lr == lr
        torch.testing.assert_close(before - model.w.detach(), torch.full_like(before, 2.0 * lr), rtol=1e-6, atol=0)
