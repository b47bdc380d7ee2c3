"""megatron-core's call shapes, config objects, config_overrides and the DDP / optimizer members that
Megatron-LM's training, schedules, finalize_model_grads and checkpointing code call."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

# CI installs megatron-core: import it unconditionally so that a missing dependency fails loudly.
from tests.mcore import mcore_cpu
from tests.mcore import cases_megatron as cm
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig
from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig
from megatron.core.optimizer import ParamKey
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_opt as mo
from megatron_opt.config_conversion import as_ddp_config, as_optimizer_config
from megatron_opt.optimizer.rules.registry import update_rule_from_config
from tests.support.common import TinyLM


def _tc(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **kw)


# ----------------------------------------------------------------------------- config objects
def test_megatron_core_configs_convert_field_by_field():
    core = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
                         bucket_size=1234, check_for_nan_in_grad=True)
    ours = as_ddp_config(core)
    for f in dataclasses.fields(mo.DistributedDataParallelConfig):
        assert getattr(ours, f.name) == getattr(core, f.name), f.name
    core_opt = CoreOptimizerConfig(lr=2e-4, min_lr=2e-5, weight_decay=0.05, adam_beta2=0.95, clip_grad=0.5,
                                   bf16=True, loss_scale_window=50, use_distributed_optimizer=True)
    ours_opt = as_optimizer_config(core_opt)
    shared = {f.name for f in dataclasses.fields(mo.OptimizerConfig)} & {f.name for f in dataclasses.fields(core_opt)}
    assert len(shared) > 30
    for name in shared - {"grad_norm_skip_threshold"}:
        assert getattr(ours_opt, name) == getattr(core_opt, name), name
    # megatron-core 0.16.1 lacks it (ours gets our default, None); 0.19.2's default inf means off, our None
    assert getattr(core_opt, "grad_norm_skip_threshold", math.inf) == math.inf
    assert ours_opt.grad_norm_skip_threshold is None


@pytest.mark.parametrize("make, field", [
    (lambda: CoreDDPConfig(num_distributed_optimizer_instances=2),  # partial sharding needs the distributed optimizer
     "num_distributed_optimizer_instances"),
    (lambda: CoreDDPConfig(fp8_param_gather=True), "fp8_param_gather"),
    (lambda: CoreOptimizerConfig(lr=1e-3, decoupled_weight_decay=False), "decoupled_weight_decay"),
    (lambda: CoreOptimizerConfig(lr=1e-3, optimizer_cpu_offload=True), "optimizer_cpu_offload"),
    (lambda: CoreOptimizerConfig(lr=1e-3, optimizer="scion"), "optimizer"),  # adaptive_muon, soap run (issue 39)
])
def test_unsupported_megatron_core_values_are_named(make, field):
    config = make()
    if isinstance(config, CoreDDPConfig):
        convert = as_ddp_config
    else:  # what depends on the update rule is checked where the rule is built (issue 38)
        def convert(c):
            return update_rule_from_config(as_optimizer_config(c))
    with pytest.raises(mo.UnsupportedConfigError, match=field):
        convert(config)


def test_a_megatron_core_field_we_lack_is_refused_unless_at_its_default():
    @dataclasses.dataclass
    class FutureOptimizerConfig(CoreOptimizerConfig):  # a field a later megatron-core might add
        shiny_new_knob: int = 0

    assert as_optimizer_config(FutureOptimizerConfig(lr=1e-3)).lr == 1e-3
    with pytest.raises(mo.UnsupportedConfigError, match="shiny_new_knob=3"):
        as_optimizer_config(FutureOptimizerConfig(lr=1e-3, shiny_new_knob=3))


def test_conversion_leaves_the_callers_config_alone():
    core = CoreDDPConfig(overlap_grad_reduce=True, use_distributed_optimizer=True)
    mo.DistributedDataParallel(_tc(), core, TinyLM())
    assert core.bucket_size is None  # megatron-core's own DDP would have written its default in


# ----------------------------------------------------------------------------- DDP call shapes
def test_megatron_core_call_shape_positional_and_keyword():
    a = mo.DistributedDataParallel(_tc(), CoreDDPConfig(use_distributed_optimizer=True), TinyLM())
    b = mo.DistributedDataParallel(config=_tc(), ddp_config=CoreDDPConfig(), module=TinyLM(), disable_bucketing=True,
                                   pg_collection=None)
    c = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(), None)
    assert a.config is not None and b.config is not None and c.config is None
    assert isinstance(a.ddp_config, mo.DistributedDataParallelConfig) and a.ddp_config.use_distributed_optimizer


def test_mixed_call_shapes_raise_type_error():
    with pytest.raises(TypeError, match="data_parallel_group"):
        mo.DistributedDataParallel(config=_tc(), ddp_config=CoreDDPConfig(), module=TinyLM(), data_parallel_group=None)
    with pytest.raises(TypeError, match="module"):
        mo.DistributedDataParallel(config=_tc(), ddp_config=CoreDDPConfig())
    with pytest.raises(TypeError, match="megatron-core's call shape"):
        mo.DistributedDataParallel(TinyLM(), disable_bucketing=True)


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size", "expert_model_parallel_size"])
def test_model_parallel_config_without_matching_groups_is_refused(field):
    """A model built for a model-parallel size must be wrapped over groups of that size (here none:
    one process), or its shards would be reduced and counted wrongly."""
    config = _tc()
    setattr(config, field, 2)
    with pytest.raises(mo.UnsupportedConfigError, match=f"{field}=2 but the .* group this rank is in has 1 rank"):
        mo.DistributedDataParallel(config, CoreDDPConfig(), TinyLM())


def test_gradient_scale_starts_as_megatron_core_says():
    per_token = mo.DistributedDataParallel(_tc(calculate_per_token_loss=True), CoreDDPConfig(), TinyLM())
    mean = mo.DistributedDataParallel(_tc(), CoreDDPConfig(), TinyLM())
    per_token.scale_gradients(0.5)
    per_token.zero_grad_buffer()  # a new step starts again at 1.0
    assert float(per_token.grad_scale_factor) == 1.0 and float(mean.grad_scale_factor) == 1.0  # 1/DP at DP=1
    with pytest.raises(mo.UnsupportedConfigError, match="average_in_collective"):
        mo.DistributedDataParallel(_tc(calculate_per_token_loss=True), CoreDDPConfig(average_in_collective=True),
                                   TinyLM())


def test_disable_bucketing_makes_one_bucket_per_buffer():
    cfg = CoreDDPConfig(overlap_grad_reduce=True, bucket_size=100, use_distributed_optimizer=True)
    assert len(mo.DistributedDataParallel(_tc(), cfg, TinyLM()).buffers[0].buckets) > 1
    assert len(mo.DistributedDataParallel(_tc(), cfg, TinyLM(), disable_bucketing=True).buffers[0].buckets) == 1


# ----------------------------------------------------------------------------- DDP members
def test_forward_pre_hooks_enable_disable():
    model = TinyLM()
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(use_distributed_optimizer=True, overlap_param_gather=True),
                                     model)
    installed = len(ddp.remove_forward_pre_hook_handles)
    assert installed > 0
    ddp.disable_forward_pre_hook(param_sync=True)
    assert len(ddp.remove_forward_pre_hook_handles) == 0 and not any(m._forward_pre_hooks for m in model.modules())
    ddp.enable_forward_pre_hook()
    assert len(ddp.remove_forward_pre_hook_handles) == installed
    with pytest.raises(mo.StepOrderError, match="already enabled"):
        ddp.enable_forward_pre_hook()
    plain = mo.DistributedDataParallel(_tc(), CoreDDPConfig(), TinyLM())
    with pytest.raises(mo.StepOrderError, match="overlap_param_gather"):
        plain.disable_forward_pre_hook()


def test_checkpoint_members_reach_the_module():
    class WithFlag(TinyLM):
        def __init__(self):
            super().__init__()
            self.fc.is_first_microbatch = False

    model = WithFlag()
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(), model)
    assert ddp.state_dict_for_save_checkpoint().keys() == model.state_dict().keys()
    ddp.set_is_first_microbatch()
    assert model.fc.is_first_microbatch is True
    assert ddp.expert_parallel_buffers == [] and len(ddp.buffers) == 1
    with pytest.raises(mo.UnsupportedConfigError, match="megatron_opt.checkpoint"):
        ddp.sharded_state_dict()
    with pytest.raises(mo.UnsupportedConfigError, match="offload"):
        ddp.offload_grad_buffers()


def test_grad_sync_accepts_megatron_core_arguments():
    """The calls megatron-core's schedules make do what they say: start_grad_sync(params) launches every
    bucket, finish_grad_sync(force_all_reduce=False) leaves the whole gradient in main_grad (one rank),
    and start_param_sync(params) / (force_sync=True, force_dispatch=True) leave the params as they are."""
    model, reference = TinyLM(), TinyLM()
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(use_distributed_optimizer=True), model)
    ddp.zero_grad_buffer()
    x = torch.zeros(1, 4, dtype=torch.long)
    model(x).sum().backward()
    reference(x).sum().backward()
    params = list(model.parameters())
    ddp.start_grad_sync(params)  # interleaved schedules pass the chunk's params positionally
    with pytest.raises(mo.LateGradientError, match="launched"):  # every bucket was launched
        ddp.add_grad(params[0], torch.ones_like(params[0]))
    ddp.finish_grad_sync(force_all_reduce=False)
    for p, ref in zip(params, reference.parameters()):
        assert torch.equal(p.main_grad, ref.grad)
    before = [p.detach().clone() for p in params]
    ddp.start_param_sync(params)  # not taken as force_sync
    ddp.start_param_sync(force_sync=True, force_dispatch=True)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_fused_wgrad_gradients_are_not_added_twice():
    """gradient_accumulation_fusion: the kernel wrote main_grad and set grad_added_to_main_grad."""
    model = TinyLM()
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(), model)
    ddp.zero_grad_buffer()
    weight = model.fc.weight
    weight.main_grad.fill_(2.0)
    weight.grad_added_to_main_grad = True
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert torch.all(weight.main_grad == 2.0)
    ddp.zero_grad_buffer()
    assert weight.grad_added_to_main_grad is False


def test_force_all_reduce_gives_every_rank_the_whole_gradient(pools):
    for out in pools(2).run(cm.run_force_all_reduce):
        assert out == {"identical_across_ranks": True, "whole_gradient": True, "same_step": True}


# ----------------------------------------------------------------------------- optimizer members
def _opt(**kw):
    model = TinyLM()
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(use_distributed_optimizer=True), model)
    return model, ddp, mo.get_megatron_optimizer(CoreOptimizerConfig(lr=1e-3, use_distributed_optimizer=True, **kw),
                                                 [ddp])


def test_optimizer_members_megatron_lm_reads():
    model, ddp, opt = _opt()
    assert isinstance(opt, mo.ChainedOptimizer) and len(opt.chained_optimizers) == 1
    assert opt.is_stub_optimizer is False and opt.chained_optimizers[0].is_stub_optimizer is False
    assert opt.get_grad_stats_parallel_group() is None  # the default group, as for megatron-core's DistOpt
    opt.prepare_model_params_for_param_sync()
    assert opt.state_dict(is_loading=True).keys() == opt.state_dict().keys()
    opt.reload_model_params()
    with pytest.raises(mo.UnsupportedConfigError, match="megatron_opt.checkpoint"):
        opt.reload_model_params(state_dict={})
    for call in (lambda: opt.save_parameter_state("x"), lambda: opt.load_parameter_state("x")):
        with pytest.raises(mo.UnsupportedConfigError, match="torch_dist"):
            call()
    # (tests/mcore/test_checkpoint_mcore.py)
    with pytest.raises(ValueError, match="not in the model's sharded state dict"):
        opt.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    assert opt.get_loss_scale().item() == 1.0


def test_megatron_lm_timers_time_the_optimizer_phases():
    """Megatron-LM's training loop puts its Timers into the optimizer config: at --timing-log-level 1 the
    step's two passes (and the param all-gather) accumulate time under megatron-core's names; at level 0
    they are megatron-core's dummy timers."""
    from megatron.core.timers import Timers
    from megatron_opt.optimizer.step import phase_timers as pt

    for level in (1, 0):
        timers = Timers(level, "minmax")
        model, ddp, opt = _opt(timers=timers)
        x = torch.randint(0, 64, (2, 8))
        with mcore_cpu.cpu_megatron_core():  # megatron-core's Timer synchronises CUDA
            for _ in range(2):
                ddp.zero_grad_buffer()
                model(x).float().square().mean().backward()
                assert opt.step()[0]
        if level == 0:  # nothing to time: __call__ hands out the dummy timer, whose elapsed() refuses
            assert all(timers(name, log_level=pt.LOG_LEVEL) is timers(name, log_level=2) for name in (pt.PASS1,))
            continue
        elapsed = {name: timers(name, log_level=pt.LOG_LEVEL).elapsed(reset=False)
                   for name in (pt.PASS1, pt.PASS2, pt.PARAM_SYNC)}
        assert all(t > 0.0 for t in elapsed.values()), elapsed


def test_our_call_shape_still_returns_a_plain_distributed_optimizer():
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    assert isinstance(mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), ddp),
                      mo.DistributedOptimizer)


# ----------------------------------------------------------------------------- config_overrides
@pytest.mark.parametrize("kind", ["standard", "empty", "custom"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_param_groups_equal_megatron_cores(pools, kind, decoupled):
    ours, theirs = pools(1).run(cm.run_param_groups_match_megatron_core, kind, decoupled)[0]
    assert ours == theirs


def test_decoupled_lr_applies_to_embedding_and_output_params():
    model = TinyLM()
    model.emb.weight.is_embedding_or_output_parameter = True
    ddp = mo.DistributedDataParallel(_tc(), CoreDDPConfig(), model)
    opt = mo.get_megatron_optimizer(CoreOptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3,
                                                        decoupled_min_lr=5e-4), [ddp])
    (group,) = [g for g in opt.param_groups if g["max_lr"] == 5e-3]
    assert group["min_lr"] == 5e-4 and group["default_config"] is False and len(group["params"]) == 1
    sched = mo.OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0,
                                       lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=10, wd_incr_style="constant")
    sched.step(1)
    assert group["lr"] == 5e-3 and mo.canonical_lr(opt.param_groups) == 1e-3


def test_override_errors_are_clear():
    model, ddp, _ = _opt()
    cfg = CoreOptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    with pytest.raises(mo.UnsupportedConfigError, match="'betas'"):
        mo.get_megatron_optimizer(cfg, [ddp], config_overrides={ParamKey(name="*fc*"): {"betas": (0.9, 0.95)}})
    with pytest.raises(ValueError, match="'optimizer' should not be overridden"):
        mo.get_megatron_optimizer(cfg, [ddp], config_overrides={ParamKey(name="*fc*"): {"optimizer": "sgd"}})
    with pytest.raises(ValueError, match="conflicting overrides for 'wd_mult'"):
        mo.get_megatron_optimizer(cfg, [ddp], config_overrides={ParamKey(name="*fc*"): {"wd_mult": 0.5},
                                                                ParamKey(name="*.bias"): {"wd_mult": 0.0}})
    with pytest.raises(ValueError, match="not both"):
        mo.get_param_groups([ddp], as_optimizer_config(cfg), no_weight_decay_cond=lambda n, p: False,
                            config_overrides={})


def test_megatron_opt_keywords_still_work():
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig())
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3, min_lr=1e-4), ddp,
                                    no_weight_decay_cond=lambda name, p: name.startswith("norm"),
                                    scale_lr_cond=lambda name, p: name.startswith("out"), lr_mult=3.0)
    groups = {(g["wd_mult"], g["lr_mult"]): g for g in opt.param_groups}
    assert set(groups) == {(1.0, 1.0), (0.0, 1.0), (1.0, 3.0)}
    assert groups[(1.0, 3.0)]["max_lr"] == pytest.approx(3e-3) and groups[(1.0, 3.0)]["min_lr"] == pytest.approx(3e-4)
    assert groups[(0.0, 1.0)]["weight_decay"] == 0.0


def test_dump_param_to_param_group_map(pools, tmp_path):
    out = pools(1).run(cm.run_dump_param_to_param_group_map, os.fspath(tmp_path / "map"))[0]
    assert out["counts"] == out["expected"] and -1 not in out["counts"]
