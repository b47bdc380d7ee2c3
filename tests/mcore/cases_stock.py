"""Worker-side case: megatron-core's GPTModel trained with the configs Megatron-LM's own argument parser
builds from stock arguments (tests/support/megatron_lm_configs.json), through megatron-core's names,
once with megatron-core's own DDP + optimizer and once with megatron_opt switched in by install();
Megatron-LM main's ``full_param_layout`` is passed to the DDP as its get_model does."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import megatron.core.distributed as core_distributed
import megatron.core.optimizer as core_optimizer
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler
from megatron.core.transformer.module import Float16Module

import megatron_opt.megatron
from tests.support import megatron_lm_configs as recorded
from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core
from tests.mcore.cases_megatron import forward_step, global_batches, schedule
from megatron.core.pipeline_parallel import get_forward_backward_func


def _full_param_layout(chunk: torch.nn.Module, ddp_config, dp_size: int, layer_wise: bool = False):
    """What Megatron-LM main's get_model computes for the distributed optimizer (None where this
    megatron-core has no such layout, or the DDP config does not shard); with ``layer_wise`` (Muon sharded),
    LayerWiseDistributedOptimizer's layout, after tagging the params for its buffer routing."""
    owner = core_optimizer.DistributedOptimizer
    if layer_wise:
        import megatron.core.optimizer.layer_wise_optimizer as layer_wise_optimizer
        owner = layer_wise_optimizer.LayerWiseDistributedOptimizer
        if hasattr(owner, "compute_full_param_layout"):
            layer_wise_optimizer.tag_params_for_buffer_routing([chunk])
    compute = getattr(owner, "compute_full_param_layout", None)
    if compute is None or not ddp_config.use_distributed_optimizer:
        return None
    params = [p for p in chunk.parameters() if p.requires_grad]
    return compute(params, ddp_config.bucket_size, dp_size, ddp_config, expert_data_parallel_world_size=dp_size)


def _as_megatron_lm_muon(ddp_config, opt_config, sharded: bool) -> None:
    """What Megatron-LM main's validate_args and get_model make of ``--optimizer muon --muon-momentum 0.9
    --muon-fp32-matmul-prec high`` (fp32 Newton-Schulz on the CPU), with ``--use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather`` when ``sharded``: use_layer_wise_distributed_optimizer=True
    and use_distributed_optimizer=False in the optimizer config, the DDP config forced to the distributed
    optimizer (wrap_model_chunks_with_ddp). Without ``sharded``: megatron-core's non-distributed Muon."""
    opt_config.optimizer, opt_config.muon_momentum, opt_config.muon_fp32_matmul_prec = "muon", 0.9, "high"
    opt_config.use_distributed_optimizer = False
    opt_config.use_layer_wise_distributed_optimizer = sharded
    opt_config.overlap_param_gather = sharded
    ddp_config.use_distributed_optimizer = ddp_config.overlap_grad_reduce = ddp_config.overlap_param_gather = sharded


def run_stock(launch: str, impl: str, steps: int = 3, ga: int = 2, mb: int = 2, muon: bool = False) -> dict:
    """Per-step (success, grad norm, num_zeros, loss scale), the step losses and the final model params.
    ``muon``: Megatron-LM main's Muon flags on the launch's configs (fp32 launches only): megatron_opt's
    run is the sharded one with both overlaps, megatron-core's its non-distributed Muon."""
    label = recorded.installed_label()
    mcore_cpu.init_parallel_state()
    world, rank = dist.get_world_size(), dist.get_rank()
    ddp_item, opt_item = recorded.entry(label, launch, "ddp"), recorded.entry(label, launch, "optimizer")
    ddp_config = core_distributed.DistributedDataParallelConfig(
        **recorded.core_kwargs(ddp_item, core_distributed.DistributedDataParallelConfig))
    if ddp_config.bucket_size is None:  # Megatron-LM's get_model does this too
        ddp_config.bucket_size = max(40000000, 1000000 * world)
    opt_class = getattr(core_optimizer, opt_item["class"])
    opt_config = opt_class(**recorded.core_kwargs(opt_item, opt_class))
    if muon:
        _as_megatron_lm_muon(ddp_config, opt_config, sharded=impl == "megatron_opt")
    bf16 = bool(opt_config.bf16)
    config = mcore_cpu.transformer_config(False, torch.bfloat16 if bf16 else torch.float32)
    out: dict = {"label": label, "launch": launch}
    with contextlib.ExitStack() as stack, cpu_megatron_core():
        if impl == "megatron_opt":
            megatron_opt.megatron.install()
            stack.callback(megatron_opt.megatron.uninstall)
        model = mcore_cpu.build_gpt(config, seed=0)
        if bf16:
            model = Float16Module(config, model)
        layout = _full_param_layout(model, ddp_config, world,
                                    layer_wise=bool(getattr(opt_config, "use_layer_wise_distributed_optimizer", False)))
        extra = {} if layout is None else {"full_param_layout": layout}
        ddp = core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                                       disable_bucketing=False, **extra)
        opt = core_optimizer.get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=True)
        out["optimizer_module"] = type(opt).__module__
        sched = CoreScheduler(opt, **schedule(world * ga * mb))
        config.no_sync_func = ddp.no_sync
        if ddp_config.overlap_grad_reduce:
            config.grad_sync_func = ddp.start_grad_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = opt.scale_loss
        out["steps"], out["losses"] = [], []
        for batches in global_batches(steps, world, ga, mb):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches[rank * ga:(rank + 1) * ga]), model=[ddp],
                num_microbatches=ga, seq_length=mcore_cpu.SEQ, micro_batch_size=mb, decoder_seq_length=None,
                forward_only=False)
            success, norm, num_zeros = opt.step()  # Megatron-LM's train_step
            if success:
                sched.step(increment=ga * mb * world)
            out["steps"].append((bool(success), float(norm), num_zeros, float(opt.get_loss_scale())))
            out["losses"].append(float(torch.stack([entry["lm loss"][0] / entry["lm loss"][1]
                                                    for entry in losses]).mean()))
        if ddp_config.overlap_param_gather:  # the last step's params arrive at the next forward
            ddp.disable_forward_pre_hook(param_sync=True)
        out["params"] = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return out
