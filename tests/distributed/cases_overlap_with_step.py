"""Worker-side cases for OptimizerConfig.overlap_param_gather_with_optimizer_step.

TinyLM split into two model chunks (as virtual-pipeline chunks are), each its own
DistributedDataParallel with overlap_param_gather; get_megatron_optimizer then builds one child
for the first chunk and one for the rest, and the step all-gathers the first chunk's params while
the second child updates. Every case runs on every rank of a gloo pool.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import megatron_opt as mo
from tests.support.common import (TinyLM, assert_identical_across_ranks, cosine_diff, flat_params, global_batch,
                    rank_microbatches, rel_l2, token_loss_sum)
from tests.distributed.cases_parity import PRECISIONS, MasterWeightReference


class FirstChunk(torch.nn.Module):
    """TinyLM's embedding and first layer (its params are TinyLM's, under the same names)."""

    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.emb, self.fc = lm.emb, lm.fc

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(self.emb(tokens)))


class LastChunk(torch.nn.Module):
    """The rest of TinyLM.forward, from the first layer's output."""

    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.keep_a, self.keep_d, self.norm, self.out = lm.keep_a, lm.keep_d, lm.norm, lm.out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = torch.tanh(h[..., :7]) @ self.keep_a.to(h.dtype).view(7, -1)
        h = h + 0.5 * mix + torch.cat([h[..., :7] * self.keep_d.to(h.dtype), torch.zeros_like(h[..., 7:])], -1)
        return self.out(self.norm(h))


def build_chunks(lm: TinyLM, overlap_with_step: bool, *, grad_fp32: bool = True, overlap_param: bool = True,
                 **opt_kwargs):
    """Two DDP chunks (several buckets each) and the optimizer the factory builds for them."""
    ddp_cfg = mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=True,
        overlap_param_gather=overlap_param, bucket_size=200)
    chunks = [mo.DistributedDataParallel(FirstChunk(lm), ddp_cfg), mo.DistributedDataParallel(LastChunk(lm), ddp_cfg)]
    cfg = mo.OptimizerConfig(use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=overlap_with_step,
                             **{"lr": 1e-2, **opt_kwargs})
    return chunks, mo.get_megatron_optimizer(cfg, chunks)


def train_step(chunks: list, opt, batches: list) -> tuple:
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    ga = len(batches)
    for i, (x, y) in enumerate(batches):
        with contextlib.ExitStack() as no_sync:
            if i < ga - 1:  # every chunk reduces its gradients on the last micro-batch only
                for c in chunks:
                    no_sync.enter_context(c.no_sync())
            loss_sum, n = token_loss_sum(chunks[1](chunks[0](x)), y)
            opt.scale_loss(loss_sum / n / ga).backward()
    return opt.step()


def run_parity(precision: str, steps: int = 4, ga: int = 2, clip_grad: float = 1.0, lr: float = 1e-2,
               weight_decay: float = 0.1, device_step: bool = False) -> dict:
    """The same run with overlap_param_gather_with_optimizer_step off and on, against the float64
    AdamW reference on the same global batch. Returns the update errors of the 'on' run and whether
    the two runs agree bitwise (params, masters and norms). ``device_step``: the 'on' run decides the
    step on the device (optimizer_cuda_graph; eager on CPU)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = PRECISIONS[precision]
    runs = {}
    for overlap_with_step in (False, True):
        lm = TinyLM(spec["dtype"])
        ref = MasterWeightReference(lm, lr, weight_decay) if overlap_with_step else None
        chunks, opt = build_chunks(lm, overlap_with_step, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                   optimizer_cuda_graph=device_step and overlap_with_step, **spec["opt"])
        children = opt.chained_optimizers if isinstance(opt, mo.ChainedOptimizer) else [opt]
        assert len(children) == (2 if overlap_with_step else 1), children
        assert [c.overlap_param_gather_with_optimizer_step for c in chunks] == [overlap_with_step, False]
        assert all(sum(len(b.buckets) for b in c.buffers) >= 2 for c in chunks), "each chunk needs several buckets"
        init = {n: p.detach().double().clone() for n, p in lm.named_parameters()}
        norms = []
        for step in range(steps):
            batches = global_batch(world * ga, seed=100 + step)
            success, norm, _ = train_step(chunks, opt, rank_microbatches(batches, rank, world))
            success, norm = bool(success), float(norm)  # device tensors with optimizer_cuda_graph
            assert success, f"step {step} skipped"
            norms.append((norm, ref.step(batches, clip_grad, world) if ref is not None else None))
        for c in chunks:
            c.finish_param_sync()
        assert_identical_across_ranks(flat_params(lm))
        masters = opt.gather_main_params()
        runs[overlap_with_step] = {"params": flat_params(lm).clone(), "masters": masters, "norms": norms,
                                   "ref": ref, "init": init}
    off, on = runs[False], runs[True]
    errors = {}
    for name, p in on["ref"].masters.named_parameters():
        delta_ours, delta_ref = on["masters"][name].double() - on["init"][name], p.detach() - on["init"][name]
        errors[name] = (rel_l2(delta_ours, delta_ref), cosine_diff(delta_ours, delta_ref))
    same = (torch.equal(off["params"], on["params"]) and off["masters"].keys() == on["masters"].keys()
            and all(torch.equal(off["masters"][n], on["masters"][n]) for n in off["masters"])
            and [a for a, _ in off["norms"]] == [a for a, _ in on["norms"]])
    return {"errors": errors, "norms": on["norms"], "bitwise_same_as_off": same}


def _range_names(prof) -> list[str]:
    """megatron_opt's own profiler ranges of the step, in the order they started."""
    wanted = ("megatron_opt.pass2", "megatron_opt.param_sync")
    events = [e for e in prof.events() if e.name in wanted]
    return [e.name.split(".")[1] for e in sorted(events, key=lambda e: e.time_range.start)]


def _gathers(prof) -> int:
    return sum(1 for e in prof.events() if "all_gather" in e.name.lower() or "allgather" in e.name.lower())


def run_dispatch_order(overlap_with_step: bool) -> dict:
    """One profiled step: the order of pass 2 and the param all-gather dispatches, and which
    start_param_sync() calls of the chunks issue an all-gather afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = TinyLM()
    chunks, opt = build_chunks(lm, overlap_with_step)
    batches = rank_microbatches(global_batch(world * 2, seed=3), rank, world)
    train_step(chunks, opt, batches)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        success, _, _ = train_step(chunks, opt, batches)
        # Wait for the all-gathers inside the profiled region: a gloo Work made while profiling and
        # freed after the profiler stopped frees the profiler's thread-local state twice (torch 2.13
        # segfaults in ~ThreadLocalSubqueue, intermittently).
        for c in chunks:
            c.finish_param_sync()
    out = {"success": bool(success), "order": _range_names(prof)}
    calls = {"first": lambda: chunks[0].start_param_sync(), "last": lambda: chunks[1].start_param_sync(),
             "first_forced": lambda: chunks[0].start_param_sync(force_dispatch=True)}
    for name, call in calls.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
            for c in chunks:
                c.finish_param_sync()
        out[name] = _gathers(prof)
    return out


def run_unwrapped_overlap_error() -> dict:
    """overlap_param_gather_with_optimizer_step without overlap_param_gather on the chunks."""
    try:
        build_chunks(TinyLM(), True, overlap_param=False)
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        return {"kind": type(exc).__name__, "message": str(exc)}
    return {"kind": "", "message": ""}


def run_second_child_fails_on_one_rank() -> dict:
    """The second child's update raises on rank 1 after the first child's all-gather was dispatched on
    every rank: every rank raises RankError, none waits in a collective the others never join."""
    rank = dist.get_rank()
    lm = TinyLM()
    ddp_cfg = mo.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True,
                                               bucket_size=200)
    chunks = [mo.DistributedDataParallel(FirstChunk(lm), ddp_cfg), mo.DistributedDataParallel(LastChunk(lm), ddp_cfg)]

    class Flaky(mo.SGD):
        def apply(self, *a, **k):
            if rank == 1:
                raise FloatingPointError("second child's update failed")
            return super().apply(*a, **k)

    cfg = mo.OptimizerConfig(lr=1e-2, optimizer="sgd", use_distributed_optimizer=True,
                             overlap_param_gather_with_optimizer_step=True)
    opt = mo.ChainedOptimizer([mo.DistributedOptimizer(cfg, [chunks[0]]),
                               mo.DistributedOptimizer(cfg, [chunks[1]], update_rule=Flaky(momentum=0.9))])
    batches = rank_microbatches(global_batch(4, seed=1), rank, dist.get_world_size())
    start = time.monotonic()
    error = None
    try:
        train_step(chunks, opt, batches)
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    for c in chunks:
        c.finish_param_sync()
    first = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    return {"error": error, "seconds": time.monotonic() - start, "first_chunk": torch.cat([t.reshape(-1) for t in
                                                                                            first.values()])}


def run_save(path: str, steps: int = 2) -> dict:
    """Train the two-chunk model with the option for ``steps`` steps and checkpoint it."""
    from megatron_opt import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    lm = TinyLM()
    chunks, opt = build_chunks(lm, True)
    for step in range(steps):
        train_step(chunks, opt, rank_microbatches(global_batch(world * 2, seed=20 + step), rank, world))
    for c in chunks:
        c.finish_param_sync()
    checkpoint.save(path, chunks, opt, iteration=steps)
    out = {"masters": opt.gather_main_params(), "params": flat_params(lm).clone()}
    train_step(chunks, opt, rank_microbatches(global_batch(world * 2, seed=50), rank, world))
    for c in chunks:
        c.finish_param_sync()
    out["params_after_next_step"] = flat_params(lm).clone()
    return out


def run_load_and_step(path: str) -> dict:
    """Load that checkpoint into a fresh two-chunk model (any DP size), then take one more step."""
    from megatron_opt import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    lm = TinyLM(seed=99)
    chunks, opt = build_chunks(lm, True)
    checkpoint.load(path, chunks, opt)
    out = {"masters": opt.gather_main_params(), "params": flat_params(lm).clone()}
    success, norm, _ = train_step(chunks, opt, rank_microbatches(global_batch(world * 2, seed=50), rank, world))
    for c in chunks:
        c.finish_param_sync()
    assert_identical_across_ranks(flat_params(lm))
    out.update(success=bool(success), norm=norm, params_after_next_step=flat_params(lm).clone())
    return out
