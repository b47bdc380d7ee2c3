"""Worker-side harness: megatron_opt's sharded Muon on megatron-core's GPTModel split by tensor (+sequence)
and pipeline parallelism (1F1B and interleaved), trained through megatron-core's schedule and
finalize_model_grads with megatron-core's DDP + optimizer names (megatron_opt's after install()), against
tests/support/reference_muon.py in float64 on the whole model and the same global batches.

``run_muon(layout_name, steps, **options)`` is the entry point (every rank of a 4-rank pool calls it;
other helpers reuse it): it returns this rank's figures, per step: the relative error of the params (to
the reference's change since the start), of the Muon momentum buffers, and of the grad norm; the
replica checks (DP replicas, TP copies of replicated params, the tied embedding: bitwise equal) after
the last step. The model machinery (layouts, TP slices of the reference's weights, the schedule) is
tests/mcore/cases_model_parallel.py's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tests.mcore import cases_model_parallel as cmp
from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core, token_losses
from tests.support import reference_adaptive_muon as ram
from tests.support import reference_muon as rm
from tests.support.common import whole_from_parts

import megatron.core.distributed as core_distributed  # noqa: E402
import megatron.core.optimizer as core_optimizer  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import megatron_opt as mo
import megatron_opt.megatron
from tests.mcore.cases_megatron import forward_step, global_batches

LR, MIN_LR, WD, CLIP = 3e-3, 3e-4, 0.1, 0.5
MOMENTUM = 0.9  # Megatron-LM's --muon-momentum default
HEADS, GROUPS, KV = 4, 2, 8  # grouped-query attention: at TP 2 each rank holds one query group
SPLIT = rm.qkv_split_shapes(HEADS, GROUPS, KV)  # (16, 8, 8) rows of Q, K, V per group

# 4 ranks each: DP = 4 / (tp * pp).
LAYOUTS = {
    "dp4": cmp.Layout(),
    "tp2": cmp.Layout(tp=2),
    "tp2_sp": cmp.Layout(tp=2, sp=True),
    # SwiGLU: fc1's TP block is [gate_r; up_r] (partition_stride 2), so its TP gather is a row permutation of
    # the model's [gate; up] (Newton-Schulz is equivariant to it). Not blockwise: the reference's blockwise
    # cuts the whole tensor into contiguous chunks, which is not a strided param's block.
    "tp2_glu": cmp.Layout(tp=2, glu=True),
    "pp2": cmp.Layout(pp=2),
    "pp2_vp2": cmp.Layout(pp=2, vp=2, layers=4),
}


def schedule(global_batch: int) -> dict:
    """Samples-counted warm-up from lr/4 over 2 steps then cosine decay: every step moves the params."""
    return dict(init_lr=LR / 4, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2 * global_batch,
                lr_decay_steps=20 * global_batch, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                wd_incr_steps=20 * global_batch, wd_incr_style="constant")


def transformer_config(layout: cmp.Layout, whole: bool = False):
    return dataclasses.replace(cmp.transformer_config(layout, True, torch.float32, whole=whole),
                               num_query_groups=GROUPS)


def _tag_qkv(model: torch.nn.Module) -> None:
    """megatron_opt reads the QKV split from the param (rows of Q, K, V in one query group)."""
    for name, p in model.named_parameters():
        if name.endswith("linear_qkv.weight"):
            p.qkv_split_shapes = SPLIT


# ----------------------------------------------------------------------------- the float64 reference
def _train_reference(layout: cmp.Layout, steps: list, dp: int, global_batch: int, options: dict) -> dict:
    """The whole TP1/PP1 model in float64 with ReferenceMuon (tp_size / tp_mode as the layout's), per step
    the params, the momentum buffers and the grad norm."""
    model = mcore_cpu.build_gpt(transformer_config(layout, whole=True), tied=True)
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ref = mcore_cpu.clone_gpt(model).to(torch.float64)
    common = dict(tp_size=layout.tp, split_shapes=SPLIT, momentum=MOMENTUM, nesterov=options["nesterov"],
                  tp_mode=options["tp_mode"], adam_betas=(0.9, 0.999), adam_eps=1e-8)
    if options["optimizer"] == "adaptive_muon":
        opt = ram.reference_adaptive_muon(ref, LR, WD, moment2_method=options["moment2_method"], **common)
    else:
        opt = rm.reference_muon(ref, LR, WD, **common)
    sched = CoreScheduler(opt, **schedule(global_batch))
    named = dict(ref.named_parameters())
    out = {"init": init, "params": [], "momentum": [], "norms": [], "moment2_blocks": []}
    for k, batches in enumerate(steps):
        if k == options["nonfinite_at"]:  # the skipped step: nothing changes, the scheduler does not advance
            for key in ("params", "momentum"):
                out[key].append(out[key][-1] if out[key] else None)
            out["norms"].append(None)
            continue
        opt.zero_grad()
        total = sum(int(b["loss_mask"].sum()) for b in batches)
        loss = sum((token_losses(ref, b).double() * b["loss_mask"]).sum() for b in batches) / total
        loss.backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        sched.step(increment=global_batch)
        out["params"].append({n: p.detach().clone() for n, p in named.items()})
        out["momentum"].append({n: opt.state[p]["momentum_buffer"].clone() for n, p in named.items()
                                if "momentum_buffer" in opt.state[p]})
        out["moment2_blocks"].append({n: [v.clone() for v in opt.state[p]["moment2_blocks"]]
                                      for n, p in named.items() if "moment2_blocks" in opt.state[p]})
    return out


def _reference(layout: cmp.Layout, steps: list, dp: int, global_batch: int, options: dict) -> dict:
    return cmp.computed_on_rank0(_train_reference, layout, steps, dp, global_batch, options)


# ----------------------------------------------------------------------------- megatron_opt's Muon
def _setup(chunks: list, config, global_batch: int, options: dict):
    """Megatron-LM's setup_model_and_optimizer through megatron-core's names (megatron_opt's after install())."""
    overlap = options["overlap"]
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                               use_distributed_optimizer=True, bucket_size=options["bucket_size"] if overlap else None)
    ddps = [core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                                     disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)]
    muon = dict(optimizer=options["optimizer"], lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=0.9,
                adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True, muon_momentum=MOMENTUM,
                muon_tp_mode=options["tp_mode"], muon_fp32_matmul_prec=options["matmul_prec"],
                muon_split_qkv=True, muon_num_ns_steps=5, muon_scale_mode="spectral")
    if options["optimizer"] == "adaptive_muon":
        muon["adaptive_muon_moment2_method"] = options["moment2_method"]
    fields = {f.name for f in dataclasses.fields(core_optimizer.OptimizerConfig)}
    if options["verify"] or not set(muon) <= fields:
        # verify mode is megatron_opt's own OptimizerConfig field; megatron-core 0.16.1 has no adaptive_muon_* fields
        opt_config = mo.OptimizerConfig(**muon, muon_nesterov=options["nesterov"],
                                        verify_interval=int(options["verify"]))
    else:  # megatron-core 0.16.1 names it muon_use_nesterov
        nesterov = "muon_nesterov" if "muon_nesterov" in fields else "muon_use_nesterov"
        opt_config = core_optimizer.OptimizerConfig(**muon, **{nesterov: options["nesterov"]})
    with cpu_megatron_core():
        opt = core_optimizer.get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=True)
    cmp.wire_loop(config, ddps, opt, overlap)
    return ddps, opt, CoreScheduler(opt, **schedule(global_batch))


def _momentum_by_param(opt, ddps: list) -> dict:
    """Each local Muon param's whole (TP-local) momentum buffer, from every DP rank's state_dict part."""
    parts = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(parts, opt.state_dict()["state"].get("momentum_buffer", {}),
                           group=parallel_state.get_data_parallel_group())
    return whole_by_param(ddps, lambda p: parts)


def whole_by_param(ddps: list, parts_of) -> dict:
    """{id(param): its whole (TP-local) tensor} for each local param that ``parts_of(param)`` (state_dict
    parts of the ranks that together own it) holds, keyed as the state_dict keys it."""
    out = {}
    for c, ddp in enumerate(ddps):
        for name, p in ddp.module.named_parameters():
            key = name if len(ddps) == 1 else f"chunk{c}.{name}"
            parts = [part for part in parts_of(p) if key in part]
            if parts:
                out[id(p)] = whole_from_parts(parts, {key: tuple(p.shape)})[key]
    return out


def _snapshot(ddps: list, opt) -> list:
    """This rank's params and optimizer state, as bytes (bitwise comparison)."""
    state = opt.state_dict()["state"]
    return ([p.detach().double().numpy().tobytes() for ddp in ddps for p in ddp.module.parameters()] +
            [v["values"].numpy().tobytes() for name in sorted(state) for _, v in sorted(state[name].items())])


def _relative(pairs) -> float:
    """sqrt(sum |a - b|^2 / sum |b|^2) over (a, b) pairs, each counted once in the world."""
    sums = torch.zeros(2, dtype=torch.float64)
    for a, b in pairs:
        sums += torch.stack([(a - b).norm() ** 2, b.norm() ** 2])
    dist.all_reduce(sums)
    return float((sums[0] / sums[1]).sqrt())


def _counted(chunks: list, whole: dict) -> list:
    """(reference name, param) of the elements this rank counts (once in the world)."""
    return [(ref, p) for chunk in chunks for ref, p, counted in cmp.chunk_params(chunk, whole)
            if counted and parallel_state.get_data_parallel_rank() == 0]


def run_muon(layout_name: str, steps: int = 3, tp_mode: str = "blockwise", overlap: bool = True,
             nesterov: bool = False, matmul_prec: str = "highest", verify: bool = False, ga: int = 2, mb: int = 2,
             bucket_size: int = 4000, nonfinite_at: Optional[int] = None,
             inspect: Optional[Callable[[dict], dict]] = None, optimizer: str = "muon",
             moment2_method: str = "adamuon") -> dict:
    """Train ``steps`` steps of megatron_opt's Muon in the named layout (LAYOUTS, 4 ranks) and the float64
    reference on the same global batches; this rank's per-step figures (the same on every rank) and
    replica checks. ``tp_mode``: muon_tp_mode (also the reference's); ``overlap``: overlap_grad_reduce and
    overlap_param_gather; ``verify``: verify mode every step (the float64 recomputation of the update);
    ``nonfinite_at``: at that step the last rank (the last pipeline stage) puts a NaN into one of its
    reduced gradients, so every rank must skip it (the reference skips it too); ``inspect``: a module-level
    function (it travels to the workers by name) called after the last step, inside the layout's
    parallel state, with {"layout", "chunks", "ddps", "optimizer", "reference", "step_batches"}; the dict it
    returns is merged into the figures (e.g. a checkpoint round trip, megatron-core's own Muon);
    ``optimizer`` 'adaptive_muon' with ``moment2_method``: AdaptiveMuon instead, against its reference."""
    options = dict(tp_mode=tp_mode, overlap=overlap, nesterov=nesterov, matmul_prec=matmul_prec, verify=verify,
                   bucket_size=bucket_size, nonfinite_at=nonfinite_at, optimizer=optimizer,
                   moment2_method=moment2_method)
    layout = LAYOUTS[layout_name]
    if layout.glu and tp_mode == "blockwise":
        raise ValueError("run_muon: the reference has no blockwise mode for a strided (SwiGLU) param")
    mcore_cpu.init_parallel_state()
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    step_batches = global_batches(steps, dp, ga, mb)
    global_batch = dp * ga * mb
    reference = _reference(layout, step_batches, dp, global_batch, options)
    init = reference["init"]
    out = {"param": [], "momentum": [], "norm": [], "success": [], "verified": None, "skipped_changed": []}
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        megatron_opt.megatron.install()
        try:
            config = transformer_config(layout)
            chunks = cmp.build_chunks(layout, config, init)
            for chunk in chunks:
                _tag_qkv(chunk)
            ddps, opt, sched = _setup(chunks, config, global_batch, options)
            counted = _counted(chunks, init)
            dp_rank = parallel_state.get_data_parallel_rank()
            for k, batches in enumerate(step_batches):
                mine = batches[dp_rank * ga:(dp_rank + 1) * ga]
                for ddp in ddps:
                    ddp.zero_grad_buffer()
                opt.zero_grad()
                data = [iter(mine) for _ in ddps] if len(ddps) > 1 else iter(mine)
                get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=ddps,
                                            num_microbatches=ga, seq_length=mcore_cpu.SEQ, micro_batch_size=mb,
                                            decoder_seq_length=None, forward_only=False)
                if k == nonfinite_at:
                    before = _snapshot(ddps, opt)
                    if dist.get_rank() == dist.get_world_size() - 1:
                        for ddp in ddps:
                            ddp.finish_grad_sync()
                        shard = next(s for ddp in ddps for s in ddp.local_shards() if s.pieces)
                        shard.grad[shard.pieces[0].shard_range.start] = float("nan")
                success, norm, _ = opt.step()
                out["success"].append(bool(success))
                if not success:
                    out["skipped_changed"].append(_snapshot(ddps, opt) != before)
                    continue
                sched.step(increment=global_batch)  # Megatron-LM's train_step: only after a successful update
                for ddp in ddps:  # the overlapped all-gather (the next forward's pre-hooks would wait for it)
                    ddp.finish_param_sync()
                ref_params, ref_momentum = reference["params"][k], reference["momentum"][k]
                out["norm"].append(abs(float(norm) - reference["norms"][k]) / reference["norms"][k])
                out["param"].append(_relative(
                    (p.detach().double() - cmp.shard_of(init[ref], p), cmp.shard_of(ref_params[ref] - init[ref], p))
                    for ref, p in counted))
                if k == 0:  # diagnostics: this rank's error per param after the first step
                    out["first_step_by_param"] = {
                        ref: float(((p.detach().double() - cmp.shard_of(ref_params[ref], p)).norm()
                                    / cmp.shard_of(ref_params[ref] - init[ref], p).norm()))
                        for ref, p in counted}
                momentum = _momentum_by_param(opt, ddps)
                out["momentum"].append(_relative((momentum[id(p)], cmp.shard_of(ref_momentum[ref], p))
                                                 for ref, p in counted if ref in ref_momentum))
            out.update(cmp.replica_checks(layout, chunks, init))
            out["muon_params"] = sorted({ref for ref, p in counted if ref in reference["momentum"][0]})
            if moment2_method == "normuon" and optimizer == "adaptive_muon":
                out.update(_homed_moment2_error(chunks, ddps, opt, init, reference["moment2_blocks"][-1]))
            out["optimizer_module"] = type(opt).__module__
            if verify:
                out["verified"] = opt.verify_report.verified_steps
            if inspect is not None:
                out.update(inspect(dict(layout=layout, chunks=chunks, ddps=ddps, optimizer=opt, reference=reference,
                                        step_batches=step_batches)))
        finally:
            megatron_opt.megatron.uninstall()
    return out


def _homed_moment2_error(chunks: list, ddps: list, opt, init: dict, blocks: dict) -> dict:
    """NorMuon's per-matrix second moment at this rank's homes against the reference's, block by block (a TP-split
    matrix's block is this rank's TP block): the worst relative error and the homed (reference name, TP rank)."""
    ref_of = {id(p): ref for chunk in chunks for ref, p, _ in cmp.chunk_params(chunk, init)}
    by_key = {(name if len(ddps) == 1 else f"chunk{c}.{name}"): p
              for c, ddp in enumerate(ddps) for name, p in ddp.module.named_parameters()}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    worst, homed = 0.0, []
    for key, v in opt.state_dict().get("matrix_state", {}).get("moment2_buffer", {}).items():
        p = by_key[key]
        ref_blocks = blocks[ref_of[id(p)]]
        theirs = ref_blocks[tp_rank] if len(ref_blocks) > 1 else ref_blocks[0]
        assert tuple(v.shape) == tuple(theirs.shape), (key, v.shape, theirs.shape)
        worst = max(worst, float((v.double() - theirs).norm() / theirs.norm()))
        homed.append((ref_of[id(p)], tp_rank))
    return {"moment2_error": worst, "moment2_homed": homed}


__all__ = ["LAYOUTS", "run_muon", "SPLIT"]
