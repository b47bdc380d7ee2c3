"""Worker-side cases: Megatron-LM's torch_dist checkpoint of megatron_opt at model-parallel layouts.

megatron-core 0.16.1's GPTModel is split by tensor or pipeline parallelism (tests/mcore/
cases_model_parallel.py's harness: megatron-core's DDP, optimizer and schedule names, megatron_opt's
after install()), trained a few steps, and saved as Megatron-LM's save_checkpoint does:
``{'model': model.sharded_state_dict(), 'optimizer': opt.sharded_state_dict(model_sd, metadata=
{'distrib_optim_sharding_type': 'fully_reshardable'})}`` through megatron.core.dist_checkpointing.
Another layout loads it (dist_checkpointing.load + optimizer.load_state_dict). The same state is also
saved and loaded with megatron_opt.checkpoint (global keys from the modules' sharded_state_dict()).

What the tests compare is the optimizer state in model space, assembled independently of the code
under test: each rank's ``optimizer.state_dict()`` pieces (a public accessor: the elements it owns
of each local param) are gathered over the data-parallel group into whole local params, which are
placed into whole-model tensors by the reference naming of cases_model_parallel (global layer number
from ``TransformerLayer.layer_number``, TP slices along ``partition_dim`` by the TP rank, the last
stage's tied output weight left out).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.mcore import cases_checkpoint_mcore as cc
from tests.mcore import cases_model_parallel as cmp
from tests.mcore import mcore_cpu
from tests.mcore.cases_megatron import global_batches
from tests.mcore.mcore_cpu import cpu_megatron_core

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402

import megatron_opt.checkpoint
import megatron_opt.errors
import megatron_opt.megatron

LAYOUTS = {"tp2": cmp.Layout(tp=2), "pp2": cmp.Layout(pp=2), "dp": cmp.Layout(),
           "tp2_glu": cmp.Layout(tp=2, glu=True), "dp_glu": cmp.Layout(glu=True),
           "ep2": cmp.LAYOUTS["ep2"], "ep1": cmp.Layout(experts=4),
           "pp2_vp2": cmp.LAYOUTS["pp2_vp2"], "dp_4_layers": cmp.Layout(layers=4)}
STATES = ("master", "exp_avg", "exp_avg_sq")
GA, MB = 1, 2


def _whole_init(seed: int, layout: cmp.Layout) -> dict[str, torch.Tensor]:
    """The TP1/PP1 model's initial weights by name (the same on every rank for a seed)."""
    config = cmp.transformer_config(layout, True, torch.float32, whole=True)
    model = mcore_cpu.build_gpt(config, seed, tied=True)
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _installed(layout: cmp.Layout):
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        megatron_opt.megatron.install()
        try:
            yield
        finally:
            megatron_opt.megatron.uninstall()


def _build(layout: cmp.Layout, whole: dict, dp: int, ga: int = GA) -> tuple:
    config = cmp.transformer_config(layout, True, torch.float32)
    chunks = cmp.build_chunks(layout, config, whole)
    ddps, opt, sched = cmp.setup(chunks, config, False, False, dp * ga * MB)
    return chunks, ddps, opt, sched


def _model_keys(chunks: list) -> list[str]:
    """Megatron-LM's keys of the model chunks in a checkpoint: 'model', or 'model0', 'model1', ..."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _state_dict(chunks: list, opt: Any, is_loading: bool, kind: str = "fully_reshardable") -> dict:
    """Megatron-LM's generate_state_dict (model chunks and optimizer)."""
    sd = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    with cc.cpu():
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=is_loading, metadata=cc.metadata(kind))
    return sd


def _local_full_state(opt: Any, chunk: Any) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {local param name: whole local param}} from the data-parallel group's state_dict() pieces."""
    group = parallel_state.get_data_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, opt.state_dict()["state"], group=group)
    shapes = {n: p.shape for n, p in chunk.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        for state, per_param in part.items():
            for key, piece in per_param.items():
                name = key if key in shapes else key.removeprefix("module.")
                flat = out.setdefault(state, {}).setdefault(name, torch.full((shapes[name].numel(),), float("nan")))
                flat[piece["start"]: piece["start"] + piece["values"].numel()] = piece["values"].float()
    return {state: {n: t.view(shapes[n]) for n, t in per.items()} for state, per in out.items()}


def model_space_state(opt: Any, chunks: list, whole: dict, states_per_param: bool = False) -> Optional[dict]:
    """{state: {reference name: whole-model tensor}} on rank 0 (None elsewhere), plus the params
    ('param') and the update counts; a collective over the world. NaN where no rank held an element.
    ``states_per_param``: the params keep different states (a chain such as Muon's: momentum_buffer
    for its matrices, the Adam moments for the rest), so a state a param does not keep is left out."""
    chunk = chunks[0]
    local = _local_full_state(opt, chunk)
    local["param"] = {n: p.detach().float() for n, p in chunk.named_parameters()}
    mine = []
    if parallel_state.get_data_parallel_rank() == 0:
        names = {id(p): n for n, p in chunk.named_parameters()}
        for ref, param, counted in cmp.chunk_params(chunk, whole):
            if not counted:
                continue
            slices = cmp.tp_slices(whole[ref].shape, param) or [(0, 0, 0, param.shape[0] if param.dim() else 1)]
            for state, per in local.items():
                if states_per_param and names[id(param)] not in per:
                    continue
                values = per[names[id(param)]]
                for dim, start, local_start, size in slices:
                    mine.append((state, ref, tuple(whole[ref].shape), dim, start,
                                 values.narrow(dim, local_start, size).clone() if values.dim() else values.clone()))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {"pieces": mine, "steps": opt.state_dict()["scalars"]["steps"]})
    if dist.get_rank() != 0:
        return None
    out: dict = {}
    for part in parts:
        for state, ref, shape, dim, start, values in part["pieces"]:
            full = out.setdefault(state, {}).setdefault(ref, torch.full(shape, float("nan")))
            (full.narrow(dim, start, values.shape[dim]) if values.dim() else full).copy_(values)
    out["steps"] = sorted({tuple(p["steps"]) for p in parts})
    return out


FORMATS = ("torch_dist", "megatron_opt")  # Megatron-LM's dist_checkpointing save; megatron_opt.checkpoint
# torch_dist with Megatron-LM's default optimizer format (per bucket; no TP/PP change): saved beside them.
DP_RESHARDABLE = "torch_dist_dp_reshardable"
KINDS = {"torch_dist": "fully_reshardable", DP_RESHARDABLE: "dp_reshardable"}


def run_save(path: str, layout_name: str, steps: int) -> dict:
    """Train ``steps`` steps in the layout and save in both formats (``path``/<format>); the state in
    model space as saved (rank 0)."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dp)
        cmp.train(ddps, opt, sched, global_batches(steps, dp, GA, MB), True, GA, MB)
        with cc.cpu(), cc.may_start_processes():
            for fmt, kind in KINDS.items():
                dist_checkpointing.save(_state_dict(chunks, opt, False, kind), cc.tmp_folder(path, fmt))
        megatron_opt.checkpoint.save(f"{path}/megatron_opt", ddps, opt, sched, iteration=steps)
        return {"state": model_space_state(opt, chunks, whole)}


def _load(path: str, fmt: str, chunks: list, ddps: list, opt: Any, sched: Any) -> dict:
    """Megatron-LM's load_checkpoint (torch_dist) or megatron_opt.checkpoint.load; what the load reports."""
    if fmt == "megatron_opt":
        result = megatron_opt.checkpoint.load(f"{path}/megatron_opt", ddps, opt, sched)
        return {"saved_data_parallel_size": result.saved_data_parallel_size, "iteration": result.iteration}
    with cc.cpu():
        loaded = dist_checkpointing.load(_state_dict(chunks, opt, True, KINDS.get(fmt, "fully_reshardable")),
                                         f"{path}/{fmt}")
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key])
    opt.load_state_dict(loaded["optimizer"])
    return {}


def run_load(path: str, layout_name: str, formats: tuple = FORMATS) -> dict:
    """Per format: a fresh model (other initial weights) in the layout loads the checkpoint; its state
    in model space before and after (rank 0) and what the load reported."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(1, layout)
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    out = {}
    with _installed(layout):
        for fmt in formats:
            chunks, ddps, opt, sched = _build(layout, whole, dp)
            before = model_space_state(opt, chunks, whole)
            report = _load(path, fmt, chunks, ddps, opt, sched)
            out[fmt] = {"state": model_space_state(opt, chunks, whole), "before": before, **report}
    return out


def run_cross_load_warnings(path: str, layout_name: str, saved_by_core: bool, steps: int = 2) -> dict:
    """Save a torch_dist fully_reshardable checkpoint in the layout with megatron-core's own optimizer
    (``saved_by_core``) or megatron_opt's, load it with megatron_opt's (install()), and report what the load
    logged about masters that disagree with the stored weights, and how many of the stored masters of the
    word embedding (first stage) equal its stored weight."""
    import logging

    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    folder = cc.tmp_folder(path, "core" if saved_by_core else "ours")
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        if not saved_by_core:
            megatron_opt.megatron.install()
        try:
            chunks, ddps, opt, sched = _build(layout, whole, dp)
            cmp.train(ddps, opt, sched, global_batches(steps, dp, GA, MB), True, GA, MB)
            with cc.cpu(), cc.may_start_processes():
                dist_checkpointing.save(_state_dict(chunks, opt, False), folder)
        finally:
            megatron_opt.megatron.uninstall()
        with cc.cpu():
            plain = dist_checkpointing.load_plain_tensors(folder)
        master = plain["optimizer.state.param.embedding.word_embeddings.weight"]
        rows_equal = int((master == plain["embedding.word_embeddings.weight"]).all(1).sum())
        records: list = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        log = logging.getLogger("megatron_opt")
        log.addHandler(handler)
        try:
            with _installed(layout):
                chunks, ddps, opt, sched = _build(layout, _whole_init(1, layout), dp)
                _load(path, "core" if saved_by_core else "ours", chunks, ddps, opt, sched)
        finally:
            log.removeHandler(handler)
    return {"warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
            "embedding_rows": (rows_equal, master.shape[0])}


def run_save_refused(path: str) -> str:
    """megatron_opt.checkpoint.save of a TP2 optimizer over modules without sharded_state_dict(): the error
    (every rank's, the same)."""
    layout = LAYOUTS["tp2"]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dist.get_world_size() // 2)
        for ddp in ddps:  # the same modules, but their sharded_state_dict() hidden: "not megatron-core's"
            ddp.module.sharded_state_dict = None
        try:
            megatron_opt.checkpoint.save(f"{path}/refused", ddps, opt, sched, iteration=1)
        except megatron_opt.errors.CheckpointError as exc:
            return str(exc)
    return ""


def run_save_with_a_key_twice(path: str) -> str:
    """megatron_opt.checkpoint.save at TP2 where rank 0's module gives two params the same global key in
    its sharded_state_dict() (a module's bug): the error, on every rank, instead of DCP waiting forever."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layout = LAYOUTS["tp2"]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dist.get_world_size() // 2)
        module = ddps[0].module
        own, params = module.sharded_state_dict, {id(p) for p in module.parameters()}

        def with_a_key_twice(*args: Any, **kwargs: Any) -> dict:
            sd = own(*args, **kwargs)
            if dist.get_rank() == 0:
                names = [k for k, v in sd.items() if isinstance(v, ShardedTensor) and id(v.data) in params]
                sd[names[1]] = dataclasses.replace(sd[names[1]], key=sd[names[0]].key)
            return sd

        module.sharded_state_dict = with_a_key_twice
        try:
            megatron_opt.checkpoint.save(f"{path}/refused", ddps, opt, sched, iteration=1)
        except megatron_opt.errors.CheckpointError as exc:
            return str(exc)
    return ""


def _dropout_draw() -> torch.Tensor:
    """What a dropout mask inside a tensor-parallel region draws next (megatron-core's RNG tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with cpu_megatron_core(), get_cuda_rng_tracker().fork():
        return torch.rand(8)


def run_rng_tracker(path: str) -> dict:
    """At TP2: megatron_opt.checkpoint.save (with RNG states, and with save_rng=False), the dropout stream
    drawn on, then each loaded: what the stream draws after each load, against what it drew right after
    the save (per rank: each TP rank has its own stream)."""
    layout = LAYOUTS["tp2"]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dist.get_world_size() // 2)
        megatron_opt.checkpoint.save(f"{path}/with_rng", ddps, opt, sched, iteration=1)
        megatron_opt.checkpoint.save(f"{path}/no_rng", ddps, opt, sched, iteration=1, save_rng=False)
        after_save = _dropout_draw()
        _dropout_draw()  # the stream moves on
        with_rng = megatron_opt.checkpoint.load(f"{path}/with_rng", ddps, opt, sched)
        after_load = _dropout_draw()
        no_rng = megatron_opt.checkpoint.load(f"{path}/no_rng", ddps, opt, sched)
        after_no_rng_load = _dropout_draw()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return {"after_save": after_save, "after_load": after_load, "after_no_rng_load": after_no_rng_load,
            "restored": (with_rng.rng_restored, no_rng.rng_restored),
            "tp_rank": tp_rank}


def run_train_and_save(path: str, layout_name: str, steps: int) -> None:
    """Train ``steps`` steps in the layout (any number of model chunks, experts) and save with
    megatron_opt.checkpoint and Megatron-LM's torch_dist (fully_reshardable): ``path``/<format>."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    ga = 2 if layout.vp else GA  # the interleaved schedule needs micro-batches >= PP
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dp, ga)
        cmp.train(ddps, opt, sched, global_batches(steps, dp, ga, MB), True, ga, MB)
        megatron_opt.checkpoint.save(f"{path}/megatron_opt", ddps, opt, sched, iteration=steps)
        with cc.cpu(), cc.may_start_processes():
            dist_checkpointing.save(_state_dict(chunks, opt, False), cc.tmp_folder(path, "torch_dist"))


def run_load_and_resave(path: str, fmt: str, layout_name: str, dst: str) -> Optional[int]:
    """A fresh model (other initial weights) in the layout loads ``path``/``fmt`` and saves it again with
    megatron_opt.checkpoint as ``dst``; the saved data-parallel size megatron_opt.checkpoint reported."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(1, layout)
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dp, 2 if layout.vp else GA)
        report = _load(path, fmt, chunks, ddps, opt, sched)
        megatron_opt.checkpoint.save(dst, ddps, opt, sched, iteration=1)
    return report.get("saved_data_parallel_size")


def run_load_refused(path: str, layout_name: str, fmt: str) -> str:
    """Loading ``fmt`` in the layout: the error (every rank's), or '' when it loaded."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(1, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dist.get_world_size() // (layout.tp * layout.pp))
        try:
            _load(path, fmt, chunks, ddps, opt, sched)
        except (Exception, megatron_opt.errors.CheckpointError) as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
    return ""


def run_model_only_and_full_save(path: str) -> None:
    """At TP2 (world 2): a model-only save (no optimizer) and a full save of the same trained model."""
    layout = LAYOUTS["tp2"]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(0, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, 1)
        cmp.train(ddps, opt, sched, global_batches(1, 1, GA, MB), True, GA, MB)
        megatron_opt.checkpoint.save(f"{path}/model_only", ddps, iteration=1)
        megatron_opt.checkpoint.save(f"{path}/full", ddps, opt, sched, iteration=1)


def run_load_reports_rng(path: str, layout_name: str) -> bool:
    """Load ``path`` in the layout; whether the RNG states were restored."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    whole = _whole_init(1, layout)
    with _installed(layout):
        chunks, ddps, opt, sched = _build(layout, whole, dist.get_world_size() // (layout.tp * layout.pp))
        return megatron_opt.checkpoint.load(path, ddps, opt, sched).rng_restored
