"""Worker-side cases for CONTRACT rules 1-9 (the optimizer and the DDP buffers)."""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

import megatron_opt as mo
from megatron_opt import ops
from megatron_opt import collectives
from tests.support.common import (Probe, TinyLM, assert_identical_across_ranks, build, flat_params, fp64_copy,
                    full_main_params, full_reduced_grads, global_batch, microbatch_contexts,
                    sgd_exact, token_loss_sum)


def _tokens_batch(counts: list[int], seed: int) -> list:
    """Micro-batches of one sequence whose first n labels are supervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        tokens = torch.randint(0, 64, (1, 8), generator=g)
        labels = torch.randint(0, 64, (1, 8), generator=g)
        labels[:, n:] = -100
        out.append((tokens, labels))
    return out


def _lm_loss(model, batch):
    x, y = batch
    return token_loss_sum(model(x), y)


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _optimizer_state(opt) -> list[torch.Tensor]:
    return [t.clone() for t in opt.local_state_tensors().values()]


def _poison_first_owned_grad(ddp, offset: int = 0) -> None:
    shard = next(s for s in ddp.local_shards() if s.pieces)
    shard.grad[shard.pieces[0].shard_range.start + offset] = float("inf")


# --------------------------------------------------------------------------- rule 1
def rule01_prepare_once() -> dict:
    """W=2, fp32 grad buffer (the aliasing case of seed 000), constant loss scale 1024, GA=2,
    tokens rank0 [4,6], rank1 [5,3]."""
    rank = dist.get_rank()
    all_batches = [_tokens_batch(c, seed=10 + r) for r, c in enumerate([[4, 6], [5, 3]])]
    n_global = 18

    def run(split_api: bool):
        model = TinyLM()
        ref = fp64_copy(model)
        ddp, opt = build(model, loss_scale=1024.0, clip_grad=1.0)
        calls = {"stats": 0, "update": 0}
        real_stats, real_update = ops.grad_stats, opt.grad_scaler.update

        def counting_stats(plan, *a, **k):  # one call per launch group: count the shards it covers
            calls["stats"] += len(plan.shards)
            return real_stats(plan, *a, **k)

        def counting_update(*a, **k):
            calls["update"] += 1
            return real_update(*a, **k)

        ops.grad_stats, opt.grad_scaler.update = counting_stats, counting_update
        try:
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for ctx, batch in zip(microbatch_contexts(ddp, 2), all_batches[rank]):
                with ctx:
                    loss_sum, _ = _lm_loss(ddp, batch)
                    opt.scale_loss(loss_sum).backward()
            ddp.set_grad_scale_factor(1.0 / n_global)
            ddp.finish_grad_sync()
            grads_before = [b.grad_data.clone() for b in ddp.buffers]
            raised = None
            if split_api:
                assert opt.prepare_grads() is False
                try:
                    opt.step()
                except RuntimeError as exc:
                    raised = str(exc)
                norm = opt.get_grad_norm()
                opt.clip_grad_norm(1.0)
                assert opt.step_with_ready_grads() is True
            else:
                success, norm, _ = opt.step()
                assert success
        finally:
            ops.grad_stats, opt.grad_scaler.update = real_stats, real_update
        unchanged = all(torch.equal(a, b.grad_data) for a, b in zip(grads_before, ddp.buffers))
        ref_loss = sum(_lm_loss(ref, b)[0] for bs in all_batches for b in bs) / n_global
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        shards = sum(1 for s in ddp.local_shards() if s.pieces)
        return dict(calls=calls, shards=shards, norm=norm, ref_norm=ref_norm, grads_unchanged=unchanged,
                    raised=raised, params=flat_params(model))

    return {"plain": run(split_api=False), "split": run(split_api=True)}


# --------------------------------------------------------------------------- rule 2
def rule02_scaler_cadence() -> dict:
    """fp16 probe, dynamic scaler 2^16, growth_interval 4, hysteresis 1: 8 clean steps -> 2^18."""
    rank = dist.get_rank()
    model = Probe(torch.float16)
    ddp, opt = build(model, **sgd_exact(lr=1e-6), fp16=True, initial_loss_scale=2.0**16,
                     loss_scale_window=4, hysteresis=1)
    updates = []
    real_update = opt.grad_scaler.update
    opt.grad_scaler.update = lambda found_inf: (updates.append(bool(found_inf)), real_update(found_inf))[1]
    for step in range(8):
        mo.train_step(ddp, opt, None, [(1e-3 * (rank + 1), 2)], lambda m, b: (m(b[0]) * b[1], b[1]))
    return {"scale": float(opt.get_loss_scale()), "growth_tracker": opt.grad_scaler.state_dict()["growth_tracker"],
            "updates": updates}


# --------------------------------------------------------------------------- rules 3 and 4
@contextlib.contextmanager
def _all_reduces_by_kind() -> Iterator[dict]:
    """Count the all-reduces made inside the block, through the public collectives module: those of an
    agreement (collectives.agree_each_step: fail on every rank together) in ``agreement_all_reduces``,
    every other one per group (the group's global ranks) in ``stats_all_reduces``."""
    counts: dict = {"stats_all_reduces": {}, "agreement_all_reduces": 0}
    inside_agreement = []
    real_all_reduce, real_agree = collectives.all_reduce, collectives.agree_each_step

    def all_reduce(tensor, group, *args, **kwargs):
        if inside_agreement:
            counts["agreement_all_reduces"] += 1
        else:
            ranks = tuple(collectives.global_ranks(group))
            counts["stats_all_reduces"][ranks] = counts["stats_all_reduces"].get(ranks, 0) + 1
        return real_all_reduce(tensor, group, *args, **kwargs)

    def agree_each_step(*args, **kwargs):
        inside_agreement.append(True)
        try:
            return real_agree(*args, **kwargs)
        finally:
            inside_agreement.pop()

    collectives.all_reduce, collectives.agree_each_step = all_reduce, agree_each_step
    try:
        yield counts
    finally:
        collectives.all_reduce, collectives.agree_each_step = real_all_reduce, real_agree


def rule03_global_overflow_decision() -> dict:
    """inf planted in one element of rank 1's own shard only: every rank must skip, the scaler backs
    off exactly once, nothing changes, and the decision takes one packed all-reduce."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    cfg = mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True)
    scaler = mo.DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 1000, 1)
    opt = mo.DistributedOptimizer(cfg, [ddp], mo.get_param_groups([ddp], cfg), grad_scaler=scaler)
    results = []
    for step in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        x, y = global_batch(2, seed=5 + step)[rank]
        opt.scale_loss(token_loss_sum(ddp(x), y)[0]).backward()
        ddp.finish_grad_sync()
        if step == 1 and rank == 1:
            _poison_first_owned_grad(ddp, offset=1)
        before_params, before_state = flat_params(model), _optimizer_state(opt)
        with _all_reduces_by_kind() as calls:
            out = opt.step()
        results.append(dict(
            out=out, scale=float(opt.get_loss_scale()), **calls,
            params_unchanged=torch.equal(before_params, flat_params(model)),
            state_unchanged=all(torch.equal(a, b) for a, b in zip(before_state, _optimizer_state(opt))),
            skipped=opt.skipped_steps, reason=opt.last_skip_reason and opt.last_skip_reason.value))
    return {"steps": results}


def rule04_skip_is_normal(precision: str) -> dict:
    """A NaN loss on rank 1 in step 2 of 3 through train_step: (False, None, None), params, masters,
    moments and step counter bitwise unchanged, the scheduler does not advance, the skip is logged,
    and the next step works. fp32 with a constant scaler, bf16 without one."""
    rank = dist.get_rank()
    dtype, extra = (torch.float32, dict(loss_scale=8.0)) if precision == "fp32" else (torch.bfloat16, dict(bf16=True))
    model = TinyLM(dtype)
    ddp, opt = build(model, **extra)
    sched = mo.OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=4,
                                       lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                       wd_incr_steps=100, wd_incr_style="constant")
    capture = _LogCapture()
    logging.getLogger("megatron_opt").addHandler(capture)
    records = []
    try:
        for step in range(3):
            poison = step == 1 and rank == 1
            batches = [global_batch(2, seed=20 + step)[rank]]

            def loss_fn(m, b):
                loss, n = _lm_loss(m, b)
                return (loss * float("nan") if poison else loss), n

            before = (flat_params(model), _optimizer_state(opt), sched.num_steps, [g["lr"] for g in opt.param_groups])
            res = mo.train_step(ddp, opt, sched, batches, loss_fn)
            after = (flat_params(model), _optimizer_state(opt), sched.num_steps, [g["lr"] for g in opt.param_groups])
            records.append(dict(
                success=res.success, grad_norm=res.grad_norm, num_zeros=res.num_zeros, reason=res.skip_reason,
                skipped=res.skipped_steps, sched_before=before[2], sched_after=after[2],
                params_unchanged=torch.equal(before[0], after[0]),
                state_unchanged=all(torch.equal(a, b) for a, b in zip(before[1], after[1])),
                lr_unchanged=before[3] == after[3]))
    finally:
        logging.getLogger("megatron_opt").removeHandler(capture)
    return {"steps": records, "log": capture.messages}


# --------------------------------------------------------------------------- rule 5
def rule05_step_returns(log_zeros: bool) -> dict:
    """grad_norm is the unscaled global norm before clipping (clipping active); num_zeros counts zero
    gradient elements over all ranks when asked, else None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM()
    ref = fp64_copy(model)
    ddp, opt = build(model, clip_grad=0.5, log_num_zeros_in_grad=log_zeros, loss_scale=64.0)
    batches = global_batch(world, seed=3)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    x, y = batches[rank]
    loss, n = token_loss_sum(ddp(x), y)
    opt.scale_loss(loss / n * 20).backward()
    out = opt.step()
    ref_loss = sum(token_loss_sum(ref(bx), by)[0] / (by != -100).sum() for bx, by in batches) / world * 20
    ref_loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    ref_zeros = int(sum((p.grad == 0).sum() for p in ref.parameters()))
    return {"out": out, "ref_norm": ref_norm, "ref_zeros": ref_zeros}


# --------------------------------------------------------------------------- rule 6
def rule06_leaf_and_aliasing(precision: str) -> dict:
    """Every optimizer tensor is a leaf; a torch optimizer can be rebuilt from param_groups; a step
    raises no warning; fp32 shards alias the model param; bf16 masters are separate fp32 tensors."""
    dtype, extra = (torch.float32, {}) if precision == "fp32" else (torch.bfloat16, dict(bf16=True))
    model = TinyLM(dtype)
    ddp, opt = build(model, **extra)
    params = [p for g in opt.param_groups for p in g["params"]]
    leaf = all(p.is_leaf and p.grad_fn is None for p in params)
    rebuilt = torch.optim.AdamW([{**g, "params": list(g["params"])} for g in opt.param_groups if g["params"]])
    rebuilt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    aliases, separate = [], []
    for p in model.parameters():
        main = p.main_param
        if main is None:
            continue
        shares = main.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        (aliases if p.dtype == torch.float32 else separate).append(shares)
    x, y = global_batch(dist.get_world_size(), seed=1)[dist.get_rank()]
    keep_before = model.keep_a.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss, n = token_loss_sum(ddp(x), y)
        (loss / n).backward()
        success, _, _ = opt.step()
    moved = not torch.equal(keep_before, model.keep_a.detach())
    masters = full_main_params(ddp, opt)
    model_matches_master = all(torch.equal(p.detach(), masters[n].to(p.dtype)) for n, p in model.named_parameters())
    return dict(leaf=leaf, n_params=len(params), rebuilt_groups=len(rebuilt.param_groups), aliases=aliases,
                separate=separate, success=success, keep_moved=moved, model_matches_master=model_matches_master)


def rule06_state_dict_round_trip() -> dict:
    """Save after 2 steps, load into a fresh optimizer (fresh model with the same init), and the next
    step is bitwise identical; loading another model's state_dict is a clear error."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def make():
        model = TinyLM(torch.bfloat16)
        return (model, *build(model, bf16=True, fp16=False))

    def one_step(ddp, opt, step):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        x, y = global_batch(world, seed=40 + step)[rank]
        loss, n = token_loss_sum(ddp(x), y)
        (loss / n).backward()
        assert opt.step()[0]

    model_a, ddp_a, opt_a = make()
    for step in range(2):
        one_step(ddp_a, opt_a, step)
    saved = opt_a.state_dict()
    model_b, ddp_b, opt_b = make()
    with torch.no_grad():
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            pb.copy_(pa)
    opt_b.load_state_dict(saved)
    one_step(ddp_a, opt_a, 2)
    one_step(ddp_b, opt_b, 2)
    leaf = all(p.is_leaf for g in opt_b.param_groups for p in g["params"])
    other = Probe()
    _, opt_other = build(other)
    try:
        opt_other.load_state_dict(saved)
        error = None
    except ValueError as exc:
        error = str(exc)
    return dict(equal=torch.equal(flat_params(model_a), flat_params(model_b)), leaf=leaf, error=error,
                step_a=opt_a.step_count, step_b=opt_b.step_count)


# --------------------------------------------------------------------------- rule 7
class _DeferredLinear(torch.autograd.Function):
    """Returns no weight gradient from backward; queues a closure that computes it later."""

    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return x @ weight.t()

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        ctx.store.append((weight, lambda: gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])))
        return gy @ weight, None, None


class MixedGradModel(torch.nn.Module):
    """(i) a deferred-wgrad weight, (ii) a bias with an immediate grad, (iii) a param used only in the
    last micro-batch, (iv) a param never used."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter((torch.randn(8, 8, generator=g) * 0.5).to(dtype))
        self.bias = torch.nn.Parameter((torch.randn(8, generator=g) * 0.1).to(dtype))
        self.late = torch.nn.Parameter((torch.randn(8, generator=g) * 0.1).to(dtype))
        self.unused = torch.nn.Parameter(torch.randn(5, generator=g).to(dtype))
        self.store: list = []

    def forward(self, x, use_late: bool):
        h = _DeferredLinear.apply(x.to(self.weight.dtype), self.weight, self.store) + self.bias
        if use_late:
            h = h + self.late
        return h

    def flush(self, add_grad):
        while self.store:
            param, compute = self.store.pop(0)
            add_grad(param, compute())


def _mixed_batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def rule07_one_dtype_and_complete_accumulation(overlap: bool) -> dict:
    """bf16 params, fp32 reduce buffer, GA=3: every reduce-scatter carries float32 only, deferred,
    last-micro-batch-only and unused params are all inside the reduction, and a gradient flushed after
    its bucket was launched raises LateGradientError."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MixedGradModel()
    ref = MixedGradModel().double()  # the same (bf16-rounded) initial values, in fp64
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        bucket_size=16 if overlap else None))
    dtypes = []
    # every collective megatron_opt issues goes through megatron_opt.collectives (on gloo its
    # reduce-scatter is an all-reduce underneath): observe the reduce-scatter there
    real_rs = collectives.reduce_scatter
    collectives.reduce_scatter = (
        lambda full, shard, *a, **k: (dtypes.append((shard.dtype, full.dtype)), real_rs(full, shard, *a, **k))[1])
    try:
        ddp.zero_grad_buffer()
        for i, ctx in enumerate(microbatch_contexts(ddp, 3)):
            with ctx:
                x, t = _mixed_batch(rank, i)
                (ddp(x, use_late=(i == 2)).float() * t).sum().backward()
                model.flush(ddp.add_grad)
        ddp.finish_grad_sync()
    finally:
        collectives.reduce_scatter = real_rs
    ours = full_reduced_grads(ddp)
    for r in range(world):  # the fp64 reference: the same global batch, summed, mean over ranks
        for i in range(3):
            x, t = _mixed_batch(r, i)
            ((ref(x, use_late=(i == 2)) * t.double()).sum() / world).backward()
            ref.flush(lambda p, g: setattr(p, "grad", g if p.grad is None else p.grad + g))
    refs = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    late_error = None
    try:
        x, t = _mixed_batch(rank, 9)
        (ddp(x, use_late=False).float() * t).sum().backward()
        model.flush(ddp.add_grad)
    except mo.LateGradientError as exc:
        late_error = str(exc)
    return dict(dtypes=[(str(a), str(b)) for a, b in dtypes], ours=ours, refs=refs, late_error=late_error,
                buffer_dtypes=[str(b.grad_data.dtype) for b in ddp.buffers])


# --------------------------------------------------------------------------- rule 8
def rule08_fp32_accumulation() -> dict:
    """GA=64 bf16 gradients of ~1e-3 with mixed signs accumulate in an fp32 main grad: the sum is within
    1e-6 (relative to sum|g|) of fp64; the accumulator survives micro-batch boundaries and is cleared
    only by zero_grad_buffer()."""
    rank = dist.get_rank()
    model = Probe(torch.bfloat16)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    g = torch.Generator().manual_seed(11 + rank)
    cs = ((torch.rand(64, generator=g) - 0.5) * 2e-3).to(torch.bfloat16).double()
    ddp.zero_grad_buffer()
    for i, ctx in enumerate(microbatch_contexts(ddp, 64)):
        with ctx:
            model(float(cs[i])).backward()
        if i == 31:
            halfway = model.w.main_grad.clone()
    local = model.w.main_grad.double().clone()
    ddp.zero_grad_buffer()
    cleared = bool((model.w.main_grad == 0).all())
    return dict(dtype=str(model.w.main_grad.dtype), local=local, expected=float(cs.sum()),
                abs_sum=float(cs.abs().sum()), halfway=halfway.double(), expected_half=float(cs[:32].sum()),
                cleared=cleared)


# --------------------------------------------------------------------------- rule 9
def rule09_every_microbatch() -> dict:
    """Distinct constants per micro-batch (the last included) on W ranks x GA=3: the applied update is
    the mean of all of them, and the full params are bitwise identical on all ranks afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Probe(torch.float32, numel=23)
    ddp, opt = build(model, **sgd_exact())
    cs = [float(1 + 3 * rank + i) * (1.0 if i < 2 else 10.0) for i in range(3)]
    res = mo.train_step(ddp, opt, None, cs, lambda m, c: (m(c),), loss_mode="mean")
    assert_identical_across_ranks(flat_params(model))
    expected = (sum(float(1 + 3 * r + i) * (1.0 if i < 2 else 10.0) for r in range(world) for i in range(3))
                / (3 * world))
    return dict(update=(1.0 - model.w.detach().double()), expected=expected, success=res.success)


def fp16_trajectory_then_one_rank_overflow() -> dict:
    """fp16 probe with AdamW through train_step: 2^16, growth_interval 4, hysteresis 1; after 8 clean
    steps the scale is 2^18; then an inf planted after the reduction in rank 1's own shard only makes
    every rank skip, halves the scale once, and leaves Adam state and the scheduler unchanged."""
    rank = dist.get_rank()
    model = Probe(torch.float16, numel=300)  # shards cut through w at DP 2
    ddp, opt = build(model, lr=1e-3, fp16=True, initial_loss_scale=2.0**16, loss_scale_window=4, hysteresis=1,
                     weight_decay=0.0)
    sched = mo.OptimizerParamScheduler(opt, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                                       lr_decay_steps=1000, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=1000, wd_incr_style="constant")
    real_finish = ddp.finish_grad_sync
    poison = {"on": False}

    def finish_and_poison():
        real_finish()
        if poison["on"] and rank == 1:
            _poison_first_owned_grad(ddp)

    ddp.finish_grad_sync = finish_and_poison
    batch = [(torch.tensor(1e-3 * (rank + 1)), 2)]
    loss_fn = lambda m, b: (m(b[0]) * b[1], b[1])  # noqa: E731
    for _ in range(8):
        assert mo.train_step(ddp, opt, sched, batch, loss_fn, samples_per_step=2).success
    after_clean = float(opt.get_loss_scale())
    owns = any(s.pieces for s in ddp.local_shards())
    before = (flat_params(model), _optimizer_state(opt), sched.num_steps)
    poison["on"] = True
    res = mo.train_step(ddp, opt, sched, batch, loss_fn, samples_per_step=2)
    after = (flat_params(model), _optimizer_state(opt), sched.num_steps)
    return dict(after_clean=after_clean, owns=owns, success=res.success, scale=float(opt.get_loss_scale()),
                params_unchanged=torch.equal(before[0], after[0]),
                state_unchanged=all(torch.equal(a, b) for a, b in zip(before[1], after[1])),
                sched_unchanged=before[2] == after[2], reason=res.skip_reason)


def norm_threshold_skip() -> dict:
    """grad_norm_skip_threshold: a step whose norm exceeds it is skipped like an overflow (nothing
    changes, logged with its reason), and the loss scaler is left exactly as it was."""
    rank = dist.get_rank()
    model = TinyLM()
    ddp, opt = build(model, grad_norm_skip_threshold=1e-3, loss_scale=None)
    scaler = mo.DynamicGradScaler(2.0**8, 1.0, 2.0, 0.5, 2, 1)
    opt.grad_scaler = scaler
    capture = _LogCapture()
    logging.getLogger("megatron_opt").addHandler(capture)
    try:
        before = (flat_params(model), _optimizer_state(opt))
        res = mo.train_step(ddp, opt, None, [global_batch(2, seed=2)[rank]], _lm_loss)
        after = (flat_params(model), _optimizer_state(opt))
    finally:
        logging.getLogger("megatron_opt").removeHandler(capture)
    return dict(success=res.success, norm=res.grad_norm, reason=res.skip_reason,
                tracker=scaler.state_dict()["growth_tracker"], scale=float(scaler.scale),
                unchanged=(torch.equal(before[0], after[0])
                           and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))),
                log=capture.messages)
