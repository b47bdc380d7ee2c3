"""Worker-side checkpoint cases: bit-exact resume, resharding, validation before mutation, async saves."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.checkpoint as ckpt
from megatron_opt.checkpoint import directory
from tests.support.common import VOCAB, SEQ, TinyLM, token_loss_sum

PRECISIONS = {
    "fp32": dict(dtype=torch.float32, opt=dict()),
    "bf16": dict(dtype=torch.bfloat16, opt=dict(bf16=True)),
    "fp16": dict(dtype=torch.float16, opt=dict(fp16=True, initial_loss_scale=2.0**12, loss_scale_window=2)),
    # precision-aware state: bf16 moments, bf16 params + int16 remainders as masters
    "bf16_rem": dict(dtype=torch.bfloat16, opt=dict(bf16=True, use_precision_aware_optimizer=True,
                                                    exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
}
MB, GA = 2, 2


def build_run(precision: str, seed: int, distributed: bool = True, optimizer: str = "adam"):
    spec = PRECISIONS[precision]
    model = TinyLM(spec["dtype"], seed=seed)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True))
    cfg = mo.OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1, clip_grad=1.0, optimizer=optimizer,
                             use_distributed_optimizer=distributed, **spec["opt"])
    opt = mo.get_megatron_optimizer(cfg, ddp)
    sched = mo.OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=8,
                                       lr_decay_steps=64, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                       wd_incr_steps=64, wd_incr_style="constant")
    return model, ddp, opt, sched


def _batches() -> list:
    """Drawn from the global torch RNG, so a resume is bit-exact only if the RNG state was restored."""
    out = []
    for _ in range(GA):
        tokens = torch.randint(0, VOCAB, (MB, SEQ))
        labels = torch.randint(0, VOCAB, (MB, SEQ))
        labels[:, : int(torch.randint(0, SEQ // 2, ()))] = -100  # ragged token counts
        out.append((tokens, labels))
    return out


def _loss_fn(model, batch):
    return token_loss_sum(model(batch[0]), batch[1])


def train(ddp, opt, sched, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        res = mo.train_step(ddp, opt, sched, _batches(), _loss_fn, samples_per_step=MB * GA * dist.get_world_size())
        losses.append(res.loss)
    return losses


def digest(model, opt, sched) -> dict:
    return dict(params=[p.detach().clone() for p in model.parameters()],
                state={k: v.clone() for k, v in opt.local_state_tensors().items()},
                scalars=opt.scalar_state(), sched=sched.state_dict())


def resume_case(path: str, precision: str, phase: str, steps: int, async_save: bool) -> dict:
    """phase 'straight': `steps` steps. 'first': steps/2, save, return. 'second': a different init and
    RNG, load, steps/2. straight and second must agree bitwise."""
    rank = dist.get_rank()
    half = steps // 2
    torch.manual_seed(1000 + rank if phase != "second" else 5)
    model, ddp, opt, sched = build_run(precision, seed=7 if phase != "second" else 99)
    if phase == "straight":
        losses = train(ddp, opt, sched, steps)
        return dict(digest(model, opt, sched), losses=losses)
    if phase == "first":
        losses = train(ddp, opt, sched, half)
        ckpt.save(path, ddp, opt, sched, iteration=half, consumed_samples=half * MB * GA * dist.get_world_size(),
                  async_save=async_save)
        if async_save:
            ckpt.wait_for_pending_save(ddp)
        return dict(losses=losses)
    state = ckpt.load(path, ddp, opt, sched)
    losses = train(ddp, opt, sched, steps - half)
    return dict(digest(model, opt, sched), losses=losses, iteration=state.iteration, rng=state.rng_restored,
                consumed=state.consumed_samples)


def save_after_steps(path: str, precision: str, steps: int, optimizer: str = "adam") -> dict:
    torch.manual_seed(3 + dist.get_rank())
    model, ddp, opt, sched = build_run(precision, seed=7, optimizer=optimizer)
    train(ddp, opt, sched, steps)
    ckpt.save(path, ddp, opt, sched, iteration=steps)
    torch.manual_seed(50 + dist.get_rank())
    losses = train(ddp, opt, sched, 2)  # the continuation at the save-time DP size
    return dict(losses=losses, params=[p.detach().clone() for p in model.parameters()])


def load_resharded(path: str, resave_path: str, precision: str, distributed: bool, optimizer: str = "adam") -> dict:
    """Load at this pool's DP size, save again (the re-save must equal the original in model space),
    then train 2 steps."""
    model, ddp, opt, sched = build_run(precision, seed=123, distributed=distributed, optimizer=optimizer)
    state = ckpt.load(path, ddp, opt, sched)
    ckpt.save(resave_path, ddp, opt, sched, iteration=state.iteration)
    torch.manual_seed(50 + dist.get_rank())
    losses = train(ddp, opt, sched, 2)
    return dict(saved_dp=state.saved_data_parallel_size, rng=state.rng_restored, losses=losses,
                params=[p.detach().clone() for p in model.parameters()])


def _snapshot(model, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.local_state_tensors().values()]


def load_damaged(path: str, damage: str) -> dict:
    """Every rank must raise CheckpointError quickly, with the model and optimizer untouched."""
    rank = dist.get_rank()
    model, ddp, opt, sched = build_run("fp32", seed=11)
    if damage == "wrong_model":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
        opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), ddp)
        sched = None
    before = _snapshot(model, opt)
    start = time.monotonic()
    try:
        ckpt.load(path, ddp, opt, sched)
        error = None
    except mo.CheckpointError as exc:
        error = str(exc)
    after = _snapshot(model, opt)
    return dict(rank=rank, error=error, seconds=time.monotonic() - start,
                untouched=all(torch.equal(a, b) for a, b in zip(before, after)))


def async_save_failure(path: str) -> dict:
    """A background write that fails on rank 1 raises on every rank, at the check that finds it done."""
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("fp32", seed=7)
    train(ddp, opt, sched, 1)
    real = directory.sha256_of
    if dist.get_rank() == 1:
        def broken(p):
            raise OSError(f"disk full while reading back {p}")
        directory.sha256_of = broken
    error = None
    try:
        with ckpt.Checkpointer() as checkpointer:
            checkpointer.save(path, ddp, opt, sched, iteration=1, async_save=True)
            train(ddp, opt, sched, 1)  # training goes on while the save runs
            try:
                checkpointer.check_pending_save(block=True)  # waits for the save's thread, then agrees
            except mo.CheckpointError as exc:
                error = str(exc)
    finally:
        directory.sha256_of = real
    return dict(error=error, tracker=ckpt.latest_iteration(path))


def async_save_overlaps_training(path: str) -> dict:
    """An async save returns after the copy; its result equals a sync save of the same state."""
    torch.manual_seed(3 + dist.get_rank())
    model, ddp, opt, sched = build_run("bf16", seed=7)
    train(ddp, opt, sched, 2)
    t0 = time.perf_counter()
    ckpt.save(os.path.join(path, "sync"), ddp, opt, sched, iteration=2)
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.save(os.path.join(path, "async"), ddp, opt, sched, iteration=2, async_save=True)
    blocked_s = time.perf_counter() - t0
    train(ddp, opt, sched, 1)  # mutates params and state while the background write runs
    ckpt.wait_for_pending_save(ddp)
    return dict(sync_s=sync_s, blocked_s=blocked_s)


def state_dict_other_dp(path: str) -> str:
    """DistributedOptimizer.load_state_dict of a state dict saved at another DP size."""
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("fp32", seed=7)
    sd = torch.load(path, weights_only=False)[dist.get_rank() % 2]
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return ""


def save_state_dicts(path: str) -> None:
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("fp32", seed=7)
    train(ddp, opt, sched, 1)
    sds = [None] * dist.get_world_size()
    dist.all_gather_object(sds, opt.state_dict())
    if dist.get_rank() == 0:
        torch.save(sds, path)


def save_iterations(path: str, iterations: list, keep: int) -> None:
    model, ddp, opt, sched = build_run("fp32", seed=7)
    for it in iterations:
        ckpt.save(path, ddp, opt, sched, iteration=it, keep_latest_k=keep)


def save_with_nan_moment(path: str) -> None:
    """A checkpoint whose files are intact but whose saved state holds a NaN (only the value check can tell)."""
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("fp32", seed=7)
    train(ddp, opt, sched, 1)
    if dist.get_rank() == 0:
        key = next(k for k in opt.local_state_tensors() if k.endswith("exp_avg"))
        opt.local_state_tensors()[key][0] = float("nan")
    ckpt.save(path, ddp, opt, sched, iteration=1)


def load_with_other_schedule(path: str) -> dict:
    """A scheduler whose max_lr differs from the checkpoint's: refused before anything is written."""
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("fp32", seed=11)
    sched.max_lr = 2e-2
    sched.use_checkpoint_opt_param_scheduler = False  # neither override nor take the checkpoint's: a mismatch
    before = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.local_state_tensors().values()]
    try:
        ckpt.load(path, ddp, opt, sched)
        error = None
    except mo.CheckpointError as exc:
        error = str(exc)
    after = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.local_state_tensors().values()]
    return dict(error=error, untouched=all(torch.equal(a, b) for a, b in zip(before, after)))


def chained_with_two_rules(path: str, phase: str) -> dict:
    """Dense AdamW + expert-parallel SGD children in one ChainedOptimizer: save, then load bitwise."""
    model, ddp, opt = _two_rule_chain(seed=0 if phase == "save" else 5)
    if phase == "save":
        _chain_step(ddp, opt, seed=1)
        ckpt.save(path, ddp, opt, iteration=1)
    else:
        ckpt.load(path, ddp, opt)
    return {k: v.clone() for k, v in opt.local_state_tensors().items()}


def _two_rule_chain(seed: int = 0):
    """Dense AdamW + expert-parallel SGD children in one ChainedOptimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for p in model[1].parameters():
        p.allreduce = False
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    adam = mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True)
    sgd = mo.OptimizerConfig(lr=1e-2, optimizer="sgd", use_distributed_optimizer=True)  # momentum 0.9
    opt = mo.ChainedOptimizer([mo.DistributedOptimizer(adam, [ddp], expert_parallel=False),
                               mo.DistributedOptimizer(sgd, [ddp], expert_parallel=True)])
    return model, ddp, opt


def _chain_step(ddp, opt, seed: int) -> None:
    torch.manual_seed(seed)
    ddp.zero_grad_buffer()
    ddp(torch.randn(4, 8)).square().sum().backward()
    assert opt.step()[0]


def chained_state_dict_round_trip() -> dict:
    """One state_dict covers the whole chain (both rules); a fresh chain that loads it continues bitwise."""
    model_a, ddp_a, opt_a = _two_rule_chain(seed=0)
    _chain_step(ddp_a, opt_a, seed=1)
    saved = opt_a.state_dict()
    model_b, ddp_b, opt_b = _two_rule_chain(seed=5)
    opt_b.load_state_dict(saved)
    a, b = opt_a.local_state_tensors(), opt_b.local_state_tensors()
    loaded_equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _chain_step(ddp_a, opt_a, seed=2)
    _chain_step(ddp_b, opt_b, seed=2)
    return dict(states=sorted(saved["state"]), loaded_equal=loaded_equal,
                params_equal=all(torch.equal(x, y) for x, y in zip(model_a.parameters(), model_b.parameters())),
                steps=(opt_a.scalar_state()["steps"], opt_b.scalar_state()["steps"]))


def state_dict_loads_where_covered(path: str) -> dict:
    """A one-rank state_dict (file ``path``) loads at this pool's DP size: every rank finds its elements."""
    model, ddp, opt, sched = build_run("bf16", seed=123)
    sd = torch.load(path, weights_only=False)[0]
    opt.load_state_dict(sd)
    return dict(masters=opt.gather_main_params(), scalars=opt.scalar_state())


def one_rank_state_dict(path: str) -> dict:
    """Train one step at DP=1 and keep the optimizer's state_dict in ``path`` (a list of one)."""
    torch.manual_seed(3)
    model, ddp, opt, sched = build_run("bf16", seed=7)
    train(ddp, opt, sched, 1)
    torch.save([opt.state_dict()], path)
    return dict(masters=opt.gather_main_params(), scalars=opt.scalar_state())


def data_parallel_inside_a_larger_world(path: str, phase: str) -> dict:
    """Each rank is its own data-parallel group (DP=1 in a world of 2, as under tensor parallelism with
    replicated params): the manifest records DP=1 and world size 2."""
    world = dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    torch.manual_seed(0)
    model = TinyLM(torch.float32, seed=7)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True),
                                     data_parallel_group=groups[dist.get_rank()])
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), ddp)
    with ckpt.Checkpointer() as checkpointer:
        if phase == "save":
            checkpointer.save(path, ddp, opt, iteration=1)
            return {}
        state = checkpointer.load(path, ddp, opt)
    return dict(saved_dp=state.saved_data_parallel_size, saved_world=state.saved_world_size, rng=state.rng_restored)
