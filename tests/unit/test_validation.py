"""Range validation, as torch.optim does it: OptimizerConfig / DistributedDataParallelConfig at
construction, a rule's declared constants where the rule is built (update_rule_from_config), and the
optimizer's param groups (check_param_groups) once per step.

Every bad value must raise InvalidConfigError naming the field and the value; the valid boundary
values must be accepted.
"""
from __future__ import annotations

import math

import pytest
import torch

import megatron_opt as mo
from megatron_opt.config import DistributedDataParallelConfig, OptimizerConfig, config_fields
from megatron_opt.errors import InvalidConfigError, UnsupportedConfigError
from megatron_opt.optimizer.rules.registry import update_rule_from_config
from megatron_opt.optimizer.step.param_group_checks import check_param_groups

LR = 1e-3
NAN = math.nan
INF = math.inf

# (field, bad value, extra kwargs). The message must contain f"{field}={value!r}".
OPT_INVALID = [
    ("lr", -0.01, {}),
    ("lr", NAN, {}),
    ("lr", INF, {}),
    ("lr", -INF, {}),
    ("lr", "1e-3", {}),
    ("min_lr", -1e-5, {}),
    ("min_lr", NAN, {}),
    ("min_lr", 2e-3, {}),  # > lr
    ("decoupled_lr", -1e-4, {}),
    ("decoupled_lr", NAN, {}),
    ("decoupled_min_lr", -1e-6, {}),
    ("decoupled_min_lr", NAN, {}),
    ("decoupled_min_lr", 1e-3, {"decoupled_lr": 1e-4}),  # > decoupled_lr
    ("weight_decay", -0.1, {}),
    ("weight_decay", NAN, {}),
    ("weight_decay", INF, {}),
    ("clip_grad", -1.0, {}),
    ("clip_grad", NAN, {}),
    ("grad_norm_skip_threshold", -1.0, {}),
    ("grad_norm_skip_threshold", NAN, {}),
    ("grad_norm_skip_threshold", -INF, {}),
    ("loss_scale", 0.0, {}),
    ("loss_scale", -1.0, {}),
    ("loss_scale", INF, {}),
    ("loss_scale", NAN, {}),
    ("initial_loss_scale", INF, {"fp16": True}),
    ("initial_loss_scale", NAN, {"fp16": True}),
    ("initial_loss_scale", 0.0, {"fp16": True}),
    ("initial_loss_scale", -2.0**16, {"fp16": True}),
    ("min_loss_scale", 0.0, {}),
    ("min_loss_scale", -1.0, {}),
    ("min_loss_scale", NAN, {}),
    ("min_loss_scale", 2.0**33, {}),  # > initial_loss_scale (2**32)
    ("min_loss_scale", 8.0, {"initial_loss_scale": 4.0}),
    ("loss_scale_window", 0, {}),
    ("loss_scale_window", -1000, {}),
    ("loss_scale_window", 0.5, {}),  # int() would make it 0
    ("loss_scale_window", NAN, {}),
    ("loss_scale_window", INF, {}),
    ("hysteresis", 0, {}),
    ("hysteresis", -1, {}),
    ("hysteresis", 1.5, {}),
    ("hysteresis", NAN, {}),
    ("optimizer_offload_fraction", 1.5, {}),  # invalid, not merely unsupported
    ("optimizer_offload_fraction", -0.1, {}),
]

# Valid boundary (and ordinary) values: must construct and keep the value.
OPT_VALID = [
    ("lr", 0.0, {}),
    ("lr", 10.0, {}),
    ("min_lr", 0.0, {}),
    ("min_lr", LR, {}),  # == lr
    ("decoupled_lr", 0.0, {}),
    ("decoupled_min_lr", 0.0, {}),
    ("decoupled_min_lr", 1e-4, {"decoupled_lr": 1e-4}),
    ("decoupled_min_lr", 1e-2, {}),  # no decoupled_lr: no upper bound
    ("weight_decay", 0.0, {}),
    ("clip_grad", 0.0, {}),  # off
    ("clip_grad", INF, {}),  # never clips
    ("grad_norm_skip_threshold", 0.0, {}),
    ("grad_norm_skip_threshold", 1e6, {}),
    ("loss_scale", 1e-3, {}),
    ("loss_scale", 2.0**24, {"fp16": True}),
    ("initial_loss_scale", 1.0, {"fp16": True, "min_loss_scale": 1.0}),
    ("min_loss_scale", 2.0**32, {}),  # == initial_loss_scale
    ("min_loss_scale", 1e-4, {}),
    ("loss_scale_window", 1, {}),
    ("loss_scale_window", 1000.0, {}),
    ("hysteresis", 1, {}),
    ("hysteresis", 2.0, {}),
    ("optimizer_offload_fraction", 0.0, {}),
]


# A rule's constants are checked where the rule is built (update_rule_from_config), against its declaration:
# the config knows no rule (issue 38). (field, bad value, extra kwargs), as above.
RULE_INVALID = [(f, v, {"optimizer": opt}) for opt, cases in (
    ("adam", [("adam_beta1", 1.5), ("adam_beta1", 1.0), ("adam_beta1", -0.1), ("adam_beta1", NAN),
              ("adam_beta2", 1.0), ("adam_beta2", -0.5), ("adam_beta2", NAN),
              ("adam_eps", -1e-8), ("adam_eps", NAN), ("adam_eps", INF)]),
    ("sgd", [("sgd_momentum", 1.0), ("sgd_momentum", -0.1), ("sgd_momentum", NAN)]),
    ("lion", [("lion_beta1", 1.01), ("lion_beta1", -0.1), ("lion_beta1", NAN),
              ("lion_beta2", 1.5), ("lion_beta2", -1.0), ("lion_beta2", NAN)]),
    ("muon", [("muon_momentum", 1.0), ("muon_momentum", -0.5), ("muon_num_ns_steps", 0),
              ("muon_num_ns_steps", 2.5)]),
) for f, v in cases]

RULE_VALID = [(f, v, {"optimizer": opt}) for opt, cases in (
    ("adam", [("adam_beta1", 0.0), ("adam_beta1", 0.999999), ("adam_beta2", 0.0), ("adam_beta2", 0.999999),
              ("adam_eps", 0.0)]),
    ("sgd", [("sgd_momentum", 0.0)]),
    ("lion", [("lion_beta1", 0.0), ("lion_beta1", 1.0), ("lion_beta2", 0.0), ("lion_beta2", 1.0)]),
    ("muon", [("muon_momentum", 0.0), ("muon_num_ns_steps", 1)]),
) for f, v in cases]


def _id(case):
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("name, value, extra", OPT_INVALID, ids=[_id(c) for c in OPT_INVALID])
def test_optimizer_config_invalid_value_raises(name, value, extra):
    kwargs = {"lr": LR, **extra, name: value}
    with pytest.raises(InvalidConfigError) as ei:
        OptimizerConfig(**kwargs)
    msg = str(ei.value)
    assert f"OptimizerConfig.{name}={value!r}" in msg, msg
    assert "must be" in msg and ("[" in msg or "(" in msg), msg  # the valid range is stated


@pytest.mark.parametrize("name, value, extra", OPT_VALID, ids=[_id(c) for c in OPT_VALID])
def test_optimizer_config_boundary_value_accepted(name, value, extra):
    config = OptimizerConfig(**{"lr": LR, **extra, name: value})
    assert getattr(config, name) == value


@pytest.mark.parametrize("name, value, extra", RULE_INVALID, ids=[_id(c) for c in RULE_INVALID])
def test_rule_constant_invalid_value_raises_where_the_rule_is_built(name, value, extra):
    config = OptimizerConfig(**{"lr": LR, **extra, name: value})  # the config knows no rule
    with pytest.raises(InvalidConfigError) as ei:
        update_rule_from_config(config)
    msg = str(ei.value)
    assert f"OptimizerConfig.{name}={value!r}" in msg, msg
    assert "must be" in msg and ("[" in msg or "(" in msg), msg


@pytest.mark.parametrize("name, value, extra", RULE_VALID, ids=[_id(c) for c in RULE_VALID])
def test_rule_constant_boundary_value_accepted(name, value, extra):
    rule = update_rule_from_config(OptimizerConfig(**{"lr": LR, **extra, name: value}))
    assert value in rule.hyperparameters().values()


def test_a_rule_built_directly_checks_its_constants_too():
    with pytest.raises(InvalidConfigError, match=r"AdamW.beta2=1.0 is out of range: it must be in \[0, 1\)"):
        mo.AdamW(beta2=1.0)


def test_message_format_matches_torch_style():
    with pytest.raises(InvalidConfigError) as ei:
        update_rule_from_config(OptimizerConfig(lr=LR, adam_beta2=1.0))
    assert str(ei.value).startswith("OptimizerConfig.adam_beta2=1.0 is out of range: it must be in [0, 1)")
    with pytest.raises(InvalidConfigError, match=r"min_lr=0\.1 is out of range: it must be in \[0, lr=0\.001\]"):
        OptimizerConfig(lr=LR, min_lr=0.1)


def test_grad_norm_skip_threshold_inf_still_means_off():
    assert OptimizerConfig(lr=LR, grad_norm_skip_threshold=INF).grad_norm_skip_threshold is None
    assert OptimizerConfig(lr=LR, grad_norm_skip_threshold=None).grad_norm_skip_threshold is None


def test_lr_as_one_element_tensor_is_checked():
    OptimizerConfig(lr=torch.tensor(LR))
    with pytest.raises(InvalidConfigError, match="lr="):
        OptimizerConfig(lr=torch.tensor(-LR))


def test_invalid_reported_before_unsupported():
    # An out-of-range value is a bug in the caller even where the field is also unsupported.
    with pytest.raises(InvalidConfigError, match="clip_grad"):
        OptimizerConfig(lr=LR, clip_grad=-2.0, optimizer_cpu_offload=True)
    with pytest.raises(UnsupportedConfigError, match="optimizer_cpu_offload"):
        OptimizerConfig(lr=LR, optimizer_cpu_offload=True)
    # An inert field (the offload fraction without offload) is still range-checked.
    with pytest.raises(InvalidConfigError, match="optimizer_offload_fraction"):
        OptimizerConfig(lr=LR, optimizer_offload_fraction=2.0)


# --------------------------------------------------------------------------------------------------
# DistributedDataParallelConfig
# --------------------------------------------------------------------------------------------------

DDP_INVALID = [
    ("bucket_size", 0),
    ("bucket_size", -1),
    ("bucket_size", 1.5),
    ("bucket_size", NAN),
    ("bucket_size", INF),
    ("bucket_size", True),
    ("bucket_size", "40000000"),
    ("num_distributed_optimizer_instances", 0),
    ("num_distributed_optimizer_instances", -2),
    ("num_distributed_optimizer_instances", 1.5),
]
DDP_VALID = [
    ("bucket_size", None),
    ("bucket_size", 1),
    ("bucket_size", 40_000_000),
    ("bucket_size", 4e7),
    ("num_distributed_optimizer_instances", 1),
]


@pytest.mark.parametrize("name, value", DDP_INVALID, ids=[f"{n}={v!r}" for n, v in DDP_INVALID])
def test_ddp_config_invalid_value_raises(name, value):
    with pytest.raises(InvalidConfigError) as ei:
        DistributedDataParallelConfig(**{name: value})
    msg = str(ei.value)
    assert f"DistributedDataParallelConfig.{name}={value!r}" in msg, msg
    assert "must be" in msg, msg


@pytest.mark.parametrize("name, value", DDP_VALID, ids=[f"{n}={v!r}" for n, v in DDP_VALID])
def test_ddp_config_valid_value_accepted(name, value):
    assert getattr(DistributedDataParallelConfig(**{name: value}), name) == value


def test_ddp_valid_but_unsupported_stays_unsupported():
    with pytest.raises(UnsupportedConfigError, match="num_distributed_optimizer_instances"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)


# --------------------------------------------------------------------------------------------------
# The defaults construct (and pass the new checks); megatron-core's default instances:
# tests/mcore/test_megatron_core_configs.py
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("precision", [{}, {"fp16": True}, {"bf16": True}])
def test_defaults_construct_for_every_optimizer(optimizer, precision):
    """Every optimizer in every precision is accepted with every other field at its default, and
    construction changes no field but the ones chosen."""
    chosen = {"optimizer": optimizer, **precision}
    config, default = OptimizerConfig(lr=LR, **chosen), OptimizerConfig(lr=LR)
    changed = {name: getattr(config, name) for name in config_fields(OptimizerConfig)
               if getattr(config, name) != getattr(default, name)}
    assert changed == {name: value for name, value in chosen.items() if value != getattr(default, name)}


# --------------------------------------------------------------------------------------------------
# check_param_groups
# --------------------------------------------------------------------------------------------------


def _groups(**override):
    good = {"params": [], "lr": 1e-3, "weight_decay": 0.1, "max_lr": 1e-3, "min_lr": 1e-5,
            "lr_mult": 1.0, "wd_mult": 1.0}
    return [dict(good), {**good, "wd_mult": 0.0, "weight_decay": 0.0}, {**good, **override}]


GROUP_INVALID = [
    ("lr", NAN),
    ("lr", -1e-3),
    ("lr", INF),
    ("lr", -INF),
    ("lr", None),
    ("lr", "0.001"),
    ("weight_decay", -0.1),
    ("weight_decay", NAN),
    ("weight_decay", INF),
    ("max_lr", NAN),
    ("max_lr", -1.0),
    ("max_lr", INF),
    ("min_lr", -1e-6),
    ("min_lr", NAN),
    ("lr_mult", -2.0),
    ("lr_mult", INF),
    ("wd_mult", -1.0),
    ("wd_mult", NAN),
]


@pytest.mark.parametrize("key, value", GROUP_INVALID, ids=[f"{k}={v!r}" for k, v in GROUP_INVALID])
def test_check_param_groups_rejects(key, value):
    with pytest.raises(InvalidConfigError) as ei:
        check_param_groups(_groups(**{key: value}))
    msg = str(ei.value)
    assert f"param_groups[2][{key!r}]={value!r}" in msg, msg
    assert "[0, inf)" in msg
    assert "LR scheduler" in msg and "optimizer.param_groups" in msg


def test_check_param_groups_accepts_valid_and_boundary_values():
    check_param_groups(_groups())
    check_param_groups(_groups(lr=0.0, weight_decay=0.0, max_lr=0.0, min_lr=0.0, lr_mult=0.0, wd_mult=0.0))
    check_param_groups(_groups(lr=1, weight_decay=0))  # ints
    check_param_groups([{"params": [], "lr": 1e-3, "weight_decay": 0.0}])  # optional keys absent
    check_param_groups([{"lr": 1e-3, "weight_decay": 0.0, "min_lr": None}])  # optional key None = absent
    check_param_groups([{"lr": torch.tensor(1e-3), "weight_decay": 0.0}])  # tensor lr, as torch.optim allows
    check_param_groups([])


@pytest.mark.parametrize("missing", ["lr", "weight_decay"])
def test_check_param_groups_requires_lr_and_weight_decay(missing):
    group = {"lr": 1e-3, "weight_decay": 0.0}
    del group[missing]
    with pytest.raises(InvalidConfigError, match=rf"param_groups\[0\] has no '{missing}'"):
        check_param_groups([group])


def test_check_param_groups_tensor_lr_nan_rejected():
    with pytest.raises(InvalidConfigError, match=r"param_groups\[0\]\['lr'\]"):
        check_param_groups([{"lr": torch.tensor(NAN), "weight_decay": 0.0}])


def test_check_param_groups_after_scheduler_writes():
    """What the scheduler writes is valid; a user's negative min_lr override shows up as the group's lr."""
    from megatron_opt.scheduler import OptimizerParamScheduler

    class Opt:
        param_groups = _groups()

    opt = Opt()
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    for _ in range(12):
        sched.step(1)
        check_param_groups(opt.param_groups)
    opt.param_groups[1]["min_lr"] = -1e-3  # past lr_decay_steps the group's lr is its min_lr
    sched.step(1)
    with pytest.raises(InvalidConfigError, match=r"param_groups\[1\]\['lr'\]=-0\.001"):
        check_param_groups(opt.param_groups)


def test_a_bad_lr_written_into_param_groups_stops_the_step_before_any_change():
    from tests.support.common import TinyLM, build

    model = TinyLM()
    ddp, opt = build(model)
    ddp.zero_grad_buffer()
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.param_groups[0]["lr"] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidConfigError, match=r"param_groups\[0\]\['lr'\]=nan"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
