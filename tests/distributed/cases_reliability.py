"""Worker-side cases for test_reliability.py: one rank's failure is every rank's error, ranks agree."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import TinyLM, build, global_batch, token_loss_sum


def _timed(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:  # noqa: BLE001  (the type is part of what is checked)
        error = f"{type(exc).__name__}: {exc}"
    return dict(rank=dist.get_rank(), error=error, seconds=time.monotonic() - start)


def train_step_fault(fault: str, overlap: bool) -> dict:
    """``fault`` happens on rank 1 only; every rank must raise RankError naming rank 1."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp, opt = build(model, overlap_grad=overlap, bucket_size=300 if overlap else None)
    batches = global_batch(4, seed=1)[2 * rank : 2 * rank + 2]

    def loss_fn(m, b):
        if rank == 1 and fault == "raise_first" and b is batches[0]:
            raise KeyError("token_ids")
        if rank == 1 and fault == "raise_last" and b is batches[-1]:
            raise KeyError("token_ids")
        loss, n = token_loss_sum(m(b[0]), b[1])
        if fault == "aux_one_rank" and rank == 1:
            return loss, n, {"z_loss": loss * 0.0}
        return loss, n

    mbs = [] if (fault == "empty" and rank == 1) else batches
    out = _timed(lambda: mo.train_step(ddp, opt, None, mbs, loss_fn))
    # The ranks stay usable: a clean step afterwards works on every rank.
    clean = lambda m, b: token_loss_sum(m(b[0]), b[1])  # noqa: E731
    out["after"] = mo.train_step(ddp, opt, None, batches, clean).success
    return out


def scheduler_counts_global_samples() -> dict:
    """Rank 0 has micro-batches of 1 sample, rank 1 of 3: both schedulers advance by 4 per micro-batch."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp, opt = build(model, optimizer="sgd", sgd_momentum=0.0)
    sched = mo.OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=100,
                                       lr_decay_steps=1000, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=1, wd_incr_style="constant")
    size = 1 if rank == 0 else 3
    batches = [(x[:1].expand(size, -1), y[:1].expand(size, -1)) for x, y in global_batch(2, seed=3)]
    res = mo.train_step(ddp, opt, sched, batches, lambda m, b: token_loss_sum(m(b[0]), b[1]))
    return dict(num_steps=sched.num_steps, lr=res.lr)


def ddp_mismatch(kind: str) -> dict:
    """Rank 1 wraps something different from rank 0; every rank must raise naming the difference."""
    rank = dist.get_rank()
    model = TinyLM()
    cfg = dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    if rank == 1:
        if kind == "reshaped":
            model.fc.weight = torch.nn.Parameter(model.fc.weight.detach().reshape(4, 64))
        elif kind == "order":
            model = torch.nn.Sequential(*reversed(list(TinyLM().children())))
        elif kind == "dtype":
            model.norm.to(torch.bfloat16)
        elif kind == "float64":
            model.norm.double()
        elif kind == "bucket_size":
            cfg["bucket_size"] = 1000
        elif kind == "distributed_optimizer":
            cfg["use_distributed_optimizer"] = False
    return _timed(lambda: mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(**cfg)))


def param_changed_after_wrapping(kind: str) -> dict:
    model = TinyLM()
    ddp, opt = build(model)
    if kind == "to_bf16":
        model.to(torch.bfloat16)
    elif kind == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif kind == "freeze":
        model.fc.weight.requires_grad_(False)
    elif kind == "wrap_twice":
        return _timed(lambda: mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig()))
    batches = global_batch(2 * dist.get_world_size(), seed=1)[dist.get_rank() * 2 : dist.get_rank() * 2 + 2]
    return _timed(lambda: mo.train_step(ddp, opt, None, batches, lambda m, b: token_loss_sum(m(b[0]), b[1])))


def fp16_buffer_reduction(grad_fp32: bool) -> dict:
    """Each rank's gradient is 40000 per element; in an fp16 buffer their sum (80000) overflows fp16,
    the pre-scaled sum (20000 + 20000) does not."""
    from tests.support.common import Probe

    model = Probe(torch.float16, numel=64)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=grad_fp32))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-9, fp16=True, loss_scale=1.0, clip_grad=0.0,
                                                       optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0,
                                                       use_distributed_optimizer=True), ddp)
    ddp.zero_grad_buffer()
    ddp(40000.0).backward()
    success, norm, _ = opt.step()
    return dict(success=success, norm=norm)


def optimizer_mismatch(kind: str) -> dict:
    rank = dist.get_rank()
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    kw = dict(lr=1e-2, use_distributed_optimizer=True)
    if rank == 1:
        kw.update({"lr": dict(lr=2e-2), "beta": dict(adam_beta2=0.95), "rule": dict(optimizer="lion")}[kind])
    return _timed(lambda: mo.get_megatron_optimizer(mo.OptimizerConfig(**kw), ddp))


def fault_injection(precision: str, steps: int, seed: int) -> dict:
    """Plant NaN/inf into one param's gradient on random (step, rank, param, micro-batch) positions.
    Each planted step must be skipped on every rank with every piece of state bitwise unchanged, and
    the run must end bitwise equal to a clean run that never ran those steps."""
    import random

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, extra = {"fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {"bf16": True}),
                    "fp16": (torch.float16, {"fp16": True, "loss_scale": 128.0})}[precision]
    plan = random.Random(seed)  # the same plan on every rank
    n_params = len(list(TinyLM().parameters()))
    planted = {s: (plan.randrange(world), plan.randrange(n_params), plan.randrange(2), plan.choice([1, -1, 0]))
               for s in sorted(plan.sample(range(steps), steps // 3))}

    def run(skip_planted: bool) -> dict:
        model = TinyLM(dtype)
        ddp, opt = build(model, clip_grad=1.0, **extra)
        log = []
        for s in range(steps):
            if skip_planted and s in planted:
                continue
            batches = global_batch(2 * world, seed=100 + s)[2 * rank : 2 * rank + 2]
            fault = planted.get(s) if not skip_planted else None
            handle = None
            if fault is not None and fault[0] == rank:
                bad = {1: float("inf"), -1: float("-inf"), 0: float("nan")}[fault[3]]
                param = list(model.parameters())[fault[1]]
                state = {"mb": 0}
                target_mb = fault[2]

                def hook(g, state=state, bad=bad, target_mb=target_mb):
                    state["mb"] += 1
                    if state["mb"] - 1 == target_mb:
                        g = g.clone()
                        g.reshape(-1)[0] = bad
                    return g
                handle = param.register_hook(hook)
            before = [p.detach().clone() for p in model.parameters()] + \
                     [t.clone() for t in opt.local_state_tensors().values()]
            res = mo.train_step(ddp, opt, None, batches, lambda m, b: token_loss_sum(m(b[0]), b[1]))
            if handle is not None:
                handle.remove()
            after = [p.detach().clone() for p in model.parameters()] + \
                    [t.clone() for t in opt.local_state_tensors().values()]
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            log.append((s, res.success, unchanged))
        return dict(log=log, params=[p.detach().clone() for p in model.parameters()],
                    state={k: v.clone() for k, v in opt.local_state_tensors().items() if k != "step"})

    faulty, clean = run(False), run(True)
    return dict(planted=sorted(planted), faulty=faulty["log"], clean=clean["log"],
                params_equal=all(torch.equal(a, b) for a, b in zip(faulty["params"], clean["params"])),
                state_equal=all(torch.equal(faulty["state"][k], clean["state"][k]) for k in clean["state"]))


def group_without_this_rank() -> dict:
    only_rank0 = dist.new_group([0])
    model = TinyLM()
    return _timed(lambda: mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(),
                                                     data_parallel_group=only_rank0))


def update_fails_on_one_rank(device_step: bool = False) -> dict:
    """An update rule that raises on rank 1 only: every rank raises instead of waiting in the all-gather
    (also with the step decided on the device, optimizer_cuda_graph, which runs eagerly on CPU)."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))

    class Flaky(mo.SGD):
        def apply(self, *a, **k):
            if rank == 1:
                raise FloatingPointError("update kernel failed")
            return super().apply(*a, **k)

    opt = mo.DistributedOptimizer(mo.OptimizerConfig(lr=1e-2, optimizer="sgd", use_distributed_optimizer=True,
                                                     optimizer_cuda_graph=device_step),
                                  [ddp], update_rule=Flaky(momentum=0.9))
    batches = global_batch(4, seed=1)[2 * rank : 2 * rank + 2]
    return _timed(lambda: mo.train_step(ddp, opt, None, batches, lambda m, b: token_loss_sum(m(b[0]), b[1])))


def chunked_all_gather() -> bool:
    """On gloo a large reduce-scatter / all-gather goes in slices (collectives.GLOO_SLICE), synchronous
    or not, in place (the shard a view of this rank's chunk) or not: the result is the one collective's."""
    from megatron_opt import collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    saved, collectives.GLOO_SLICE = collectives.GLOO_SLICE, 7
    try:
        for n in (5, 7, 20, 31):
            for async_op in (False, True):
                full = torch.zeros(n * world)
                full[rank * n : (rank + 1) * n] = torch.arange(n) + 100 * rank
                collectives.all_gather(full, full[rank * n : (rank + 1) * n], None, async_op=async_op).wait()
                if not torch.equal(full, torch.cat([torch.arange(n) + 100.0 * r for r in range(world)])):
                    return False
                for in_place in (False, True):
                    full = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
                    shard = full[rank * n : (rank + 1) * n] if in_place else torch.empty(n)
                    handle = collectives.reduce_scatter(full, shard, None, async_op=async_op)
                    handle.wait()
                    want = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * sum(range(1, world + 1))
                    if not torch.equal(shard, want) or not handle.is_completed():
                        return False
    finally:
        collectives.GLOO_SLICE = saved
    return True


def state_dict_nan_on_one_rank() -> dict:
    """A state dict that only rank 1 refuses (a NaN in its own shard): every rank refuses it."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp, opt = build(model)
    batches = global_batch(4, seed=1)[2 * rank : 2 * rank + 2]
    mo.train_step(ddp, opt, None, batches, lambda m, b: token_loss_sum(m(b[0]), b[1]))
    sd = opt.state_dict()
    if rank == 1:
        next(iter(sd["state"]["exp_avg"].values()))["values"][0] = float("nan")
    before = [t.clone() for t in opt.local_state_tensors().values()]
    out = _timed(lambda: opt.load_state_dict(sd))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, opt.local_state_tensors().values()))
    return out


def late_gradient_in_one_ranks_hook(overlap: bool) -> dict:
    """Outside train_step, as Megatron-LM's loop runs it: every rank runs the step's backward; rank 1
    then runs one more backward without zero_grad_buffer(), so its hooks see gradients whose buckets were
    launched. Every rank must raise LateGradientError in the step, none may wait in a collective."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=200 if overlap else None))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), ddp)
    x, y = global_batch(2, seed=1)[rank]
    ddp.zero_grad_buffer()
    token_loss_sum(ddp(x), y)[0].backward()

    def rest():
        if rank == 1:
            if not overlap:
                ddp.start_grad_sync()  # megatron-core's schedules launch the buckets before the last backward
            token_loss_sum(ddp(x), y)[0].backward()
        ddp.finish_grad_sync()
        opt.step()

    out = _timed(rest)
    out["params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out
