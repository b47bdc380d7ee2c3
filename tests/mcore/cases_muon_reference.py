"""Worker-side cases: megatron-core's own Muon (``get_megatron_optimizer`` with ``optimizer="muon"``,
non-distributed: a ChainedOptimizer of TensorParallelMuon + AdamW, each in an FP32Optimizer) against
tests/support/reference_muon.py in float64, on a megatron-core GPTModel on the CPU, one process.

megatron-core 0.19.2's Muon needs nothing beyond mcore_cpu's shim on the CPU: the optimizer step
runs inside ``cpu_megatron_core()`` for the grad-norm buffers that megatron-core creates with
device="cuda"; Newton-Schulz itself is plain torch matmuls. The only care: megatron-core's default
``muon_fp32_matmul_prec="medium"`` casts the Newton-Schulz iteration to bf16 (on the CPU too), so the
calibration runs at "highest" (true fp32) and the bf16 figure is measured apart.
"""
from __future__ import annotations

import dataclasses

import torch

from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core, token_losses
from tests.support import reference_muon as rm

from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.optimizer_config import ParamKey  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402

LR, MIN_LR, WD, CLIP = 3e-3, 3e-4, 0.1, 1.0
MOMENTUM = 0.9  # Megatron-LM's --muon-momentum default (OptimizerConfig's is 0.95)
FC2_LR, FC2_WD_MULT = 1e-3, 0.5  # a config_overrides case: linear_fc2 weights on their own max_lr and wd_mult


def gqa_config():
    """The harness's tiny GPT with grouped-query attention: 4 heads in 2 query groups, so the QKV
    split ([16, 8, 8] rows per group) differs from three equal thirds."""
    return dataclasses.replace(mcore_cpu.transformer_config(per_token=True), num_query_groups=2)


def schedule() -> dict:
    """Warm up from 5e-4 over 2 steps, cosine decay over 10 (counted in optimizer steps), constant weight
    decay: every step moves the params, at changing lr."""
    return dict(init_lr=5e-4, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2, lr_decay_steps=10,
                lr_decay_style="cosine", start_wd=WD, end_wd=WD, wd_incr_steps=10, wd_incr_style="constant")


def _fc2_override(name: str, param: torch.Tensor) -> dict:
    return {"max_lr": FC2_LR, "wd_mult": FC2_WD_MULT} if name.endswith("linear_fc2.weight") else {}


def core_muon(model, case: dict):
    """megatron-core's Muon for ``model`` as Megatron-LM builds it (standard overrides: no decay on
    biases and 1-D params), with the case's muon_* settings."""
    from megatron.core.optimizer import get_standard_config_overrides

    config = CoreOptimizerConfig(
        optimizer="muon", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, muon_momentum=MOMENTUM, muon_nesterov=case["nesterov"], muon_split_qkv=case["split_qkv"],
        muon_scale_mode=case["scale_mode"], muon_extra_scale_factor=case["extra_scale"],
        muon_num_ns_steps=case["ns_steps"], muon_fp32_matmul_prec=case["matmul_prec"], muon_tp_mode="blockwise")
    overrides = get_standard_config_overrides(config)
    if case["overrides"]:
        overrides[ParamKey(name="*linear_fc2.weight")] = {"max_lr": FC2_LR, "wd_mult": FC2_WD_MULT}
    with cpu_megatron_core():
        return get_megatron_optimizer(config, [model], config_overrides=overrides)


def reference(model, case: dict, dtype: torch.dtype):
    """ReferenceMuon on a ``dtype`` copy of ``model`` with the same settings."""
    copy = mcore_cpu.clone_gpt(model).to(dtype)
    cfg = model.config
    opt = rm.reference_muon(
        copy, LR, WD, split_shapes=rm.qkv_split_shapes(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels),
        group_overrides=_fc2_override if case["overrides"] else None, momentum=MOMENTUM, nesterov=case["nesterov"],
        num_ns_steps=case["ns_steps"], scale_mode=case["scale_mode"], extra_scale_factor=case["extra_scale"],
        split_qkv=case["split_qkv"], tp_mode="blockwise", adam_betas=(0.9, 0.95), adam_eps=1e-8)
    return copy, opt


def _loss(model, batches: list[dict], dtype: torch.dtype) -> torch.Tensor:
    """Per-token loss over the global batch (every supervised token weighs the same)."""
    total = sum(int(b["loss_mask"].sum()) for b in batches)
    return sum((token_losses(model, b).to(dtype) * b["loss_mask"]).sum() for b in batches) / total


def _errors(got: dict, want: dict) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / max |want|) over the named tensors."""
    abs_err = max(float((got[n] - want[n]).abs().max()) for n in want)
    rel_err = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)
    return abs_err, rel_err


def run_calibration(case: dict, steps: int = 4, microbatches: int = 2, mb: int = 2) -> dict:
    """``steps`` steps of megatron-core's Muon (fp32) and of the reference (float64, and float32 for
    scale) on the same batches; the distances of params, updates and momentum buffers."""
    mcore_cpu.init_parallel_state()
    model = mcore_cpu.build_gpt(gqa_config())
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    core = core_muon(model, case)
    core_sched = CoreScheduler(core, **schedule())
    ref_model, ref_opt = reference(model, case, torch.float64)
    ref_sched = CoreScheduler(ref_opt, **schedule())
    f32_model, f32_opt = reference(model, case, torch.float32)
    f32_sched = CoreScheduler(f32_opt, **schedule())
    gen = torch.Generator().manual_seed(11)
    norms = []
    for _ in range(steps):
        batches = [mcore_cpu.microbatch(gen, mb) for _ in range(microbatches)]
        core.zero_grad()
        _loss(model, batches, torch.float32).backward()
        with cpu_megatron_core():
            success, norm, _ = core.step()
        core_sched.step(increment=1)
        ref_norms = []
        for m, opt, sched, dtype in ((ref_model, ref_opt, ref_sched, torch.float64),
                                     (f32_model, f32_opt, f32_sched, torch.float32)):
            opt.zero_grad()
            _loss(m, batches, dtype).backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
            opt.step()
            sched.step(increment=1)
        norms.append((success, norm, ref_norms[0]))

    names = dict(model.named_parameters())
    muon_opt = core.chained_optimizers[0].optimizer
    assert type(muon_opt).__name__ == "TensorParallelMuon", type(muon_opt)
    muon_names = sorted(n for n, p in names.items() if p in muon_opt.state)
    ref_names = dict(ref_model.named_parameters())
    f32_names = dict(f32_model.named_parameters())
    assert muon_names == sorted(n for n, p in ref_names.items() if "momentum_buffer" in ref_opt.state[p])

    def params(named: dict) -> dict:
        return {n: p.detach().double() for n, p in named.items()}

    ref = params(ref_names)

    def update_error(got: dict, over=tuple(ref)) -> float:
        num = sum(float(((got[n] - init[n]) - (ref[n] - init[n])).norm() ** 2) for n in over)
        den = sum(float((ref[n] - init[n]).norm() ** 2) for n in over)
        return (num / den) ** 0.5

    core_params, f32_params = params(names), params(f32_names)
    core_bufs = {n: muon_opt.state[names[n]]["momentum_buffer"].double() for n in muon_names}
    ref_bufs = {n: ref_opt.state[ref_names[n]]["momentum_buffer"] for n in muon_names}
    f32_bufs = {n: f32_opt.state[f32_names[n]]["momentum_buffer"].double() for n in muon_names}
    return dict(
        norms=norms, muon_params=muon_names,
        param_error=_errors(core_params, ref), update_error=update_error(core_params),
        muon_update_error=update_error(core_params, muon_names),  # AdamW's params left out
        momentum_error=_errors(core_bufs, ref_bufs),
        fp32_param_error=_errors(f32_params, ref), fp32_update_error=update_error(f32_params),
        fp32_muon_update_error=update_error(f32_params, muon_names),
        fp32_momentum_error=_errors(f32_bufs, ref_bufs),
        update_size=max(float((ref[n] - init[n]).abs().max()) for n in ref),
    )


def run_blockwise_tp2(case: dict, steps: int = 3) -> dict:
    """TP 2 blockwise without a second process: in blockwise mode a TP rank's TensorParallelMuon
    orthogonalises its own shard and talks to no one, so megatron-core's TensorParallelMuon stepped on
    the two ranks' shards (as separate params) is what the two ranks compute. Compared with the
    reference on the whole tensors given tp_size 2, and (as a control) tp_size 1."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    split = rm.qkv_split_shapes(num_attention_heads=4, num_query_groups=2, kv_channels=8)
    gen = torch.Generator().manual_seed(5)
    # name: (whole shape, partition_dim) as megatron-core's column / row parallel linears tag them
    layout = {"linear_qkv.weight": ((2 * sum(split), 32), 0), "linear_proj.weight": ((32, 32), 1),
              "linear_fc1.weight": ((128, 32), 0), "linear_fc2.weight": ((32, 128), 1)}
    wholes = {n: torch.randn(shape, generator=gen, dtype=torch.float64) for n, (shape, _) in layout.items()}
    grads = [{n: torch.randn(w.shape, generator=gen, dtype=torch.float64) for n, w in wholes.items()}
             for _ in range(steps)]

    shards = {}
    for n, (_, dim) in layout.items():
        for rank, block in enumerate(wholes[n].float().chunk(2, dim=dim)):
            p = torch.nn.Parameter(block.clone())
            p.partition_dim, p.tensor_model_parallel = dim, True
            p.is_qkv = n == "linear_qkv.weight"
            shards[(n, rank)] = p
    core = TensorParallelMuon(
        list(shards.values()), lr=LR, momentum=MOMENTUM, nesterov=case["nesterov"], weight_decay=WD,
        split_qkv=case["split_qkv"], is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=list(split),
        fp32_matmul_prec="highest", num_ns_steps=5, scale_mode=case["scale_mode"],
        extra_scale_factor=case["extra_scale"], pg_collection=None, tp_mode="blockwise")

    def reference_run(tp_size: int) -> dict:
        params = {n: torch.nn.Parameter(w.clone()) for n, w in wholes.items()}
        matrices = {p: rm.MuonMatrix(qkv_split_shapes=tuple(split) if n == "linear_qkv.weight" else None,
                                     tp_size=tp_size, partition_dim=layout[n][1]) for n, p in params.items()}
        opt = rm.ReferenceMuon([dict(params=list(params.values()), muon=True)], matrices, LR, WD,
                               momentum=MOMENTUM, nesterov=case["nesterov"], scale_mode=case["scale_mode"],
                               extra_scale_factor=case["extra_scale"], split_qkv=case["split_qkv"],
                               tp_mode="blockwise")
        for g in grads:
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
        return {n: p.detach() for n, p in params.items()}

    for g in grads:
        for (n, rank), p in shards.items():
            p.grad = g[n].float().chunk(2, dim=layout[n][1])[rank].contiguous()
        core.step()
    got = {n: torch.cat([shards[(n, r)].detach().double() for r in range(2)], dim=dim)
           for n, (_, dim) in layout.items()}
    ref_tp2, ref_tp1 = reference_run(2), reference_run(1)
    return dict(error=_errors(got, ref_tp2), error_vs_tp1=_errors(got, ref_tp1),
                update_size=max(float((ref_tp2[n] - wholes[n]).abs().max()) for n in wholes))
