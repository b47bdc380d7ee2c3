"""Worker-side cases for verify mode (OptimizerConfig.verify_interval / verify_action).

Faults are injected through public surfaces only: a model param's ``.data`` (a replica), the torch op
the CPU backend runs for AdamW (``torch._fused_adamw_``, wrapped to perturb one output element), the
masters returned by ``optimizer.local_state_tensors()``, a LocalShard's gradient view, and the user's
own DistributedDataParallel object's ``finish_grad_sync`` (something that changes a master while the
step runs). Every case returns, per rank, what happened, so the tests can check that every rank
raised (or warned) the same, and that no rank hung.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.distributed.cases_device_step import SCHEDULE
from tests.distributed.cases_partial_sharding import build_partial
from tests.support.common import TinyLM, flat_params, global_batch, rank_microbatches, token_loss_sum

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REPLICA_TARGET = "out.weight"  # a param no rank owns all of at DP >= 2


class LogCapture(logging.Handler):
    """WARNING records of the megatron_opt logger, while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @contextlib.contextmanager
    def installed(self) -> Iterator["LogCapture"]:
        logger = logging.getLogger("megatron_opt")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


def _param(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    return dict(model.named_parameters())[name]


def _owned_elements(ddp: mo.DistributedDataParallel, name: str) -> set[int]:
    """The elements of param ``name`` this rank's optimizer owns (from the published LocalShards)."""
    owned: set[int] = set()
    for shard in ddp.local_shards():
        for pc in shard.pieces:
            if shard.names[pc.param_index] == name:
                owned.update(range(pc.param_range.start, pc.param_range.end))
    return owned


def _holder(tensors: dict, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor among ``tensors`` whose storage holds ``target``'s first element, and its offset."""
    ptr = target.data_ptr()
    for t in tensors.values():
        start = t.data_ptr()
        if t.dtype == target.dtype and start <= ptr < start + t.numel() * t.element_size():
            return t, (ptr - start) // t.element_size()
    raise AssertionError("no state tensor holds the target")


# ---------------------------------------------------------------------------------------------- faults
def owned_target(model: torch.nn.Module) -> str:
    """The first 16-bit param (else any param) this rank owns a piece of: the faults on masters hit it."""
    named = [(n, p) for n, p in model.named_parameters() if p.main_param is not None]
    return next((n for n, p in named if p.dtype != torch.float32), named[0][0])


def perturb_replica(model: torch.nn.Module, ddp: mo.DistributedDataParallel) -> None:
    """Change one element of this rank's copy of REPLICA_TARGET that another rank owns (before the forward)."""
    owned = _owned_elements(ddp, REPLICA_TARGET)
    p = _param(model, REPLICA_TARGET)
    element = next(i for i in range(p.numel()) if i not in owned)
    with torch.no_grad():
        p.view(-1)[element] += 0.25


@contextlib.contextmanager
def wrapped_fused_adamw(model: torch.nn.Module) -> Iterator[None]:
    """A compute fault: torch._fused_adamw_ (the CPU backend's AdamW) adds 1e-2 to the first owned
    master element of owned_target() after it has run."""
    target = _param(model, owned_target(model)).main_param
    original = torch._fused_adamw_

    def faulty(params, *args, **kwargs):
        original(params, *args, **kwargs)
        for w in params:
            start = w.data_ptr()
            if target is not None and start <= target.data_ptr() < start + w.numel() * w.element_size():
                w.view(-1)[(target.data_ptr() - start) // w.element_size()] += 1e-2

    torch._fused_adamw_ = faulty
    try:
        yield
    finally:
        torch._fused_adamw_ = original


def perturb_master(model: torch.nn.Module, opt) -> None:
    """Change owned_target()'s first owned master element through local_state_tensors()."""
    t, offset = _holder(opt.local_state_tensors(), _param(model, owned_target(model)).main_param)
    t[offset] += 1.0


@contextlib.contextmanager
def master_changed_during_step(model: torch.nn.Module, ddp: mo.DistributedDataParallel, opt) -> Iterator[None]:
    """Something writes a master while the step runs: the user's DDP's finish_grad_sync (called by
    the step) changes one, after it has synced the gradients."""
    original = ddp.finish_grad_sync

    def and_write_a_master(*args, **kwargs):
        original(*args, **kwargs)
        perturb_master(model, opt)

    ddp.finish_grad_sync = and_write_a_master
    try:
        yield
    finally:
        del ddp.finish_grad_sync


def poison_grad(ddp: mo.DistributedDataParallel) -> None:
    shard = next(s for s in ddp.local_shards() if s.pieces)
    shard.grad[shard.pieces[0].shard_range.start] = float("inf")


# ---------------------------------------------------------------------------------------------- one run
def _outcome(exc: Optional[BaseException]) -> dict:
    if exc is None:
        return {"error": None, "message": ""}
    return {"error": type(exc).__name__, "message": str(exc), "is_rank_error": isinstance(exc, mo.RankError)}


def run(fault: str = "none", *, action: str = "raise", interval: int = 1, precision: str = "bf16",
        steps: int = 3, fault_calls: tuple = (2,), bad_rank: int = -1, k: int = 1, chained: bool = False,
        overlap: bool = False, device_step: bool = False, optimizer: str = "adam", **opt_kwargs) -> dict:
    """TinyLM on every rank for ``steps`` step() calls with verify mode; ``fault`` hits rank
    ``bad_rank`` (-1: the last) on the step() calls ``fault_calls``. Returns, per rank: the
    outcome (error type and message), the verify report after each call, the verify WARNINGs, and the
    final params and state (for bitwise comparisons)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bad_rank = bad_rank % world
    model = TinyLM(DTYPES[precision])
    if chained:  # an 'expert' param over the data-parallel group: a ChainedOptimizer of dense + expert
        model.keep_a.allreduce = False
    precision_opts = {"bf16": dict(bf16=True), "fp16": dict(fp16=True, initial_loss_scale=2.0**10),
                      "fp32": {}}[precision]
    ddp, opt = build_partial(model, k, overlap=overlap, bucket_size=300 if overlap else None, lr=1e-2,
                             weight_decay=0.1, clip_grad=1.0, optimizer=optimizer, verify_interval=interval,
                             verify_action=action, optimizer_cuda_graph=device_step, **precision_opts, **opt_kwargs)
    batches = global_batch(world * steps, seed=21)
    reports, exc = [], None
    with LogCapture().installed() as logs:
        try:
            for call in range(1, steps + 1):
                here = rank == bad_rank and call in fault_calls
                ddp.zero_grad_buffer()
                opt.zero_grad()
                if here and fault == "replica":
                    perturb_replica(model, ddp)
                if here and fault == "cast":
                    perturb_master(model, opt)
                x, y = rank_microbatches(batches[(call - 1) * world : call * world], rank, world)[0]
                loss_sum, n = token_loss_sum(ddp(x), y)
                opt.scale_loss(loss_sum / n).backward()
                if call in fault_calls and fault in ("skip", "skip_change") and rank == 0:
                    poison_grad(ddp)
                step_ctx = contextlib.nullcontext()
                if here and fault == "update":
                    step_ctx = wrapped_fused_adamw(model)
                if here and fault in ("skip_change", "master_in_step"):
                    step_ctx = master_changed_during_step(model, ddp, opt)
                with step_ctx:
                    success, _, _ = opt.step()
                r = opt.verify_report
                reports.append(None if r is None else dict(calls=r.step_calls, last=r.last_verified_step,
                                                           verified=r.verified_steps,
                                                           checks=sorted({f.check for f in r.last_findings}),
                                                           success=bool(success)))
        except Exception as e:  # noqa: BLE001  (returned: every rank must have raised the same)
            exc = e
    if ddp.ddp_config.overlap_param_gather:
        ddp.finish_param_sync()
    state = {n: t.detach().clone() for n, t in opt.local_state_tensors().items()}
    return {**_outcome(exc), "reports": reports, "warnings": [m for m in logs.messages if "verify mode" in m],
            "params": flat_params(model), "state": state, "target": owned_target(model)}


def bitwise_same(a: dict, b: dict) -> bool:
    return torch.equal(a["params"], b["params"]) and a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][n], b["state"][n]) for n in a["state"])


def run_pair(fault: str = "none", **kwargs) -> dict:
    """The same run with verify mode at ``interval`` and off: are params and state bitwise equal?"""
    on = run(fault, **kwargs)
    off = run(fault, **{**kwargs, "interval": 0})
    return {"on": {k: v for k, v in on.items() if k not in ("params", "state")}, "same": bitwise_same(on, off),
            "off_error": off["error"]}


def schedule_pair(device_step: bool, precision: str) -> dict:
    """cases_device_step's schedule (lr changes, clipping, an overflow on one rank, a norm skip) with
    verify_interval=1 and 0, on the host API or the device-decided step."""
    def one(interval: int) -> dict:
        rank = dist.get_rank()
        model = TinyLM(DTYPES[precision])
        kw = dict(fp16=True, initial_loss_scale=2.0**12, loss_scale_window=2, hysteresis=1, min_loss_scale=1.0) \
            if precision == "fp16" else {}
        ddp, opt = build_partial(model, 1, clip_grad=1.0, weight_decay=0.1, grad_norm_skip_threshold=100.0,
                                 optimizer_cuda_graph=device_step, verify_interval=interval, **kw)
        batches = global_batch(2 * dist.get_world_size(), seed=3)
        skipped = []
        for i, (mult, lr) in enumerate(SCHEDULE):
            for g in opt.param_groups:
                g["lr"] = lr
            ddp.zero_grad_buffer()
            x, y = batches[(2 * rank + i) % len(batches)]
            loss = token_loss_sum(ddp(x), y)[0]
            opt.scale_loss(loss * mult if math.isfinite(mult) else loss).backward()
            if not math.isfinite(mult) and rank == 0:
                poison_grad(ddp)
            success, _, _ = opt.step()
            skipped.append(not bool(success))
        report = opt.verify_report
        return {"params": flat_params(model), "state": {n: t.clone() for n, t in opt.local_state_tensors().items()},
                "skipped": skipped, "report": None if report is None else (report.verified_steps,
                                                                           len(report.last_findings))}

    on, off = one(1), one(0)
    return {"same": bitwise_same(on, off), "skipped": on["skipped"], "report": on["report"]}


def custom_rule_without_recompute() -> dict:
    """A custom UpdateRule with no float64_update: verify mode refuses it at construction."""
    class SignSGD(mo.UpdateRule):
        name = "signsgd"

        def state_dtypes(self):
            return {}

        def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None):
            raise NotImplementedError

    class AdamWVariant(mo.AdamW):  # overrides apply, inherits AdamW's float64_update: not enough
        def apply(self, plan, **kwargs):
            super().apply(plan, **kwargs)

    out = {}
    for rule in (SignSGD(), AdamWVariant()):
        ddp = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
        try:
            mo.DistributedOptimizer(mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, verify_interval=1),
                                    [ddp], update_rule=rule)
            out[type(rule).__name__] = ("built", "")
        except Exception as e:  # noqa: BLE001
            out[type(rule).__name__] = (type(e).__name__, str(e))
    return out


__all__ = ["run", "run_pair", "schedule_pair", "custom_rule_without_recompute", "bitwise_same", "LogCapture"]
