"""Worker-side cases: megatron-core's GPTModel, schedule and finalize_model_grads driving megatron_opt,
built through megatron-core's call shapes and config objects, exactly as Megatron-LM's train_step does."""
from __future__ import annotations

import functools
import sys
import types

import torch
import torch.distributed as dist

from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core, token_losses

from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

import megatron_opt as mo
import megatron_opt.megatron
from megatron_opt.config_conversion import as_optimizer_config

LR, MIN_LR, WD, CLIP = 3e-3, 3e-4, 0.1, 0.05


def schedule(global_batch: int) -> dict:
    """Megatron-LM counts the schedule in samples: warm up over 2 steps, decay over 20."""
    return dict(init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2 * global_batch,
                lr_decay_steps=20 * global_batch, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                wd_incr_steps=20 * global_batch, wd_incr_style="constant")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM pretrain_gpt's loss_func: (sum of token losses, token count, reporting)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    return token_losses(model, batch), functools.partial(loss_func, batch["loss_mask"])


def global_batches(steps: int, world: int, ga: int, mb: int, seed: int = 11) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    return [[mcore_cpu.microbatch(gen, mb) for _ in range(world * ga)] for _ in range(steps)]


def _no_wd(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 1 or name.endswith(".bias")


class Float64Reference:
    """One process, the whole global batch, float64 model and torch AdamW, megatron-core's scheduler."""

    def __init__(self, model_fp32: torch.nn.Module, global_batch: int, dtype: torch.dtype = torch.float64) -> None:
        self.model = mcore_cpu.clone_gpt(model_fp32).to(dtype)
        named = list(self.model.named_parameters())
        groups = [{"params": [p for n, p in named if not _no_wd(n, p)], "wd_mult": 1.0},
                  {"params": [p for n, p in named if _no_wd(n, p)], "wd_mult": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, betas=(0.9, 0.999), eps=1e-8)
        self.sched = CoreScheduler(self.opt, **schedule(global_batch))
        self.global_batch = global_batch

    def step(self, batches: list[dict], per_token: bool, world: int) -> float:
        self.opt.zero_grad()
        ga = len(batches) // world
        if per_token:
            total = sum(int(b["loss_mask"].sum()) for b in batches)
            loss = sum((token_losses(self.model, b).double() * b["loss_mask"]).sum() for b in batches) / total
        else:  # each micro-batch's mean over its tokens, averaged over micro-batches and ranks
            loss = sum((token_losses(self.model, b).double() * b["loss_mask"]).sum() / b["loss_mask"].sum()
                       for b in batches) / (ga * world)
        loss.backward()
        self.last_loss = float(loss.detach())
        # Megatron-LM's num_zeros on the whole model: every logical gradient element once.
        self.last_zeros = sum(int((p.grad == 0).sum()) for p in self.model.parameters() if p.grad is not None)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.sched.step(increment=self.global_batch)
        return float(norm)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().double().clone() for n, p in self.model.named_parameters()}


def build_megatron_style(per_token: bool, overlap: bool, bf16: bool, model_fp32: torch.nn.Module, global_batch: int):
    """What Megatron-LM's get_model + setup_model_and_optimizer do, with megatron-core's objects."""
    config = mcore_cpu.transformer_config(per_token, torch.bfloat16 if bf16 else torch.float32)
    model = mcore_cpu.clone_gpt(model_fp32, config)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                               use_distributed_optimizer=True, bucket_size=4000 if overlap else None)
    ddp = mo.DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                     disable_bucketing=False)
    opt_config = CoreOptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP,
                                     bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                     adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True)
    opt = mo.get_megatron_optimizer(opt_config, [ddp], config_overrides=None, use_gloo_process_groups=True)
    sched = CoreScheduler(opt, **schedule(global_batch))
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return ddp, opt, sched


def megatron_train_step(ddp, opt, sched, batches: list[dict], ga: int, mb: int) -> tuple:
    """Megatron-LM's train_step, minus the rerun machinery."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    with cpu_megatron_core():
        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                             num_microbatches=ga, seq_length=mcore_cpu.SEQ, micro_batch_size=mb,
                                             decoder_seq_length=None, forward_only=False)
    success, grad_norm, num_zeros = opt.step()
    if success:
        sched.step(increment=ga * mb * dist.get_world_size())
    return success, grad_norm, losses


def run_parity(per_token: bool, overlap: bool, bf16: bool, steps: int = 4, ga: int = 2, mb: int = 2,
               install: bool = False) -> dict:
    mcore_cpu.init_parallel_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    model_fp32 = mcore_cpu.build_gpt(mcore_cpu.transformer_config(per_token))
    init = {n: p.detach().double().clone() for n, p in model_fp32.named_parameters()}
    if install:
        megatron_opt.megatron.install()
    try:
        ddp, opt, sched = build_megatron_style(per_token, overlap, bf16, model_fp32, world * ga * mb)
        reference = Float64Reference(model_fp32, world * ga * mb)
        fp32_torch = Float64Reference(model_fp32, world * ga * mb, torch.float32)  # what plain fp32 torch reaches here
        norms = []
        for batches in global_batches(steps, world, ga, mb):
            success, norm, _ = megatron_train_step(ddp, opt, sched, batches[rank * ga:(rank + 1) * ga], ga, mb)
            ref_norm = reference.step(batches, per_token, world)
            fp32_torch.step(batches, per_token, world)
            norms.append((success, norm, ref_norm))
        masters = opt.gather_main_params()
    finally:
        megatron_opt.megatron.uninstall()
    strip = "module." if bf16 else ""
    ours = {n[len(strip):] if strip and n.startswith(strip) else n: t.double() for n, t in masters.items()}
    ref, base = reference.params(), fp32_torch.params()
    assert ours.keys() == ref.keys(), (sorted(ours)[:3], sorted(ref)[:3])

    def update_error(params: dict) -> float:
        num = sum(float(((params[n] - init[n]) - (ref[n] - init[n])).norm() ** 2) for n in ref)
        den = sum(float((ref[n] - init[n]).norm() ** 2) for n in ref)
        return (num / den) ** 0.5

    return {"norms": norms, "update_error": update_error(ours), "fp32_torch_error": update_error(base),
            "model_is_ddp_module": ddp.module is not None}


def run_unwrap_and_install() -> dict:
    """install(): megatron-core's names (imported before or after) resolve to megatron_opt's, unwrap_model
    reaches the model, and uninstall() restores megatron-core's objects."""
    import megatron.core.distributed as core_distributed
    import megatron.core.optimizer as core_optimizer
    import megatron.core.utils as core_utils

    mcore_cpu.init_parallel_state()
    original_ddp, original_factory = core_distributed.DistributedDataParallel, core_optimizer.get_megatron_optimizer
    # A module that imported megatron-core's names before install(), as Megatron-LM's training.py does.
    early = types.ModuleType("megatron.training_imported_early")
    early.DDP = original_ddp
    early.get_megatron_optimizer = original_factory
    early.WRAPPERS = (original_ddp, torch.nn.Module)
    sys.modules[early.__name__] = early
    out: dict = {}
    try:
        megatron_opt.megatron.install()
        from megatron.core.distributed import DistributedDataParallel as LateDDP  # imported after install()

        out["late_import_is_ours"] = LateDDP is mo.DistributedDataParallel
        out["early_import_is_ours"] = early.DDP is mo.DistributedDataParallel
        # megatron_opt's factory behind install()'s entry, which tags QKV weights for Muon first (muon_call.py)
        out["early_factory_is_ours"] = (early.get_megatron_optimizer
                                        is megatron_opt.megatron.muon_call.get_megatron_optimizer)
        out["wrapper_tuple_has_ours"] = mo.DistributedDataParallel in early.WRAPPERS
        config = mcore_cpu.transformer_config(True)
        model = mcore_cpu.build_gpt(config)
        ddp = early.DDP(config=config, ddp_config=CoreDDPConfig(use_distributed_optimizer=True), module=model,
                        disable_bucketing=True)
        opt = early.get_megatron_optimizer(CoreOptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
        out["optimizer_type"] = type(opt).__name__
        out["unwrap_is_model"] = core_utils.unwrap_model([ddp])[0] is model
        out["buckets"] = len(ddp.buffers[0].buckets)
    finally:
        megatron_opt.megatron.uninstall()
        del sys.modules[early.__name__]
    out["restored"] = (core_distributed.DistributedDataParallel is original_ddp
                       and core_optimizer.get_megatron_optimizer is original_factory and early.DDP is original_ddp)
    out["unwrap_after_uninstall_is_model"] = core_utils.unwrap_model([ddp])[0] is model
    return out


def run_installed_equals_direct(steps: int = 2, ga: int = 2, mb: int = 2) -> bool:
    """The installed path (megatron-core's own names) trains bitwise like megatron_opt's classes used directly."""
    mcore_cpu.init_parallel_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    model_fp32 = mcore_cpu.build_gpt(mcore_cpu.transformer_config(True))
    results = []
    for install in (False, True):
        if install:
            megatron_opt.megatron.install()
        try:
            import megatron.core.distributed as core_distributed
            import megatron.core.optimizer as core_optimizer

            config = mcore_cpu.transformer_config(True)
            model = mcore_cpu.clone_gpt(model_fp32)
            ddp_class = core_distributed.DistributedDataParallel if install else mo.DistributedDataParallel
            factory = core_optimizer.get_megatron_optimizer if install else mo.get_megatron_optimizer
            ddp = ddp_class(config=config, ddp_config=CoreDDPConfig(use_distributed_optimizer=True,
                                                                    grad_reduce_in_fp32=True), module=model)
            opt = factory(CoreOptimizerConfig(lr=LR, clip_grad=CLIP, use_distributed_optimizer=True), [ddp])
            assert isinstance(ddp, mo.DistributedDataParallel) and isinstance(opt, mo.ChainedOptimizer)
            sched = CoreScheduler(opt, **schedule(world * ga * mb))
            config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
            config.grad_scale_func = opt.scale_loss
            for batches in global_batches(steps, world, ga, mb):
                megatron_train_step(ddp, opt, sched, batches[rank * ga:(rank + 1) * ga], ga, mb)
            results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        finally:
            megatron_opt.megatron.uninstall()
    return bool(torch.equal(results[0], results[1]))


# ----------------------------------------------------------------------------- param groups vs megatron-core
def _override_sets(kind: str):
    from megatron.core.optimizer import ParamKey

    if kind == "standard":
        return None
    if kind == "empty":
        return {}
    if kind == "custom":  # lr multiplier for the output layer, another min_lr and wd_mult for layer 1
        return {ParamKey(name="*output_layer.weight"): {"lr_mult": 2.0, "max_lr": 2 * LR},
                ParamKey(name="*layers.1.*weight"): {"min_lr": 1e-5, "wd_mult": 0.5},
                ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    raise ValueError(kind)


def run_param_groups_match_megatron_core(kind: str, decoupled: bool) -> list:
    """Our groups and megatron-core's _get_param_groups for the same GPTModel, chunks and overrides."""
    from megatron.core.optimizer import _get_param_groups

    mcore_cpu.init_parallel_state()
    config = mcore_cpu.transformer_config(True)
    model = mcore_cpu.build_gpt(config)
    ddp = mo.DistributedDataParallel(config=config, ddp_config=CoreDDPConfig(use_distributed_optimizer=True),
                                     module=model)
    opt_config = CoreOptimizerConfig(lr=LR, min_lr=MIN_LR, weight_decay=WD, use_distributed_optimizer=True,
                                     decoupled_lr=5 * LR if decoupled else None,
                                     decoupled_min_lr=LR / 10 if decoupled else None)
    names = {id(p): n for n, p in ddp.named_parameters()}
    ours = mo.get_param_groups([ddp], as_optimizer_config(opt_config),
                               config_overrides=_override_sets(kind))
    # get_megatron_optimizer turns None into the standard overrides (megatron-core 0.19 does it there, 0.16.1 in
    # _get_param_groups too): give megatron-core's private function what its public one would.
    theirs_overrides = _override_sets(kind)
    if theirs_overrides is None:
        from megatron.core.optimizer import get_standard_config_overrides
        theirs_overrides = get_standard_config_overrides(opt_config)
    theirs = _get_param_groups([ddp], opt_config, theirs_overrides)

    def describe(groups):
        keys = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")
        return [({k: g.get(k) for k in keys}, sorted(names[id(p)] for p in g["params"])) for g in groups]

    return [describe(ours), describe(theirs)]


def run_force_all_reduce() -> dict:
    """finish_grad_sync(force_all_reduce=True): every rank's main_grad holds the whole reduced gradient,
    and the optimizer's step is the same as with the reduce-scatter. (On gloo the reduce-scatter is an
    all-reduce too, collectives.reduce_scatter, so the two are not told apart by their buffers here.)"""
    from tests.support.common import TinyLM, global_batch, rank_microbatches, token_loss_sum

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for force in (False, True):
        model = TinyLM()
        ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
        opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), ddp)
        ddp.zero_grad_buffer()
        with ddp.no_sync():  # launch nothing yet: the buffers hold this rank's own gradients
            for x, y in rank_microbatches(global_batch(world), rank, world):
                token_loss_sum(model(x), y)[0].backward()
        local = torch.cat([b.grad_data * b.grad_prescale for b in ddp.buffers])
        dist.all_reduce(local)  # the whole reduced gradient, by hand
        ddp.finish_grad_sync(force_all_reduce=force)
        out[f"grads_{force}"] = torch.cat([b.grad_data.clone() for b in ddp.buffers])
        out[f"whole_{force}"] = local
        opt.step()
        out[f"params_{force}"] = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    full = out["grads_True"].clone()
    dist.all_reduce(full, op=dist.ReduceOp.MAX)
    low = out["grads_True"].clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return {"identical_across_ranks": bool(torch.equal(full, low)),
            "whole_gradient": bool(torch.allclose(out["grads_True"], out["whole_True"], rtol=1e-6, atol=1e-7)),
            "same_step": bool(torch.equal(out["params_False"], out["params_True"]))}


def run_dump_param_to_param_group_map(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    mcore_cpu.init_parallel_state()
    config = mcore_cpu.transformer_config(True)
    model = mcore_cpu.build_gpt(config)
    ddp = mo.DistributedDataParallel(config, CoreDDPConfig(use_distributed_optimizer=True), model)
    opt = mo.get_megatron_optimizer(CoreOptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp],
                                    dump_param_to_param_group_map=path)
    expected = {}
    for index, group in enumerate(opt.param_groups):
        for p in group["params"]:
            expected[index] = expected.get(index, 0) + 1
    loaded = {n: -1 for n, _ in ddp.named_parameters()}
    dcp.load(loaded, checkpoint_id=path)
    counts: dict = {}
    for index in loaded.values():
        counts[index] = counts.get(index, 0) + 1
    return {"counts": counts, "expected": expected}
