"""Worker-side cases: checkpoints of megatron_opt's Muon (optimizer='muon' through install(): a
ChainedOptimizer of a Muon child, whose state is ``momentum_buffer``, and an AdamW child, ``exp_avg`` and
``exp_avg_sq``, over the same buffers) on megatron-core's GPTModel.

Formats: Megatron-LM's torch_dist (``optimizer.sharded_state_dict(model_sd, metadata=
{'distrib_optim_sharding_type': 'fully_reshardable' | 'dp_reshardable'})`` with
megatron.core.dist_checkpointing, then ``optimizer.load_state_dict``) and megatron_opt.checkpoint.

What the tests compare is the optimizer state in model space, assembled by
tests/mcore/cases_checkpoint_model_parallel.model_space_state from each rank's ``optimizer.state_dict()``
(the public per-param accessor) over the data-parallel group, TP slices placed by the reference naming:
masters, momentum_buffer, exp_avg, exp_avg_sq, the params and the update counts.

The global batch is the same at every data-parallel size (GLOBAL micro-batches of one sample, split
over the DP ranks), so a run at DP 2, 3 or 1 trains on the same samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.mcore import cases_checkpoint_mcore as cc
from tests.mcore import cases_checkpoint_model_parallel as ccmp
from tests.mcore import cases_model_parallel as cmp
from tests.mcore import mcore_cpu
from tests.mcore.cases_megatron import CLIP, LR, MIN_LR, WD, forward_step, global_batches, schedule  # noqa: F401
from tests.mcore.mcore_cpu import cpu_megatron_core
from tests.support import reference_muon as rm

import megatron.core.distributed as core_distributed  # noqa: E402
import megatron.core.optimizer as core_optimizer  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402

import megatron_opt.checkpoint
import megatron_opt as mo
import megatron_opt.megatron

LAYOUTS = {"dp": cmp.Layout(), "tp2": cmp.Layout(tp=2)}
STATES = ("master", "momentum_buffer", "exp_avg", "exp_avg_sq")
GLOBAL, MB = 6, 1  # six one-sample micro-batches per step: ga = 6 / DP at DP 1, 2, 3
TORCH_DIST = {"fully_reshardable": "fully_reshardable", "dp_reshardable": "dp_reshardable"}
FOLDERS = {"layer_wise_as_dp_reshardable": ("layer_wise", "dp_reshardable")}  # a folder read as another format
FORMATS = (*TORCH_DIST, "megatron_opt")


def _sizes(layout_name: str) -> tuple[cmp.Layout, int, int]:
    layout = LAYOUTS[layout_name]
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    return layout, dp, GLOBAL // dp


@contextlib.contextmanager
def _installed(layout: cmp.Layout):
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        megatron_opt.megatron.install()
        try:
            yield
        finally:
            megatron_opt.megatron.uninstall()


def _mark_qkv(chunk: Any, config: Any) -> None:
    """megatron-core's Muon splits linear_qkv.weight into Q, K and V per query group; megatron_opt reads the
    split from the param (``qkv_split_shapes``: rows of one query group, the same on every TP rank)."""
    split = rm.qkv_split_shapes(config.num_attention_heads, config.num_query_groups or config.num_attention_heads,
                                config.kv_channels)
    for name, param in chunk.named_parameters():
        if name.endswith("linear_qkv.weight"):
            param.qkv_split_shapes = split


def build(layout_name: str, whole: dict, tp_mode: str = "blockwise", optimizer: str = "muon",
          **extra: Any) -> tuple:
    """Megatron-LM's setup_model_and_optimizer with --optimizer muon, through megatron-core's names (inside
    _installed), from the whole model's weights ``whole`` (built outside it: megatron-core's layers take
    their TP split from parallel_state): (chunks, ddps, opt, sched, whole). ``extra``: more OptimizerConfig
    fields."""
    layout, dp, _ = _sizes(layout_name)
    config = cmp.transformer_config(layout, True, torch.float32)
    chunks = cmp.build_chunks(layout, config, whole)
    for chunk in chunks:
        _mark_qkv(chunk, config)
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True,
                               use_distributed_optimizer=True, bucket_size=None)
    ddps = [core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks]
    # megatron_opt's own settings (rule_constants), and fields an older megatron-core lacks (0.16.1: adaptive_muon_*),
    # need its OptimizerConfig, which install()'s factory takes too
    core_fields = {f.name for f in dataclasses.fields(core_optimizer.OptimizerConfig)}
    config_type = core_optimizer.OptimizerConfig if set(extra) <= core_fields else mo.OptimizerConfig
    opt_config = config_type(
        optimizer=optimizer, lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, use_distributed_optimizer=True, muon_momentum=0.9, muon_tp_mode=tp_mode,
        muon_fp32_matmul_prec="highest", log_num_zeros_in_grad=True, **extra)
    with cpu_megatron_core():
        opt = core_optimizer.get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=True)
    cmp.wire_loop(config, ddps, opt, overlap=True)  # one chunk in every layout here
    return chunks, ddps, opt, CoreScheduler(opt, **schedule(GLOBAL * MB)), whole


def plan(steps: int) -> list[list[dict]]:
    """``steps`` global batches of GLOBAL one-sample micro-batches (the same at every DP size)."""
    return global_batches(steps, 1, GLOBAL, MB)


def train(layout_name: str, ddps: list, opt: Any, sched: Any, batches: list) -> list:
    """Megatron-LM's train_step per global batch; the per-step loss (None off the last stage). With
    overlap_param_gather the last step's all-gather is waited for (the next forward would)."""
    _, _, ga = _sizes(layout_name)
    for ddp in ddps:  # cmp.train removes the forward pre-hooks at its end (as Megatron-LM around a save)
        if not ddp.remove_forward_pre_hook_handles:
            ddp.enable_forward_pre_hook()
    losses, _, _ = cmp.train(ddps, opt, sched, batches, True, ga, MB)
    return losses


def state(opt: Any, chunks: list, whole: dict, layout_name: str) -> Optional[dict]:
    """The optimizer state and params in model space on rank 0 (None elsewhere), with whether every DP
    replica holds bitwise the same params (a collective)."""
    layout = LAYOUTS[layout_name]
    replicas = cmp.replica_checks(layout, chunks, whole)
    out = model_space_state(opt, chunks, whole)
    if out is not None:
        out["replicas"] = replicas
    return out


def model_space_state(opt: Any, chunks: list, whole: dict) -> Optional[dict]:
    """{state: {reference name: whole-model tensor}} on rank 0 (None elsewhere), 'param' and the update
    counts, for a chain whose children keep different states (momentum_buffer for the Muon params only,
    the Adam moments for the others)."""
    return ccmp.model_space_state(opt, chunks, whole, states_per_param=True)


def _torch_dist_sd(chunks: list, opt: Any, is_loading: bool, kind: str) -> dict:
    return ccmp._state_dict(chunks, opt, is_loading, kind)


def save(path: str, fmt: str, chunks: list, ddps: list, opt: Any, sched: Any, iteration: int) -> None:
    folder = cc.tmp_folder(path, fmt)
    if fmt == "megatron_opt":
        megatron_opt.checkpoint.save(folder, ddps, opt, sched, iteration=iteration)
        return
    sd = _torch_dist_sd(chunks, opt, False, TORCH_DIST[fmt])
    sd["opt_param_scheduler"] = sched.state_dict()
    with cc.cpu(), cc.may_start_processes():
        dist_checkpointing.save(sd, folder)


def load(path: str, fmt: str, chunks: list, ddps: list, opt: Any, sched: Any, model: bool = True) -> None:
    """Megatron-LM's load_checkpoint (torch_dist: the model, then the optimizer and the scheduler) or
    megatron_opt.checkpoint.load. ``model=False`` (torch_dist) leaves the model's weights as they are and
    loads the optimizer only: the load's all-gather alone must then bring every rank the loaded model."""
    name, kind = FOLDERS.get(fmt, (fmt, TORCH_DIST.get(fmt)))
    folder = f"{path}/{name}"
    if fmt == "megatron_opt":
        megatron_opt.checkpoint.load(folder, ddps, opt, sched)
        return
    sd = _torch_dist_sd(chunks, opt, True, kind)
    sd["opt_param_scheduler"] = sched.state_dict()
    if not model:  # dist_checkpointing.load fills the model's ShardedTensors in place: leave them out
        sd = {k: v for k, v in sd.items() if k not in ccmp._model_keys(chunks)}
    with cc.cpu():
        loaded = dist_checkpointing.load(sd, folder)
    if model:
        for key, chunk in zip(ccmp._model_keys(chunks), chunks):
            chunk.load_state_dict(loaded[key])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])


# ----------------------------------------------------------------------------- cases
def run_save(path: str, layout_name: str, before: int, after: int, tp_mode: str = "blockwise",
             formats: tuple = FORMATS, optimizer: str = "muon") -> dict:
    """Train ``before`` steps, save in every format (``path``/<format>), train ``after`` more: the state
    as saved, and the uninterrupted run's losses and final state (rank 0)."""
    mcore_cpu.init_parallel_state()
    layout = LAYOUTS[layout_name]
    whole = ccmp._whole_init(0, layout)
    with _installed(layout):
        chunks, ddps, opt, sched, whole = build(layout_name, whole, tp_mode, optimizer)
        batches = plan(before + after)
        first = train(layout_name, ddps, opt, sched, batches[:before])
        for fmt in formats:
            save(path, fmt, chunks, ddps, opt, sched, before)
        saved = state(opt, chunks, whole, layout_name)
        losses = train(layout_name, ddps, opt, sched, batches[before:])
        final = state(opt, chunks, whole, layout_name)
    return {"saved": saved, "losses": losses, "final": final, "first_losses": first}


def run_load(path: str, layout_name: str, formats: tuple, before: int, after: int, tp_mode: str = "blockwise",
             resave: Optional[str] = None, model: bool = True, optimizer: str = "muon") -> dict:
    """Per format: a fresh run (other initial weights) in the layout loads ``path``/<format>; the state
    right after the load, then (``after`` > 0) the losses and state after ``after`` more steps. With
    ``resave`` the loaded state is saved again in the same format under ``resave`` first."""
    mcore_cpu.init_parallel_state()
    layout = LAYOUTS[layout_name]
    out = {}
    whole = ccmp._whole_init(1, layout)
    with _installed(layout):
        for fmt in formats:
            chunks, ddps, opt, sched, whole = build(layout_name, whole, tp_mode, optimizer)
            load(path, fmt, chunks, ddps, opt, sched, model=model)
            loaded = state(opt, chunks, whole, layout_name)
            if resave is not None:
                save(resave, fmt, chunks, ddps, opt, sched, before)
            losses = train(layout_name, ddps, opt, sched, plan(before + after)[before:]) if after else []
            final = state(opt, chunks, whole, layout_name) if after else None
            out[fmt] = {"loaded": loaded, "losses": losses, "final": final}
    return out


# megatron-core's LayerWiseDistributedOptimizer (Megatron-LM's --optimizer muon / adaptive_muon / soap with
# --use-distributed-optimizer, run by megatron-core) keeps its matrix child's state per param: seen in a real
# Megatron-LM main checkpoint (tools/megatron_lm_cpu/compare.py --resume-layout DP2-adaptive_muon).
LAYER_WISE_KEYS = ("chained_0.optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight",
                   "chained_0.optimizer.state.momentum_buffer.decoder.layers.mlp.linear_fc1.weight")


def load_refused_layer_wise(path: str) -> dict:
    """A torch_dist checkpoint whose Muon child is in megatron-core's LayerWise per-param format (its tensor
    metadata, which is all the refusal reads: two of its keys) loaded by megatron_opt's Muon through Megatron-LM's
    dist_checkpointing.load: the message on every rank, and whether the optimizer state stayed as it was."""
    from torch.distributed import checkpoint as dcp

    folder = cc.tmp_folder(path, "layer_wise")
    with cc.cpu():
        dcp.save({key: torch.zeros(2, 8, 8) for key in LAYER_WISE_KEYS}, checkpoint_id=folder)
    mcore_cpu.init_parallel_state()
    layout = LAYOUTS["dp"]
    whole = ccmp._whole_init(1, layout)
    with _installed(layout):
        chunks, ddps, opt, sched, whole = build("dp", whole)
        train("dp", ddps, opt, sched, plan(1))
        before = state(opt, chunks, whole, "dp")
        try:
            load(path, "layer_wise_as_dp_reshardable", chunks, ddps, opt, sched)
            message = "loaded"
        except Exception as exc:  # noqa: BLE001  (the test reads the message)
            message = f"{type(exc).__name__}: {exc}"
        after = state(opt, chunks, whole, "dp")
    unchanged = None if before is None else all(torch.equal(before[k][n], after[k][n]) for k in STATES
                                                for n in before[k])
    return {"message": message, "unchanged": unchanged}
