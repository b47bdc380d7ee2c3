"""Worker-side cases: megatron_opt's sharded Muon against megatron-core's OWN Muon on the same megatron-core
GPTModel harness (megatron-core's DDP, schedule and finalize_model_grads), both against the float64
reference (tests/support/reference_muon.py) on the same global batch.

megatron-core's Muon is the calibration: ``get_megatron_optimizer(OptimizerConfig(optimizer="muon",
use_distributed_optimizer=False))`` over a DDP without the distributed optimizer, i.e. a ChainedOptimizer of
TensorParallelMuon + AdamW (megatron-core 0.19.2, emerging-optimizers 0.3.0). Its distance from float64 is
what an fp32 Muon on this harness reaches; megatron_opt's (the same call after ``install()``, with
``use_distributed_optimizer=True`` and overlapped reduce-scatter / all-gather) must stay within a small
multiple of it, and close to megatron-core's directly.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from tests.mcore import cases_model_parallel as cmp
from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core, token_losses
from tests.support import reference_muon as rm

import megatron.core.distributed as core_distributed  # noqa: E402
import megatron.core.optimizer as core_optimizer  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402

import megatron_opt.megatron

LR, MIN_LR, WD, CLIP = 3e-3, 3e-4, 0.1, 1.0
MOMENTUM = 0.9  # Megatron-LM's --muon-momentum default
HEADS, GROUPS, KV = 4, 2, 8  # grouped-query attention: the QKV split [16, 8, 8] is not three thirds
SPLIT = rm.qkv_split_shapes(HEADS, GROUPS, KV)
IMPLEMENTATIONS = ("megatron_core", "megatron_opt")


def schedule(global_batch: int) -> dict:
    """Megatron-LM counts in samples: warm up from 5e-4 over 2 steps, cosine decay over 10; every step
    moves the params, at changing lr."""
    return dict(init_lr=5e-4, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2 * global_batch,
                lr_decay_steps=10 * global_batch, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                wd_incr_steps=10 * global_batch, wd_incr_style="constant")


def transformer_config(tp: int, whole: bool) -> "cmp.TransformerConfig":
    layout = cmp.Layout(tp=tp)
    return dataclasses.replace(cmp.transformer_config(layout, True, torch.float32, whole=whole),
                               num_query_groups=GROUPS)


def optimizer_config(case: dict, distributed: bool) -> core_optimizer.OptimizerConfig:
    return core_optimizer.OptimizerConfig(
        optimizer="muon", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, muon_momentum=MOMENTUM, muon_nesterov=case["nesterov"], muon_split_qkv=case["split_qkv"],
        muon_scale_mode=case["scale_mode"], muon_extra_scale_factor=case["extra_scale"],
        muon_num_ns_steps=case["ns_steps"], muon_fp32_matmul_prec=case["matmul_prec"],
        muon_tp_mode=case.get("tp_mode", "blockwise"), use_distributed_optimizer=distributed,
        log_num_zeros_in_grad=True)


# ----------------------------------------------------------------------------- float64 reference
class MuonReference:
    """One process, the whole model in ``dtype``, the whole global batch, ReferenceMuon + megatron-core's scheduler."""

    def __init__(self, model, case: dict, tp: int, global_batch: int, dtype: torch.dtype) -> None:
        self.model = mcore_cpu.clone_gpt(model).to(dtype)
        self.dtype = dtype
        # The TP attributes of the whole model's params say nothing about the split model: describe each
        # param as the split model's layer does (partition_dim from megatron-core's column/row layers).
        self.opt = rm.reference_muon(
            self.model, LR, WD, tp_size=tp, split_shapes=SPLIT, momentum=MOMENTUM, nesterov=case["nesterov"],
            num_ns_steps=case["ns_steps"], scale_mode=case["scale_mode"], extra_scale_factor=case["extra_scale"],
            split_qkv=case["split_qkv"], tp_mode=case.get("tp_mode", "blockwise"), adam_betas=(0.9, 0.95),
            adam_eps=1e-8)
        self.sched = CoreScheduler(self.opt, **schedule(global_batch))
        self.global_batch = global_batch

    def step(self, batches: list[dict]) -> tuple[float, float, int]:
        """(grad norm, per-token loss, zero count) of one step on the global batch."""
        self.opt.zero_grad()
        total = sum(int(b["loss_mask"].sum()) for b in batches)
        loss = sum((token_losses(self.model, b).to(self.dtype) * b["loss_mask"]).sum() for b in batches) / total
        loss.backward()
        zeros = sum(int((p.grad == 0).sum()) for p in self.model.parameters() if p.grad is not None)
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP))
        self.opt.step()
        self.sched.step(increment=self.global_batch)
        return norm, float(loss.detach()), zeros

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().double().clone() for n, p in self.model.named_parameters()}

    def momentum(self) -> dict[str, torch.Tensor]:
        return {n: self.opt.state[p]["momentum_buffer"].double().clone() for n, p in self.model.named_parameters()
                if "momentum_buffer" in self.opt.state.get(p, {})}


def _reference(case: dict, tp: int, steps: list, global_batch: int) -> dict:
    """Rank 0 builds the whole model and trains the float64 (and the fp32) reference; every rank gets the
    weights, momenta and per-step figures (a broadcast, so every rank agrees)."""
    return cmp.computed_on_rank0(_train_reference, case, tp, steps, global_batch)


def _train_reference(case: dict, tp: int, steps: list, global_batch: int) -> dict:
    model = mcore_cpu.build_gpt(transformer_config(tp, whole=True), tied=True)
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    runs = {dtype: MuonReference(model, case, tp, global_batch, dtype) for dtype in (torch.float64, torch.float32)}
    figures = {dtype: [run.step(batches) for batches in steps] for dtype, run in runs.items()}
    return {"init": init, "final": runs[torch.float64].params(), "momentum": runs[torch.float64].momentum(),
            "fp32_final": runs[torch.float32].params(), "fp32_momentum": runs[torch.float32].momentum(),
            "norms": [f[0] for f in figures[torch.float64]], "losses": [f[1] for f in figures[torch.float64]],
            "zeros": [f[2] for f in figures[torch.float64]]}


# ----------------------------------------------------------------------------- the two implementations
def _tag_qkv(chunks: list) -> None:
    """What megatron-core's get_megatron_optimizer does for its Muon: ``linear_qkv.weight`` carries the
    rows of Q, K and V of one query group (megatron_opt reads the same attribute)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if "linear_qkv.weight" in name and p.shape[0] % sum(SPLIT) == 0:
                p.qkv_split_shapes = SPLIT


def setup(impl: str, case: dict, chunks: list, config, global_batch: int):
    """Megatron-LM's setup_model_and_optimizer through megatron-core's names: megatron-core's own
    (non-distributed DDP and Muon) or megatron_opt's after install() (distributed optimizer, overlap)."""
    ours = impl == "megatron_opt"
    overlap = ours or case.get("core_overlap", False)
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=ours,
                               use_distributed_optimizer=ours,
                               bucket_size=case.get("bucket_size", 4000) if ours else None)
    ddps = [core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks]
    if ours:
        _tag_qkv(chunks)
    with cpu_megatron_core():
        opt = core_optimizer.get_megatron_optimizer(optimizer_config(case, ours), ddps, use_gloo_process_groups=True)
    config.no_sync_func = ddps[0].no_sync
    if overlap:
        config.grad_sync_func = ddps[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return ddps, opt, CoreScheduler(opt, **schedule(global_batch))


def _gather_sharded_momentum(opt, shapes: dict) -> dict[str, torch.Tensor]:
    """megatron_opt's ``momentum_buffer`` in model space: every rank's owned pieces (state_dict's
    per-param ranges), assembled over the data-parallel group."""
    state = opt.state_dict()["state"].get("momentum_buffer", {})
    group = parallel_state.get_data_parallel_group()
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: (int(v["start"]), v["values"].double()) for k, v in state.items()}, group=group)
    out = {}
    for name, shape in shapes.items():
        full = torch.full((int(torch.Size(shape).numel()),), float("nan"), dtype=torch.float64)
        for part in parts:
            if name in part:
                start, values = part[name]
                full[start:start + values.numel()] = values
        out[name] = full.view(shape)
    return out


def _core_momentum(opt, chunks: list) -> dict[str, torch.Tensor]:
    muon = opt.chained_optimizers[0].optimizer
    assert type(muon).__name__ == "TensorParallelMuon", type(muon)
    return {n: muon.state[p]["momentum_buffer"].double().clone() for chunk in chunks
            for n, p in chunk.named_parameters() if "momentum_buffer" in muon.state.get(p, {})}


def momentum(impl: str, opt, chunks: list) -> dict[str, torch.Tensor]:
    """This rank's TP slice of every Muon param's momentum, by the chunk's param name."""
    if impl == "megatron_core":
        return _core_momentum(opt, chunks)
    shapes = {n: tuple(p.shape) for chunk in chunks for n, p in chunk.named_parameters() if rm.uses_muon(p)}
    return _gather_sharded_momentum(opt, shapes)


# ----------------------------------------------------------------------------- figures
def _update_error(got: dict, want: dict, init: dict, names) -> float:
    num = sum(float(((got[n] - init[n]) - (want[n] - init[n])).norm() ** 2) for n in names)
    den = sum(float((want[n] - init[n]).norm() ** 2) for n in names)
    return (num / den) ** 0.5


def _max_rel(got: dict, want: dict) -> float:
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)


def figures(params: dict, moms: dict, init: dict, final: dict, final_moms: dict, muon_names: list) -> dict:
    """Distances of (params, momenta) from (final, final_moms), all tensors of this rank's TP slices."""
    return dict(update_error=_update_error(params, final, init, list(final)),
                muon_update_error=_update_error(params, final, init, muon_names),
                param_abs=max(float((params[n] - final[n]).abs().max()) for n in final),
                momentum_rel=_max_rel({n: moms[n] for n in final_moms}, final_moms))


def run(case: dict, steps: int = 4, ga: int = 2, mb: int = 2) -> dict:
    """``steps`` steps of the same global batches with megatron-core's Muon and megatron_opt's at the case's
    layout (``tp``; the rest of the world is data parallel); per implementation: per-step loss, grad norm
    and zero count, and the distances from float64 (whole model) and from each other."""
    tp = case.get("tp", 1)
    mcore_cpu.init_parallel_state()
    dp = dist.get_world_size() // tp
    step_batches = cmp.global_batches(steps, dp, ga, mb)
    ref = _reference(case, tp, step_batches, dp * ga * mb)
    out = {"reference": {k: ref[k] for k in ("norms", "losses", "zeros")}}
    results = {}
    with mcore_cpu.model_parallel_state(tensor_model_parallel_size=tp), cpu_megatron_core():
        for impl in case.get("impls", IMPLEMENTATIONS):
            with contextlib.ExitStack() as stack:
                if impl == "megatron_opt":
                    megatron_opt.megatron.install()
                    stack.callback(megatron_opt.megatron.uninstall)
                config = transformer_config(tp, whole=False)
                chunks = cmp.build_chunks(cmp.Layout(tp=tp), config, ref["init"])
                ddps, opt, sched = setup(impl, case, chunks, config, dp * ga * mb)
                losses, norms, zeros = cmp.train(ddps, opt, sched, step_batches, True, ga, mb)
                named = [(ref_name, p) for chunk in chunks for ref_name, p, _ in cmp.chunk_params(chunk, ref["init"])]
                params = {n: p.detach().double().clone() for n, p in named}
                moms = momentum(impl, opt, chunks)  # chunk names = reference names at PP 1
                results[impl] = (params, moms)
                out[impl] = {"losses": losses, "norms": norms, "zeros": zeros,
                             "optimizer": type(opt).__module__ + "." + type(opt).__name__,
                             "muon_params": sorted(moms)}
        # Everything as this rank's TP slices of the whole reference tensors.
        shard = {n: cmp.shard_of(t, p) for n, p in named for t in [ref["init"][n]]}
        final = {n: cmp.shard_of(ref["final"][n], p) for n, p in named}
        fp32_final = {n: cmp.shard_of(ref["fp32_final"][n], p) for n, p in named}
        ref_moms = {n: cmp.shard_of(ref["momentum"][n], p) for n, p in named if n in ref["momentum"]}
        fp32_moms = {n: cmp.shard_of(ref["fp32_momentum"][n], p) for n, p in named if n in ref["fp32_momentum"]}
    muon_names = sorted(ref_moms)
    out["fp32_torch"] = figures(fp32_final, fp32_moms, shard, final, ref_moms, muon_names)
    for impl, (params, moms) in results.items():
        out[impl].update(figures(params, moms, shard, final, ref_moms, muon_names))
    if len(results) == 2:
        (core_p, core_m), (ours_p, ours_m) = results["megatron_core"], results["megatron_opt"]
        out["ours_vs_core"] = figures(ours_p, ours_m, shard, core_p, {n: core_m[n] for n in muon_names}, muon_names)
    out["reference_muon_params"] = muon_names
    return out
