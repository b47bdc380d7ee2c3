"""OptimizerParamScheduler: closed-form values, per-group overrides, checkpoints (megatron-core parity:
tests/mcore/test_megatron_core_scheduler.py)."""
from __future__ import annotations

import math
from typing import Any

import pytest

from megatron_opt.scheduler import OptimizerParamScheduler
from tests.support.common import FakeOptimizer

REL = 1e-12


# Shared schedule for the closed forms: lr warms up 0.1 -> 1.0 over 100 steps, then decays to 0.2
# over the 1000 steps from 100 to 1100; wd rises 0.01 -> 0.1 over 1000 steps.
BASE = dict(
    init_lr=0.1, max_lr=1.0, min_lr=0.2, lr_warmup_steps=100, lr_decay_steps=1100,
    lr_decay_style="linear", start_wd=0.01, end_wd=0.1, wd_incr_steps=1000, wd_incr_style="linear",
)


def make(*groups: dict[str, Any], cls: type = OptimizerParamScheduler, **kwargs: Any):
    opt = FakeOptimizer(*groups)
    return cls(opt, **{**BASE, **kwargs}), opt


def lr_at(sched: OptimizerParamScheduler, step: int, group: int = 0) -> float:
    """Move the clock to `step` (forwards only) and return the lr written onto `group`."""
    sched.step(step - sched.num_steps)
    return sched.optimizer.param_groups[group]["lr"]


def wd_at(sched: OptimizerParamScheduler, step: int, group: int = 0) -> float:
    sched.step(step - sched.num_steps)
    return sched.optimizer.param_groups[group]["weight_decay"]


# --------------------------------------------------------------------------------------- lr shape


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_linear_warmup_from_init_lr(style: str) -> None:
    sched, _ = make(lr_decay_style=style)
    assert lr_at(sched, 0) == pytest.approx(0.1, rel=REL)  # init_lr
    assert lr_at(sched, 50) == pytest.approx(0.55, rel=REL)  # 0.1 + (1.0 - 0.1) * 50/100
    assert lr_at(sched, 100) == pytest.approx(1.0, rel=REL)  # warmup end is inclusive: max_lr


def test_no_warmup_starts_at_max_lr() -> None:
    sched, _ = make(lr_warmup_steps=0, lr_decay_steps=1000)
    assert lr_at(sched, 0) == pytest.approx(1.0, rel=REL)
    assert lr_at(sched, 500) == pytest.approx(0.6, rel=REL)  # 0.2 + 0.8 * (1 - 500/1000)


def test_constant_ignores_decay_end() -> None:
    sched, _ = make(lr_decay_style="constant")
    assert lr_at(sched, 600) == 1.0
    assert lr_at(sched, 5000) == 1.0  # past lr_decay_steps, still max_lr (not min_lr)


def test_linear_decay() -> None:
    sched, _ = make(lr_decay_style="linear")
    assert lr_at(sched, 350) == pytest.approx(0.8, rel=REL)  # 0.2 + 0.8 * (1 - 250/1000)
    assert lr_at(sched, 600) == pytest.approx(0.6, rel=REL)  # 0.2 + 0.8 * (1 - 500/1000)
    assert lr_at(sched, 1100) == pytest.approx(0.2, rel=REL)
    assert lr_at(sched, 9999) == 0.2


def test_cosine_decay() -> None:
    sched, _ = make(lr_decay_style="cosine")
    # ratio 1/4: 0.2 + 0.8 * (1 + cos(pi/4)) / 2 = 0.2 + 0.2 * (2 + sqrt 2)
    assert lr_at(sched, 350) == pytest.approx(0.2 + 0.2 * (2 + math.sqrt(2)), rel=REL)
    assert lr_at(sched, 600) == pytest.approx(0.6, rel=REL)  # ratio 1/2: cos = 0, midpoint
    assert lr_at(sched, 1100) == pytest.approx(0.2, rel=REL)
    assert lr_at(sched, 1200) == 0.2


def test_inverse_square_root() -> None:
    sched, _ = make(lr_decay_style="inverse-square-root")
    assert lr_at(sched, 400) == pytest.approx(0.5, rel=REL)  # 1.0 * sqrt(100 / 400), from step 0
    # At lr_decay_steps it is still 1.0 * sqrt(100/1100) ~ 0.3015 > min_lr ...
    assert lr_at(sched, 1100) == pytest.approx(math.sqrt(1 / 11), rel=REL)
    assert lr_at(sched, 1101) == 0.2  # ... and one step later it drops straight to min_lr.


def test_inverse_square_root_is_floored_at_min_lr() -> None:
    sched, _ = make(lr_decay_style="inverse-square-root", min_lr=0.4)
    assert lr_at(sched, 900) == pytest.approx(0.4, rel=REL)  # sqrt(100/900) = 1/3 < 0.4


def test_inverse_square_root_without_warmup_uses_one() -> None:
    sched, _ = make(lr_decay_style="inverse-square-root", lr_warmup_steps=0, min_lr=0.0)
    assert lr_at(sched, 0) == 1.0  # max(step, 1) = 1 and max(warmup, 1) = 1
    assert lr_at(sched, 16) == pytest.approx(0.25, rel=REL)  # sqrt(1 / 16)


# WSD with lr_decay_steps 1100 and wsd_decay_steps 400: stable at max_lr until step 700, then
# anneals over [700, 1100]. Expected coefficient of (max_lr - min_lr) = 0.8 at anneal ratios 1/4, 1/2.
WSD_CASES = {
    "linear": (1 - 0.25, 1 - 0.5),
    "cosine": ((1 + math.cos(math.pi / 4)) / 2, 0.5),
    "exponential": (2 * 0.5**0.25 - 1, math.sqrt(2) - 1),  # 2 * 0.5**r - 1
    "minus_sqrt": (0.5, 1 - math.sqrt(0.5)),  # 1 - sqrt(r)
}


@pytest.mark.parametrize("wsd_style", sorted(WSD_CASES))
def test_wsd(wsd_style: str) -> None:
    sched, _ = make(lr_decay_style="WSD", wsd_decay_steps=400, lr_wsd_decay_style=wsd_style)
    quarter, half = WSD_CASES[wsd_style]
    assert lr_at(sched, 50) == pytest.approx(0.55, rel=REL)  # warmup as usual
    assert lr_at(sched, 400) == 1.0  # stable phase
    assert lr_at(sched, 700) == 1.0  # anneal start is still stable
    assert lr_at(sched, 800) == pytest.approx(0.2 + 0.8 * quarter, rel=REL)
    assert lr_at(sched, 900) == pytest.approx(0.2 + 0.8 * half, rel=REL)
    assert lr_at(sched, 1100) == pytest.approx(0.2, rel=REL)  # every style ends at coeff 0
    assert lr_at(sched, 1101) == 0.2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_lr=-0.1),
        dict(max_lr=0.1),  # below min_lr
        dict(init_lr=2.0),  # above max_lr
        dict(lr_decay_steps=0, lr_warmup_steps=0),
        dict(lr_warmup_steps=1100),  # warmup must end before decay does
        dict(start_wd=-0.1),
        dict(end_wd=0.001),  # below start_wd
        dict(lr_decay_style="step"),
        dict(wd_incr_style="exponential"),
        dict(lr_decay_style="WSD", lr_wsd_decay_style="linear"),  # no wsd_decay_steps
        dict(lr_decay_style="WSD", wsd_decay_steps=10, lr_wsd_decay_style="square"),
        dict(override_opt_param_scheduler=True),  # together with use_checkpoint (default True)
    ],
)
def test_invalid_configuration_raises(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make(**kwargs)


# -------------------------------------------------------------------------------------------- wd


def test_wd_linear() -> None:
    sched, _ = make(wd_incr_style="linear")
    assert wd_at(sched, 0) == pytest.approx(0.01, rel=REL)
    assert wd_at(sched, 250) == pytest.approx(0.0325, rel=REL)  # 0.01 + 0.09 * 1/4
    assert wd_at(sched, 1000) == pytest.approx(0.1, rel=REL)
    assert wd_at(sched, 5000) == 0.1


def test_wd_cosine() -> None:
    sched, _ = make(wd_incr_style="cosine")
    # coeff = (1 + cos(pi * (1 - r))) / 2 = (1 - cos(pi * r)) / 2; r = 1/4 -> (1 - sqrt(2)/2) / 2
    assert wd_at(sched, 250) == pytest.approx(0.01 + 0.09 * (1 - math.sqrt(2) / 2) / 2, rel=REL)
    assert wd_at(sched, 500) == pytest.approx(0.055, rel=REL)  # r = 1/2 -> halfway
    assert wd_at(sched, 1000) == pytest.approx(0.1, rel=REL)


def test_wd_constant_needs_equal_ends() -> None:
    sched, _ = make(wd_incr_style="constant", start_wd=0.05, end_wd=0.05)
    assert wd_at(sched, 0) == 0.05 and wd_at(sched, 2000) == 0.05
    with pytest.raises(ValueError, match="start_wd == end_wd"):
        make(wd_incr_style="constant")  # 0.01 != 0.1, checked when step(0) writes the group


def test_get_wd_without_group_uses_class_values() -> None:
    sched, _ = make({"start_wd": 0.5, "end_wd": 0.5})
    sched.step(500)
    assert sched.get_wd() == pytest.approx(0.055, rel=REL)


# ------------------------------------------------------------------------------ per-group values


def test_per_group_overrides() -> None:
    groups = [
        {},  # class values
        {"max_lr": 2.0, "min_lr": 0.5},
        {"wd_mult": 0.0},
        {"wd_mult": 0.5, "start_wd": 0.0, "end_wd": 1.0},
        {"lr_mult": 10.0},  # the schedule does not read lr_mult
    ]
    sched, opt = make(*groups)
    sched.step(50)  # warmup from the class init_lr to the group's max_lr
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == pytest.approx([0.55, 1.05, 0.55, 0.55, 0.55], rel=REL)  # 0.1 + (2 - 0.1) / 2
    sched.step(550)  # step 600: halfway through the linear decay
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == pytest.approx([0.6, 1.25, 0.6, 0.6, 0.6], rel=REL)  # 0.5 + 1.5 / 2 = 1.25
    wds = [g["weight_decay"] for g in opt.param_groups]
    # class wd at step 600: 0.01 + 0.09 * 0.6 = 0.064; group 3: 0.5 * (0 + 1.0 * 0.6) = 0.3
    assert wds == pytest.approx([0.064, 0.064, 0.0, 0.3, 0.064], rel=REL)
    sched.step(10_000)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.5, 0.2, 0.2, 0.2]


def test_step_writes_every_group_including_empty_ones() -> None:
    opt = FakeOptimizer({}, {"wd_mult": 0.0})
    assert all("params" in g and g["params"] == [] for g in opt.param_groups)
    OptimizerParamScheduler(opt, **BASE)
    assert all(g["lr"] == pytest.approx(0.1, rel=REL) for g in opt.param_groups)  # from step(0)
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.01, 0.0], rel=REL)


# --------------------------------------------------------------------------------- checkpointing

STATE_KEYS = {
    "max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
    "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps",
}


def test_state_dict_round_trip() -> None:
    src, src_opt = make({}, {"max_lr": 2.0}, lr_decay_style="cosine", wd_incr_style="cosine")
    src.step(321)
    sd = src.state_dict()
    assert set(sd) == STATE_KEYS and sd["num_steps"] == 321
    dst, dst_opt = make({}, {"max_lr": 2.0}, lr_decay_style="cosine", wd_incr_style="cosine")
    dst.load_state_dict(sd)
    assert dst.num_steps == 321
    assert dst.state_dict() == sd
    assert dst_opt.param_groups == src_opt.param_groups
    src.step(8)
    dst.step(8)
    assert dst_opt.param_groups == src_opt.param_groups


def test_load_into_an_advanced_scheduler_sets_the_clock() -> None:
    src, _ = make()
    src.step(300)
    dst, opt = make()
    dst.step(200)
    dst.load_state_dict(src.state_dict())
    assert dst.num_steps == 300  # restored, not 200 + 300
    assert opt.param_groups[0]["lr"] == pytest.approx(0.84, rel=REL)  # 0.2 + 0.8 * (1 - 200/1000)


MISMATCHES = {  # a checkpoint field and a constructor value that disagrees with BASE
    "max_lr": 2.0, "min_lr": 0.0, "lr_warmup_steps": 50, "lr_decay_steps": 2000,
    "lr_decay_style": "cosine", "start_wd": 0.0, "end_wd": 0.2, "wd_incr_steps": 500,
    "wd_incr_style": "cosine",
}


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_mismatch_raises_without_a_flag(field: str) -> None:
    src, _ = make()
    dst, _ = make(**{field: MISMATCHES[field]}, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=field):
        dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_mismatch_with_use_checkpoint_takes_the_checkpoint(field: str) -> None:
    src, src_opt = make()
    src.step(600)
    dst, dst_opt = make(**{field: MISMATCHES[field]}, use_checkpoint_opt_param_scheduler=True)
    dst.load_state_dict(src.state_dict())
    assert getattr(dst, field) == BASE[field]
    assert dst_opt.param_groups == src_opt.param_groups  # lr and wd written from restored values


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_mismatch_with_override_keeps_the_constructor_value(field: str) -> None:
    src, _ = make()
    src.step(600)
    kwargs = {field: MISMATCHES[field]}
    flags = dict(use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    dst, dst_opt = make(**kwargs, **flags)
    dst.load_state_dict(src.state_dict())
    assert getattr(dst, field) == MISMATCHES[field]
    assert dst.num_steps == 600  # the clock always comes from the checkpoint
    fresh, fresh_opt = make(**kwargs, **flags)
    fresh.step(600)
    assert dst_opt.param_groups == fresh_opt.param_groups


def test_load_legacy_keys_without_wd() -> None:
    legacy = {
        "start_lr": 1.0, "min_lr": 0.2, "warmup_iter": 100, "end_iter": 1100,
        "decay_style": "linear", "num_iters": 600,
    }
    sched, opt = make(use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(legacy)
    assert sched.num_steps == 600
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6, rel=REL)
    assert sched.start_wd == 0.01  # absent wd keys leave the class values alone


def test_load_rejects_an_invalid_restored_schedule() -> None:
    src, _ = make(lr_decay_style="WSD", wsd_decay_steps=100, lr_wsd_decay_style="linear")
    dst, _ = make()  # no wsd_decay_steps, so a restored 'WSD' style cannot work
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        dst.load_state_dict(src.state_dict())
