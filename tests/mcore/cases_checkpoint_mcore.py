"""Worker-side cases: Megatron-LM's torch_dist optimizer checkpoint through install(): megatron-core's
GPTModel, ``model.sharded_state_dict()`` + ``optimizer.sharded_state_dict(...)`` saved and loaded with
megatron.core.dist_checkpointing, as Megatron-LM's save_checkpoint / load_checkpoint do, in both
formats; cross-loading with megatron-core 0.16.1's own DistributedOptimizer.

Extra CPU patch (beside tests/mcore/mcore_cpu.py's): megatron-core's own optimizer computes its grad
norm through ``megatron.core.utils.local_multi_tensor_l2_norm``, which creates a tensor with
``device="cuda"``; inside ``cpu()`` that module's ``torch`` creates it on the CPU.

megatron-core's own optimizer falls back to torch's AdamW without apex / Transformer Engine, and its
resume through its own loaders has quirks that are worked around here only (``core_load``): a fresh
optimizer cannot build its load template until its state exists (one zero-lr step with zero grads
creates it), its fully_reshardable loader copies into torch's 'step' state and raises KeyError (the
copy skips keys the loaded state lacks), and its load gives every param one shared 'step' tensor
(which torch's AdamW would then advance once per param: each param gets its own copy).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from tests.mcore import mcore_cpu
from tests.mcore import cases_megatron as cm
from tests.mcore.mcore_cpu import cpu_megatron_core

import megatron.core.utils as core_utils  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as CoreDistributedOptimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import megatron_opt.megatron

MB = 2
GLOBAL_BATCH = 8  # samples per step at every DP size: ga = GLOBAL_BATCH / (MB * DP)


@contextlib.contextmanager
def cpu() -> Iterator[None]:
    """mcore_cpu's patches plus megatron.core.utils' tensors created with device='cuda' (see the docstring)."""
    original = core_utils.torch
    core_utils.torch = mcore_cpu._torch_on_cpu()
    try:
        with cpu_megatron_core():
            yield
    finally:
        core_utils.torch = original


@contextlib.contextmanager
def may_start_processes() -> Iterator[None]:
    """The test pools' workers are daemonic processes, which may not start children; megatron-core's
    checkpoint writer starts a multiprocessing Manager for its results queue. Lift the flag meanwhile."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def metadata(kind: str) -> dict:
    """What Megatron-LM's _build_sharded_state_dict_metadata passes (less the dp_cp_group)."""
    out = {"distrib_optim_sharding_type": kind, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if kind == "fully_reshardable":
        out["distrib_optim_fully_reshardable_mem_efficient"] = False
    return out


class Run:
    """Megatron-LM's model, optimizer and scheduler on megatron-core's GPTModel: megatron_opt's through
    install() (``ours``), or megatron-core's own DDP and DistributedOptimizer."""

    def __init__(self, ours: bool, bucket_size: Optional[int] = None, seed: int = 0) -> None:
        mcore_cpu.init_parallel_state()
        self.ours = ours
        self.config = mcore_cpu.transformer_config(True)
        self.model = mcore_cpu.build_gpt(self.config, seed)
        if ours:
            megatron_opt.megatron.install()
        try:
            import megatron.core.distributed as core_distributed
            import megatron.core.optimizer as core_optimizer

            ddp_config = CoreDDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                       overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
            with cpu():
                self.ddp = core_distributed.DistributedDataParallel(config=self.config, ddp_config=ddp_config,
                                                                    module=self.model)
                self.opt = core_optimizer.get_megatron_optimizer(
                    CoreOptimizerConfig(optimizer="adam", lr=cm.LR, min_lr=cm.MIN_LR, weight_decay=cm.WD,
                                        clip_grad=cm.CLIP, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                                        use_distributed_optimizer=True), [self.ddp])
        finally:
            megatron_opt.megatron.uninstall()
        self.sched = cm.CoreScheduler(self.opt, **cm.schedule(GLOBAL_BATCH))
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.opt.scale_loss

    def buckets(self) -> int:
        return sum(len(b.buckets) for b in self.ddp.buffers)

    def train(self, steps: list[list[dict]]) -> None:
        """Megatron-LM's train_step for each global batch of ``steps`` (this rank's micro-batches)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        ga = GLOBAL_BATCH // (MB * world)
        for batches in steps:
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()
            with cpu():
                get_forward_backward_func()(forward_step_func=cm.forward_step,
                                            data_iterator=iter(batches[rank * ga:(rank + 1) * ga]),
                                            model=[self.ddp], num_microbatches=ga, seq_length=mcore_cpu.SEQ,
                                            micro_batch_size=MB, decoder_seq_length=None, forward_only=False)
                success, _, _ = self.opt.step()
            assert success
            self.sched.step(increment=GLOBAL_BATCH)

    def state_dict(self, kind: str, is_loading: bool) -> dict:
        """Megatron-LM's generate_state_dict (model, optimizer, scheduler), on the unwrapped model."""
        sd = {"model": self.model.sharded_state_dict()}
        with cpu():
            sd["optimizer"] = self.opt.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata(kind))
        sd["opt_param_scheduler"] = self.sched.state_dict()
        return sd

    def save(self, path: str, kind: str) -> None:
        with cpu(), may_start_processes():
            dist_checkpointing.save(self.state_dict(kind, is_loading=False), path)

    def load(self, path: str, kind: str, load_optimizer: bool = True) -> None:
        """Megatron-LM's load_checkpoint: the model, then the optimizer and the scheduler."""
        if not self.ours and load_optimizer:
            core_prime(self.opt)
        sd = self.state_dict(kind, is_loading=True)
        if not load_optimizer:
            sd = {"model": sd["model"]}
        with cpu():
            loaded = dist_checkpointing.load(sd, path)
        self.model.load_state_dict(loaded["model"])
        if load_optimizer:
            if self.ours:
                self.opt.load_state_dict(loaded["optimizer"])
            else:
                core_load(self.opt, loaded["optimizer"])
            self.sched.load_state_dict(loaded["opt_param_scheduler"])

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().double().clone() for n, p in self.model.named_parameters()}


# --------------------------------------------------------------------- megatron-core's optimizer (torch AdamW fallback)
def _inner(opt) -> list[torch.optim.Optimizer]:
    return [c.optimizer for c in opt.chained_optimizers]


def core_prime(opt) -> None:
    """Create megatron-core's torch AdamW state with one zero-lr step on zero grads (it changes nothing),
    so its sharded_state_dict(is_loading=True) can be built."""
    for inner in _inner(opt):
        if inner.state:
            continue
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = None


def core_load(opt, state_dict: dict) -> None:
    original = CoreDistributedOptimizer._set_main_param_and_optimizer_states

    def set_present(self, model_param, tensors):  # skip torch's 'step', which the loaded state lacks
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, value in tensors.items():
                targets[key].copy_(value)

    CoreDistributedOptimizer._set_main_param_and_optimizer_states = set_present
    try:
        opt.load_state_dict(state_dict)
    finally:
        CoreDistributedOptimizer._set_main_param_and_optimizer_states = original
    for inner in _inner(opt):  # one 'step' tensor per param again
        for state in inner.state.values():
            state["step"] = state["step"].clone()


# ----------------------------------------------------------------------------- what the tests compare
def batches(steps: int, seed: int = 11) -> list[list[dict]]:
    """``steps`` global batches of GLOBAL_BATCH / MB micro-batches (split over the ranks by train())."""
    return cm.global_batches(steps, 1, GLOBAL_BATCH // MB, MB, seed)


def model_space_state(run: Run) -> Optional[dict]:
    """megatron_opt's masters and moments by param name, in the param's shape (assembled on rank 0 from
    every rank's optimizer.state_dict()), with the update count and the schedule; None on other ranks."""
    sd = run.opt.state_dict()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sd["state"])
    if dist.get_rank() != 0:
        return None
    shapes = {key: shape for key, shape, _ in sd["fingerprint"]["params"]}
    out: dict = {}
    for part in parts:
        for state, per_param in part.items():
            for key, piece in per_param.items():
                flat = out.setdefault(state, {}).setdefault(key, torch.full((torch.Size(shapes[key]).numel(),),
                                                                            float("nan")))
                flat[piece["start"]: piece["start"] + piece["values"].numel()] = piece["values"].float()
    out = {state: {k: v.view(shapes[k]) for k, v in per.items()} for state, per in out.items()}
    out["steps"] = sd["scalars"]["steps"]
    out["scheduler"] = run.sched.state_dict()
    return out


def saved_model_space_state(run: Run, path: str) -> dict:
    """A fully_reshardable checkpoint's state by param name, read back whole with dist_checkpointing
    (the model's ShardedTensors say where each param sits: layers are stacked along a prepended axis)."""
    plain = dist_checkpointing.load_plain_tensors(path)
    names = {id(p): n for n, p in run.model.named_parameters()}
    out: dict = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for sh in run.model.sharded_state_dict().values():
        if id(sh.data) not in names:
            continue
        for ours, theirs in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            out[ours][names[id(sh.data)]] = plain[f"optimizer.state.{theirs}.{sh.key}"][sh.global_slice()]
    return out


# ----------------------------------------------------------------------------- cases
def run_save(path: str, ours: bool, kind: str, bucket_size: Optional[int], before: int, after: int) -> dict:
    """Train ``before`` steps, save, train ``after`` more: the saving side's own continuation."""
    run = Run(ours, bucket_size)
    plan = batches(before + after)
    run.train(plan[:before])
    run.save(path, kind)
    saved = model_space_state(run) if ours else None
    run.train(plan[before:])
    return {"params": run.params(), "buckets": run.buckets(), "saved": saved}


def run_load(path: str, ours: bool, kind: str, bucket_size: Optional[int], before: int, after: int,
             load_optimizer: bool = True) -> dict:
    """A fresh run loads the checkpoint (at this pool's DP size) and trains the ``after`` steps."""
    run = Run(ours, bucket_size, seed=1)  # other initial weights: everything must come from the checkpoint
    run.load(path, kind, load_optimizer)
    loaded = model_space_state(run) if ours else None
    start = run.params()
    run.train(batches(before + after)[before:])
    on_disk = saved_model_space_state(run, path) if kind == "fully_reshardable" else None  # a collective
    on_disk = on_disk if dist.get_rank() == 0 else None
    return {"loaded": loaded, "start": start, "params": run.params(), "buckets": run.buckets(), "on_disk": on_disk}


def run_load_refused(path: str, kind: str, bucket_size: Optional[int]) -> dict:
    """A load that must be refused on every rank, leaving the optimizer as it was."""
    run = Run(True, bucket_size, seed=1)
    run.train(batches(1, seed=5))
    before = model_space_state(run)
    try:
        run.load(path, kind)
    except ValueError as exc:
        return {"error": str(exc), "unchanged": _same(before, model_space_state(run))}
    return {"error": None}


def run_load_with_other_buckets_installed(path: str, bucket_size: Optional[int]) -> dict:
    """Megatron-LM's load (dist_checkpointing.load, as install() leaves it) of a dp_reshardable checkpoint
    into a run with other buckets: refused on every rank by name before torch.distributed.checkpoint runs,
    leaving the optimizer as it was."""
    import megatron_opt.megatron

    run = Run(True, bucket_size, seed=1)  # installs and uninstalls around its construction
    run.train(batches(1, seed=5))
    before = model_space_state(run)
    megatron_opt.megatron.install()
    try:
        try:
            run.load(path, "dp_reshardable")
        except Exception as exc:  # noqa: BLE001  (the test asserts its type)
            return {"type": type(exc).__name__, "error": str(exc), "unchanged": _same(before, model_space_state(run))}
        return {"type": None, "error": None}
    finally:
        megatron_opt.megatron.uninstall()


def run_unsupported_type() -> str:
    run = Run(True)
    try:
        run.state_dict("dp_zero_gather_scatter", is_loading=False)
    except ValueError as exc:
        return str(exc)
    return ""


def _same(a: Optional[dict], b: Optional[dict]) -> bool:
    """The moments and update counts are unchanged (the masters of fp32 params are the params, which
    Megatron-LM's load_checkpoint replaces with the model's before it loads the optimizer)."""
    if a is None or b is None:
        return a is b
    return a["steps"] == b["steps"] and all(torch.equal(a[s][k], b[s][k]) for s in ("exp_avg", "exp_avg_sq")
                                            for k in a[s])


def tmp_folder(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    os.makedirs(path, exist_ok=True)
    return path
