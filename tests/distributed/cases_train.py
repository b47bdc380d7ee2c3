"""Worker-side cases for the train_step contract (CONTRACT rules 10-15, seeds T1.1-T1.4, T3.1-T3.3).

Every function here runs on each rank of a persistent gloo pool (tests/support/dist_harness.py) and returns
plain Python data; the assertions live in tests/distributed/test_contract_train.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_opt as mo
import megatron_opt.collectives as mo_collectives
from tests.support.common import (TinyLM, assert_identical_across_ranks, build, fp64_copy, global_batch,
                                  reference_adamw, token_loss_sum)

# The brief's probe has 10 elements, but megatron_opt's layout aligns param starts to 64 elements and
# shard boundaries to multiples of 64, so a 10-element vector always lies wholly in rank 0's shard.
# 300 elements make the shard boundaries cut through w: 192 | 108 at W=2, 128 | 128 | 44 at W=3.
PROBE_NUMEL = 300


# ----------------------------------------------------------------------------- probe model
class Probe(torch.nn.Module):
    """One fp32 vector w; a micro-batch with constant c has per-token loss c * w.sum()."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-0.9, 1.3, PROBE_NUMEL, dtype=torch.float32))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return c * self.w.sum()


def _probe_batch(entry) -> tuple:
    """entry = (c, n) or (c, n, a): constant, token count, aux constant. Batch size 1 (c has shape [1])."""
    c, n = entry[0], entry[1]
    a = entry[2] if len(entry) > 2 else 0.0
    return (torch.tensor([float(c)]), int(n), float(a))


def _make_probe_loss_fn(mode: str, aux: bool, inf_here: bool):
    def loss_fn(model, batch):
        c, n, a = batch
        per_token = model(c).sum()  # c * w.sum()
        if mode == "mean":
            out = per_token * (float("inf") if inf_here else 1.0)
            return (out, {"aux": a * model.module.w.sum()}) if aux else (out,)
        loss_sum = per_token * n
        if inf_here:
            loss_sum = loss_sum * float("inf")
        if aux:
            return loss_sum, n, {"aux": n * a * model.module.w.sum()}
        return loss_sum, n
    return loss_fn


def _dp_group(groups):
    """Create every listed group on every rank (same order), return the one holding this rank."""
    if groups is None:
        return None
    mine = None
    rank = dist.get_rank()
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def run_probe(scenario: dict) -> dict:
    """Train the probe with train_step through ``scenario['steps']``.

    scenario keys:
      steps: list over steps of a list over ranks of micro-batch entries (c, n[, a]);
      mode: 'per_token' (default) or 'mean'; aux: loss_fn also returns an aux term;
      inf: (step index, rank) whose loss is multiplied by inf; dp_groups: list of rank lists;
      scheduler: samples_per_step for an OptimizerParamScheduler (None: no scheduler);
      average_in_collective: DistributedDataParallelConfig flag (a ValueError is returned, not raised).
    Returns per step: the full w before and after (gathered by the param all-gather), the result
    fields and ddp.grad_scale_factor.
    """
    rank = dist.get_rank()
    group = _dp_group(scenario.get("dp_groups"))
    ddp_cfg = mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        average_in_collective=scenario.get("average_in_collective", False),
    )
    ddp = mo.DistributedDataParallel(Probe(), ddp_cfg, data_parallel_group=group)
    opt_cfg = mo.OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, lr=1.0,
                                 use_distributed_optimizer=True)
    opt = mo.get_megatron_optimizer(opt_cfg, ddp)
    sched, samples = None, scenario.get("scheduler")
    if samples is not None:
        sched = mo.OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10_000,
            lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        )
    mode = scenario.get("mode", "per_token")
    inf = scenario.get("inf")
    out = {"steps": [], "error": None}
    for s, per_rank in enumerate(scenario["steps"]):
        batches = [_probe_batch(e) for e in per_rank[rank]]
        loss_fn = _make_probe_loss_fn(mode, scenario.get("aux", False), inf is not None and tuple(inf) == (s, rank))
        w_before = ddp.module.w.detach().clone()
        sched_before = sched.num_steps if sched is not None else None
        try:
            res = mo.train_step(ddp, opt, sched, batches, loss_fn, loss_mode=mode,
                                samples_per_step=samples)
        except ValueError as exc:
            out["error"] = f"ValueError: {exc}"
            return out
        w_after = ddp.module.w.detach().clone()
        assert_identical_across_ranks(w_after)
        owned = sum(pc.param_range.size for shard in ddp.local_shards() for pc in shard.pieces)
        out["steps"].append({
            "owned_w": owned,
            "w_before": w_before.tolist(),
            "w_after": w_after.tolist(),
            "unchanged_bitwise": bool(torch.equal(w_before, w_after)),
            "finite": bool(torch.isfinite(w_after).all()),
            "loss": res.loss,
            "success": res.success,
            "grad_norm": res.grad_norm,
            "skip_reason": res.skip_reason,
            "skipped_steps": res.skipped_steps,
            "num_tokens": res.num_tokens,
            "aux_losses": dict(res.aux_losses),
            "grad_scale_factor": float(ddp.grad_scale_factor.item()),
            "grad_scale_factor_dtype": str(ddp.grad_scale_factor.dtype),
            "sched_before": sched_before,
            "sched_after": sched.num_steps if sched is not None else None,
            "lr": res.lr,
        })
    return out


# ----------------------------------------------------------------------------- TinyLM helpers
def lm_loss(model, batch):
    x, y = batch
    return token_loss_sum(model(x), y)


def _sequences(step: int, masked: int = 3) -> list:
    """Step ``step``'s global batch: 8 sequences with ragged labels, sequence ``masked`` fully masked."""
    seqs = global_batch(8, mb_size=1, seed=7 + 11 * step, ragged=True)
    x, y = seqs[masked]
    seqs[masked] = (x, torch.full_like(y, -100))
    return seqs


def _rank_microbatches(seqs: list, rank: int, world: int, ga: int, mbs: int) -> list:
    mine = seqs[rank * ga * mbs : (rank + 1) * ga * mbs]
    out = []
    for i in range(ga):
        chunk = mine[i * mbs : (i + 1) * mbs]
        out.append((torch.cat([c[0] for c in chunk]), torch.cat([c[1] for c in chunk])))
    return out


def run_partition(ga: int, mbs: int, steps: int = 3, lr: float = 1e-2, weight_decay: float = 0.1,
                  clip_grad: float = 1.0) -> dict:
    """T1.2: TinyLM fp32, AdamW, per_token train_step over W x GA x mbs = 8 sequences per step,
    against a single-process fp64 reference on the whole global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world * ga * mbs == 8
    model = TinyLM(torch.float32)
    ref = fp64_copy(model)
    ref_opt = reference_adamw(ref, lr, weight_decay)
    ddp, opt = build(model, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad)
    losses, ref_losses, norms, ref_norms, counts = [], [], [], [], []
    for step in range(steps):
        seqs = _sequences(step)
        res = mo.train_step(ddp, opt, None, _rank_microbatches(seqs, rank, world, ga, mbs), lm_loss)
        assert res.success, f"step {step} skipped unexpectedly"
        losses.append(res.loss)
        norms.append(res.grad_norm)
        counts.append(res.num_tokens)
        # reference: sum of token CE over the global batch / N, fp64, clip 1.0, torch AdamW
        ref_opt.zero_grad()
        x = torch.cat([s[0] for s in seqs])
        y = torch.cat([s[1] for s in seqs])
        loss_sum, n = token_loss_sum(ref(x), y)
        loss = loss_sum / n.clamp(min=1)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_grad)))
        ref_opt.step()
        ref_losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_identical_across_ranks(flat)
    params = {}
    for name, p in ref.named_parameters():
        ours = dict(model.named_parameters())[name].detach().double()
        theirs = p.detach()
        excess = ((ours - theirs).abs() - (1e-7 + 1e-5 * theirs.abs())).max()
        params[name] = {"allclose": bool(torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)),
                        "max_abs_err": float((ours - theirs).abs().max()), "max_excess": float(excess)}
    return {"params": params, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms, "num_tokens": counts}


# ----------------------------------------------------------------------------- T3.1: op recorder
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _inside_torch_distributed() -> bool:
    """True when the op is issued by a collective's own code: torch.distributed's Python (e.g. gloo's
    reduce_scatter copies its result into the output shard inside work.wait()), or megatron_opt's host
    reduce-scatter, whose owner adds the chunks it received (the sum gloo's all-reduce does inside
    gloo). Part of the collective, not a pass."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in filename or filename.endswith("/megatron_opt/host_reduction.py"):
            return True
        frame = frame.f_back
    return False


class GradBufferSpy(TorchDispatchMode):
    """Records every aten op that writes into (mutable or out= argument) or reads (any other tensor
    argument, view ops excluded) the storage of the DDP grad buffers."""

    def __init__(self, storage_ptrs: set) -> None:
        super().__init__()
        self.ptrs = storage_ptrs
        self.phase = "train_step"
        self.writes: list = []
        self.reads: list = []
        self.collectives: list = []

    def _hits(self, value) -> bool:
        for t in _tensors(value):
            try:
                if t.untyped_storage().data_ptr() in self.ptrs:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        wrote = read = False
        pos = 0
        for arg in schema.arguments:
            if not arg.kwarg_only and pos < len(args):
                value = args[pos]
                pos += 1
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                continue
            if not self._hits(value):
                continue
            if arg.alias_info is not None and arg.alias_info.is_write:
                wrote = True
            else:
                read = True
        if wrote or read:
            if func.namespace in _COLLECTIVE_NAMESPACES or _inside_torch_distributed():
                self.collectives.append((self.phase, f"{func.namespace}.{name}"))
            elif wrote:
                self.writes.append((self.phase, name))
            elif not is_view:
                self.reads.append((self.phase, name))
        return func(*args, **kwargs)


def _inject_extra_pass():
    """Make set_grad_scale_factor also multiply the grad buffers (the pass rule 12 forbids)."""
    original = mo.DistributedDataParallel.set_grad_scale_factor

    def patched(self, factor):
        original(self, factor)
        for buf in self.buffers:
            buf.grad_data.mul_(self.grad_scale_factor)
        self.grad_scale_factor.fill_(1.0)

    mo.DistributedDataParallel.set_grad_scale_factor = patched
    return original


def run_op_count(ga: int, steps: int = 2, inject_extra_pass: bool = False) -> dict:
    """T3.1: record grad-buffer writes and reads during train_step (TinyLM fp32, per_token)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM(torch.float32)
    ddp, opt = build(model, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    ptrs = {buf.grad_data.untyped_storage().data_ptr() for buf in ddp.buffers}
    spy = GradBufferSpy(ptrs)
    inner_step = opt.step

    def spied_step(*a, **k):
        spy.phase = "optimizer.step"
        try:
            return inner_step(*a, **k)
        finally:
            spy.phase = "train_step"

    opt.step = spied_step
    original = _inject_extra_pass() if inject_extra_pass else None
    per_step = []
    try:
        for step in range(steps):
            batches = global_batch(world * ga, mb_size=2, seed=40 + step, ragged=True)
            mine = batches[rank * ga : (rank + 1) * ga]
            spy.writes, spy.reads, spy.collectives = [], [], []
            with spy:
                res = mo.train_step(ddp, opt, None, mine, lm_loss)
            assert res.success
            per_step.append({
                "writes": [list(w) for w in spy.writes],
                "reads": [list(r) for r in spy.reads],
                "collectives": [list(c) for c in spy.collectives],
            })
    finally:
        if original is not None:
            mo.DistributedDataParallel.set_grad_scale_factor = original
        del opt.step
    return {"per_step": per_step, "num_params": sum(len(b.params) for b in ddp.buffers),
            "num_buffers": len(ddp.buffers)}


# ----------------------------------------------------------------------------- T3.3
def run_prescale_vs_postscale(ga: int = 4, steps: int = 2) -> dict:
    """T3.3: train_step's per_token path (no pre-scale, 1/N in the unscale scalar) against an explicit
    post-scaled reference (raw-sum backward over the global batch, then .grad / N_global), SGD lr 1.
    Also spies every collectives.all_reduce and records the phase it was made in, through public
    functions only: "optimizer.step" (inside the optimizer's step()), "agreement" (inside
    collectives.agree_each_step, outside the step) or "train_step" (train_step's own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM(torch.float32)
    ref = fp64_copy(model)
    ddp, opt = build(model, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, lr=1.0)
    calls: list = []
    state = {"step": 0, "phase": "train_step"}
    inner_all_reduce, inner_agree, inner_step = mo_collectives.all_reduce, mo_collectives.agree_each_step, opt.step

    def in_phase(phase, fn):
        def wrapped(*a, **k):
            outer = state["phase"]
            state["phase"] = phase if outer == "train_step" else outer  # the outermost phase names the call
            try:
                return fn(*a, **k)
            finally:
                state["phase"] = outer
        return wrapped

    def spy(tensor, group, *a, **k):
        calls.append({"step": state["step"], "phase": state["phase"], "numel": tensor.numel(),
                      "dtype": str(tensor.dtype)})
        return inner_all_reduce(tensor, group, *a, **k)

    rel_diffs: list = []
    mo_collectives.all_reduce = spy
    mo_collectives.agree_each_step = in_phase("agreement", inner_agree)
    opt.step = in_phase("optimizer.step", inner_step)
    try:
        for step in range(steps):
            batches = global_batch(world * ga, mb_size=2, seed=60 + step, ragged=True)
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            res = mo.train_step(ddp, opt, None, batches[rank * ga : (rank + 1) * ga], lm_loss)
            assert res.success
            state["step"] += 1
            # explicit post-scaled reference from the same starting point
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p.copy_(before[n])
            ref.zero_grad(set_to_none=True)
            total = 0
            for x, y in batches:
                loss_sum, n = token_loss_sum(ref(x), y)
                loss_sum.backward()  # raw sums, no pre-scale
                total += int(n)
            diffs = {}
            with torch.no_grad():
                for name, p in ref.named_parameters():
                    p.grad /= max(total, 1)  # post-scale by the global count
                    expected = before[name] - p.grad  # SGD lr 1
                    ours = dict(model.named_parameters())[name].detach().double()
                    scale = (expected - before[name]).abs().max().clamp_min(1e-30)
                    diffs[name] = {
                        "param_rel": float((ours - expected).abs().max() / expected.abs().max().clamp_min(1e-30)),
                        "update_rel": float(((ours - before[name]) - (expected - before[name])).abs().max() / scale),
                    }
            rel_diffs.append({"diffs": diffs, "N": total, "num_tokens": res.num_tokens})
    finally:
        mo_collectives.all_reduce, mo_collectives.agree_each_step = inner_all_reduce, inner_agree
        del opt.step
    return {"steps": rel_diffs, "calls": calls}
