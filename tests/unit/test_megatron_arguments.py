"""megatron_opt.megatron.arguments on its own, as a library user calls it (no script, no megatron-core):
Megatron-LM's defaults and required flags, defaults that yield to the flags ruling them out, caller
defaults and aliases, one error for the flags megatron_opt does not implement, the mapping to
megatron_opt's configs and schedule, and imports without megatron-core."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import megatron_opt as mo
from megatron_opt.megatron import arguments as megatron_args

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3"]


def _parse(flags: list[str], world_size: int = 1, **kwargs) -> argparse.Namespace:
    return megatron_args.parse_megatron_args([*MODEL, *flags], world_size=world_size, **kwargs)


def _error(capsys, flags: list[str], **kwargs) -> str:
    with pytest.raises(SystemExit) as exc:
        megatron_args.parse_megatron_args(flags, world_size=1, **kwargs)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_megatron_defaults():
    args = _parse(["--train-iters", "10"])
    assert (args.log_interval, args.lr_warmup_iters, args.weight_decay, args.adam_beta2, args.seed) == (
        100, 0, 0.01, 0.999, 1234)
    assert (args.global_batch_size, args.num_microbatches, args.data_parallel_size, args.loss_mode) == (2, 1, 1, "mean")
    assert megatron_args.scheduler_kwargs_from_args(args)["lr_warmup_steps"] == 0


def test_required_flags_are_named(capsys):
    err = _error(capsys, ["--train-iters", "10"])
    assert ("--lr --micro-batch-size --seq-length --hidden-size --num-layers --num-attention-heads: required "
            "(Megatron-LM has no default)") in err, err
    assert "give --train-iters or --train-samples" in _error(capsys, MODEL)


def test_run_length_default_yields_to_train_samples():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    megatron_args.add_megatron_args(parser, defaults={"train_iters": 7, "lr_warmup_iters": 2})
    args = megatron_args.parse_megatron_args([*MODEL], parser=parser, world_size=1)
    assert (args.train_iters, args.lr_warmup_iters) == (7, 2)
    args = megatron_args.parse_megatron_args([*MODEL, "--train-samples", "20"], parser=parser, world_size=1)
    assert (args.train_iters, args.lr_warmup_iters) == (10, None)  # 20 samples / global batch 2
    args = megatron_args.parse_megatron_args([*MODEL, "--lr-warmup-fraction", "0.1"], parser=parser, world_size=1)
    assert (args.train_iters, args.lr_warmup_iters) == (7, None)


def test_callable_default_scales_with_the_run_length():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    megatron_args.add_megatron_args(parser, defaults={"train_iters": 30,
                                                      "lr_warmup_iters": lambda a: a.train_iters // 6})
    args = megatron_args.parse_megatron_args([*MODEL], parser=parser, world_size=1)
    assert (args.train_iters, args.lr_warmup_iters) == (30, 5)
    args = megatron_args.parse_megatron_args([*MODEL, "--train-iters", "5"], parser=parser, world_size=1)
    assert (args.train_iters, args.lr_warmup_iters) == (5, 0)
    args = megatron_args.parse_megatron_args([*MODEL, "--train-samples", "20"], parser=parser, world_size=1)
    assert args.lr_warmup_iters is None


def test_aliases_name_untyped_flags_in_the_command_lines_style(capsys):
    parser = argparse.ArgumentParser(prog="mine", allow_abbrev=False)
    megatron_args.add_megatron_args(parser, defaults={"lr_warmup_iters": 5}, aliases={
        "train_iters": "--steps", "lr_warmup_iters": "--warmup-steps"})
    with pytest.raises(SystemExit):
        megatron_args.parse_megatron_args([*MODEL, "--steps", "3"], parser=parser, world_size=1)
    assert "mine: error: --warmup-steps 5 must be >= 0 and less than the LR decay length --steps 3" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        megatron_args.parse_megatron_args([*MODEL, "--train-iters", "3"], parser=parser, world_size=1)
    assert "--lr-warmup-iters 5 must be >= 0 and less than the LR decay length --train-iters 3" in \
        capsys.readouterr().err


def test_defaults_and_aliases_must_name_flags():
    with pytest.raises(ValueError, match=r"\['no_such_flag'\]"):
        megatron_args.add_megatron_args(argparse.ArgumentParser(), defaults={"no_such_flag": 1})


def test_unsupported_flags_in_one_message(capsys):
    err = _error(capsys, [*MODEL, "--train-iters", "4", "--fp8-format", "hybrid", "--tp-comm-overlap",
                          "--data-path", "x", "--sequence-parallel", "--no-such-flag"],
                 unsupported_reasons={"data": "bring your own data"})
    assert err.count("error:") == 1 and "4 flags refused by" in err, err
    assert "usage:" not in err, err
    for line in ("  --fp8-format hybrid: not supported yet: fp8/fp4 training is not implemented",
                 "  --tp-comm-overlap: not supported yet: this model-parallel option is not implemented",
                 "  --data-path x: not supported yet: bring your own data", "  unknown flag --no-such-flag\n"):
        assert line in err, (line, err)
    assert "--sequence-parallel:" not in err  # a flag of megatron_opt's (off at tensor-parallel size 1)


def test_noop_values_and_reasons_of_the_caller():
    assert megatron_args.unsupported_flags_message(["--ckpt-format", "torch_dist", "--dropout", "0"], "p",
                                                   noop_values={"--dropout": "0"}) is None
    with pytest.raises(ValueError, match="not in UNSUPPORTED_FLAGS"):
        megatron_args.unsupported_flags_message([], "p", reasons={"no_such_feature": "why"})


def test_config_errors_name_flags(capsys):
    err = _error(capsys, [*MODEL, "--train-iters", "4", "--adam-beta2", "1.0"])
    assert "--adam-beta2=1.0 is out of range" in err and "OptimizerConfig" not in err, err


def test_validate_raises_for_library_callers():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    megatron_args.add_megatron_args(parser)
    args = parser.parse_args([*MODEL, "--train-iters", "4", "--global-batch-size", "6"])
    with pytest.raises(megatron_args.MegatronArgumentError, match="not divisible by --micro-batch-size 2 x "
                                                                  "data-parallel size 2 = 4"):
        megatron_args.validate_megatron_args(args, world_size=2)


def test_configs_and_schedule_from_the_flags():
    args = _parse(["--train-iters", "10", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                   "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--clip-grad", "0.5",
                   "--calculate-per-token-loss", "--global-batch-size", "8"], world_size=2)
    ddp, opt = megatron_args.ddp_config_from_args(args), megatron_args.optimizer_config_from_args(args)
    assert ddp.use_distributed_optimizer and ddp.overlap_grad_reduce and ddp.grad_reduce_in_fp32
    assert opt.bf16 and opt.params_dtype is torch.bfloat16 and opt.clip_grad == 0.5 and opt.lr == 1e-3
    assert megatron_args.params_dtype_from_args(args) is torch.bfloat16
    assert megatron_args.loss_mode_from_args(args) == "per_token" and args.num_microbatches == 2
    group = {"params": [], "wd_mult": 1.0}
    scheduler = megatron_args.scheduler_from_args(type("Groups", (), {"param_groups": [group]})(), args)
    assert isinstance(scheduler, mo.OptimizerParamScheduler)
    scheduler.step(2 * 8)  # two iterations of 8 samples: the end of the warm-up
    assert group["lr"] == pytest.approx(1e-3)
    scheduler.step(8 * 8)  # iteration 10: the end of the decay
    assert group["lr"] == pytest.approx(1e-4)


def test_imports_without_megatron_core():
    code = ("import sys; sys.modules['megatron'] = None; sys.modules['megatron.core'] = None\n"
            "from megatron_opt.megatron import arguments as a\n"
            f"args = a.parse_megatron_args({[*MODEL, '--train-iters', '3']!r}, world_size=1)\n"
            "print(a.optimizer_config_from_args(args).lr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0.001", out.stderr[-3000:]


def test_optimizer_adaptive_muon_flag_builds_adaptive_muon():
    """The main job's --optimizer adaptive_muon (issue 39): Muon's flags and the adaptive_muon_* constants reach
    the rule."""
    from megatron_opt.optimizer.rules.adaptive_muon import AdaptiveMuon
    from megatron_opt.optimizer.rules.registry import update_rule_from_config

    args = megatron_args.parse_megatron_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--optimizer", "adaptive_muon",
         "--adaptive-muon-beta2", "0.9", "--muon-momentum", "0.8"], world_size=1)
    rule = update_rule_from_config(megatron_args.optimizer_config_from_args(args))
    assert type(rule) is AdaptiveMuon and (rule.beta2, rule.momentum, rule.eps) == (0.9, 0.8, 1e-8)
