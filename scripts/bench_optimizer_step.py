#!/usr/bin/env python
"""Benchmark the optimizer step alone on one device: megatron_opt vs a Megatron-like sequence vs torch fused.

For each shard size N (elements owned by the rank, ``--log2-sizes``), all three implementations update
the same params (the same shapes, the same initial bf16 weights, the same fp32 gradients) with the same
AdamW hyperparameters, weight-decay groups (none on biases and 1-D params) and global-norm clipping:

  ours            megatron_opt's real ``optimizer.step()``: a stack of bf16 ``Linear(cols, rows)`` layers
                  plus a few 1-D params (RMSNorm weights, biases), ``--num-tensors`` params in all,
                  wrapped in ``megatron_opt.DistributedDataParallel(use_distributed_optimizer=True,
                  grad_reduce_in_fp32=True)``, optimizer from ``get_megatron_optimizer`` (AdamW, bf16=True,
                  clip_grad), in a one-process group (NCCL on CUDA, gloo on CPU). Pass 1 (found-inf + norm),
                  one host read, pass 2 (clip + AdamW + bf16 write-back).
  megatron-like   the separate passes Megatron-LM runs for bf16 params with fp32 main grads, from PyTorch ops
                  over the same param-sized tensors: ``_amp_foreach_non_finite_check_and_unscale_`` + the
                  host read of found_inf (``--megatron-unscale``, on by default; Megatron runs it only with a
                  loss scaler, its bf16 default has none), ``_foreach_norm`` + the norm reduce, clip with
                  ``_foreach_mul_`` (always, as with TE's tensor coefficient), ``torch._fused_adamw_`` per
                  param group on separate fp32 masters with fp32 moments, then a per-tensor ``copy_`` of
                  each master into its bf16 param (a view into one flat bf16 buffer).
  torch fused     ``clip_grad_norm_(params, clip, foreach=True)`` + ``torch.optim.AdamW(fused=True).step()`` on
                  fp32 params with fp32 grads: no masters, no bf16 copy.

Timing: the gradients are refilled from the same saved fp32 tensor before every step, outside the timed
region (ours: ``zero_grad_buffer()`` + ``add_grad()`` per param, the public way to deliver gradients, which
the step contract requires once per step; the others: one copy, since their clip scales the grads in
place). Then ``torch.cuda.synchronize()``, CUDA events recorded right around the step call (host timers
on CPU); ``--warmup`` steps, then the median of ``--iters``. Host overhead inside the step counts.

Byte floor: 34 B per element (pass 1 reads the fp32 grad: 4; pass 2 reads grad, master, exp_avg,
exp_avg_sq: 16, writes master, exp_avg, exp_avg_sq: 12 and the bf16 param: 2). floor = 34 * N / copy BW,
with the copy bandwidth measured in the same run (fp32 ``dst.copy_(src)`` of max(N, ``--copy-min-mib``)
bytes, read + write counted). Every implementation's effective GB/s and step/floor ratio use the same
34 B/element, also torch fused, which moves different bytes (it writes no bf16 param but its clip
rewrites the grads); Megatron-like moves 46 B/element (+8 with the unscale pass).

``--check``: after timing each size, fresh copies of the three take two steps on the same data (the
second with a different, larger gradient, so that clipping shows in AdamW's result); ours' fp32 masters
(``gather_main_params()``), its grad norms and its bf16 params are compared with the Megatron-like and
torch fused results; a mismatch makes the script exit 1.

``--mo-states fp32,bf16,bf16+rem``: ours' optimizer-state options (Megatron-LM's precision-aware
optimizer fields; the same names and ``OptimizerConfig`` fields as ``scripts/bench_step.py --mo-states``):

  fp32       fp32 masters, fp32 exp_avg and exp_avg_sq (the default; this is "ours" above).
  bf16       use_precision_aware_optimizer, bf16 exp_avg and exp_avg_sq, fp32 masters
             (store_param_remainders=False).
  bf16+rem   use_precision_aware_optimizer, bf16 moments, store_param_remainders: a bf16 param's fp32
             master is the bf16 param plus an int16 remainder (Megatron-LM's bf16 setting).

fp32 is always run (it is the baseline; listed first whether named or not). Each option's step is timed
in the same run on the same shard and data, eagerly and with ``optimizer_cuda_graph`` (a config that
refuses the graph, a moment pair without CUDA kernels, is reported as skipped with the config's
message). Per option: ms, effective GB/s and ms / floor against the option's own byte floor, and the
speedup ``fp32-state ms / option ms`` (eager against eager, graph against graph; > 1 is faster). Byte
floor per owned element with bf16 params and fp32 main grads (docs/kernels.md section 4; "p16 in" is
the bf16 param a remainder master reads to rebuild the fp32 master):

  fp32       pass 1 g 4; pass 2 reads g 4 + w 4 + m 4 + v 4 = 16, writes w 4 + m 4 + v 4 + p 2 = 14: 34 B
  bf16       pass 1 g 4; pass 2 reads g 4 + w 4 + m 2 + v 2 = 12, writes w 4 + m 2 + v 2 + p 2 = 10: 26 B
  bf16+rem   pass 1 g 4; pass 2 reads g 4 + r 2 + p16 in 2 + m 2 + v 2 = 12,
             writes r 2 + p 2 + m 2 + v 2 = 8: 24 B

so at the floor the 16-bit options are 34/26 = 1.31x and 34/24 = 1.42x faster than fp32 state. On CPU
the precision-aware step runs torch's fused loop on widened fp32 copies (docs/usage.md), so it moves
more bytes than its floor there and may well be slower than fp32 state: the table reports what it
measures. With ``--check`` each option also takes the two check steps, and its masters
(``gather_main_params()``: exact fp32 masters, also with remainders) are compared with the fp32-state
run's: the grad norms within 1e-5 (pass 1 reads the same fp32 grads), and per tensor the two-step
update ``||(w_opt - w0) - (w_fp32 - w0)|| / ||w_fp32 - w0||`` within 1e-2 (bf16 moments keep 8
significant bits: each stored moment is off by at most 2^-9 relative, so the second step's update by
about 2^-9 + 2^-10 per element, ~1e-3 in norm; a 10% wrong learning rate gives 1e-1), and its bf16
params must be its own masters rounded to bf16 (at most 1e-3 of them differ: ties round away from zero
with remainders, to even otherwise).

Usage (GPU; build the CUDA extension first, e.g. ``pip install -e . --no-build-isolation``):
    python3 scripts/bench_optimizer_step.py --check --json step.json --plot step.png
(on an H100 the default sizes 2^22..2^28 take about 20 s with --check, after a ~1 min build; peak GPU
memory about 34 B * N, 9 GiB at 2^28; a size that does not fit in the free memory is skipped.)
16-bit state against fp32 state (GPU; one table row per size and option, the plot gains a speedup panel):
    python3 scripts/bench_optimizer_step.py --check --mo-states fp32,bf16,bf16+rem --json states.json --plot states.png
CPU smoke test (gloo, host timers, a few seconds):
    python scripts/bench_optimizer_step.py --device cpu --log2-sizes 12,14 --iters 2 --warmup 1 --check
    python scripts/bench_optimizer_step.py --device cpu --log2-sizes 12,14 --iters 3 --check --mo-states fp32,bf16,bf16+rem
Re-plot from a saved JSON (no benchmark): --from-json step.json --plot step.png
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import megatron_opt as mo
from bench_common import MO_STATES, copy_bandwidth, no_decay, time_calls, weight_decay_groups  # scripts/bench_common.py

FLOOR_BYTES = 34  # per element: pass 1 reads g (4); pass 2 reads g, w, m, v (16), writes w, m, v (12), bf16 p (2)
MEGATRON_BYTES = 46  # norm 4 + clip 8 + AdamW 28 + fp32 -> bf16 copy 6 (+8 for the unscale pass)
TORCH_FUSED_BYTES = 40  # norm 4 + clip 8 + AdamW 28
IMPLS = ("ours", "ours_graph", "megatron_like", "torch_fused")
LABELS = {"ours": "ours (megatron_opt)", "ours_graph": "ours, optimizer_cuda_graph", "megatron_like": "megatron-like",
          "torch_fused": "torch fused"}
# --check tolerances (fp32): masters per tensor ||a-b||/||b||, the two-step update ||da-db||/||db||,
# the grad norms, and the share of bf16 params that may differ (a master a few ulps apart can round the
# other way near a bf16 tie).
TOL_MASTER, TOL_UPDATE, TOL_NORM, TOL_BF16_MISMATCH = 1e-5, 1e-4, 1e-5, 1e-3
# --check of a 16-bit state option against the fp32-state run: the per-tensor two-step update (bf16 moments
# round each stored moment by <= 2^-9 relative; see the docstring); norms and bf16 params as above.
TOL_STATE_UPDATE = 1e-2

# --mo-states: ours' optimizer-state options, the same names and OptimizerConfig fields as
# scripts/bench_step.py's (MO_STATES, from bench_common).
STATE_LABELS = {"fp32": "fp32 state", "bf16": "bf16 m,v", "bf16+rem": "bf16 m,v + remainders"}
# Byte floor per owned element (bf16 params, fp32 main grads): pass 1 reads g (4), then pass 2 (docstring):
STATE_FLOOR_BYTES = {
    "fp32": 4 + (4 + 4 + 4 + 4) + (4 + 4 + 4 + 2),  # 34 = FLOOR_BYTES: g | g w m v | w m v p
    "bf16": 4 + (4 + 4 + 2 + 2) + (4 + 2 + 2 + 2),  # 26: g | g w m16 v16 | w m16 v16 p
    "bf16+rem": 4 + (4 + 2 + 2 + 2 + 2) + (2 + 2 + 2 + 2),  # 24: g | g r p16 m16 v16 | r p m16 v16
}
assert STATE_FLOOR_BYTES["fp32"] == FLOOR_BYTES


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Spec:
    """The params of one size: ``weights`` Linear(cols, rows) layers (the first ``biases`` with a bias),
    then ``norms`` RMSNorm(cols) weights; every implementation uses these shapes in this order."""
    rows: int
    cols: int
    weights: int
    biases: int
    norms: int

    @staticmethod
    def for_size(n: int, num_tensors: int) -> "Spec":
        small = max(1, num_tensors // 32)  # a few small 1-D params among the many big ones
        weights = num_tensors - small
        per = max(1, n // weights)
        cols = 2 ** (int(math.log2(per)) // 2)
        rows = max(1, per // cols)
        return Spec(rows, cols, weights, small // 2, small - small // 2)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for i in range(self.weights):
            out.append((f"layers.{i}.weight", (self.rows, self.cols)))
            if i < self.biases:
                out.append((f"layers.{i}.bias", (self.rows,)))
        out += [(f"norms.{i}.weight", (self.cols,)) for i in range(self.norms)]
        return out

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes())


class Stack(torch.nn.Module):
    """The model megatron_opt wraps (never run forward: the benchmark times the optimizer step only)."""

    def __init__(self, spec: Spec, device: torch.device) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.bfloat16}
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(spec.cols, spec.rows, bias=i < spec.biases, **kw) for i in range(spec.weights))
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(spec.cols, **kw) for _ in range(spec.norms))


class Data:
    """The same initial bf16 weights and fp32 gradients for every implementation, flat in Spec order."""

    def __init__(self, spec: Spec, device: torch.device, seed: int) -> None:
        self.spec = spec
        self.shapes = spec.shapes()
        self.n = spec.numel
        gen = torch.Generator(device=device).manual_seed(seed)
        bound = 1.0 / math.sqrt(spec.cols)
        w0 = torch.rand(self.n, generator=gen, device=device).mul_(2 * bound).sub_(bound)
        self.offsets = []
        off = 0
        for name, shape in self.shapes:
            k = math.prod(shape)
            if name.startswith("norms."):
                w0[off : off + k].add_(1.0)  # norm weights around 1
            self.offsets.append((off, k))
            off += k
        self.w0 = w0.to(torch.bfloat16)
        del w0
        self.grad = torch.randn(self.n, generator=gen, device=device)  # norm ~ sqrt(N): clipping is active
        self.gen = gen

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + k].view(shape) for (o, k), (_, shape) in zip(self.offsets, self.shapes)]

    def second_grad(self) -> torch.Tensor:
        """A different, larger gradient for the second step of --check."""
        return torch.randn(self.n, generator=self.gen, device=self.grad.device).mul_(3.0)


# ---------------------------------------------------------------------------------------------- implementations
class Ours:
    name = "ours"

    def __init__(self, data: Data, args, device: torch.device, cuda_graph: bool = False,
                 state: str = "fp32") -> None:
        self.cuda_graph = cuda_graph
        self.state = state
        # first the config: it raises UnsupportedConfigError for a graph it cannot capture, before any allocation
        config = mo.OptimizerConfig(
            optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.beta1,
            adam_beta2=args.beta2, adam_eps=args.eps, clip_grad=args.clip_grad, bf16=True,
            use_distributed_optimizer=True, optimizer_cuda_graph=cuda_graph, **MO_STATES[state])
        self.model = Stack(data.spec, device)
        named = list(self.model.named_parameters())
        if [(n, tuple(p.shape)) for n, p in named] != data.shapes:
            raise RuntimeError("the model's params do not follow the Spec order")
        with torch.no_grad():
            for (_, p), w in zip(named, data.views(data.w0)):
                p.copy_(w)
        self.params = [p for _, p in named]
        self.ddp = mo.DistributedDataParallel(self.model, mo.DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True))
        self.opt = mo.get_megatron_optimizer(config, self.ddp)
        # only to prove that --check catches a wrong update: of the fp32-state ours against the peers, or
        # of a 16-bit state option against the fp32-state ours
        perturb = args.perturb_ours_lr if state == "fp32" else args.perturb_state_lr
        if perturb != 1.0:
            for group in self.opt.param_groups:
                group["lr"] *= perturb
        self.grads = data.views(data.grad)

    def set_grads(self, flat: Optional[torch.Tensor] = None) -> None:
        """Start a step and deliver the gradients the public way (the contract wants one per step)."""
        grads = self.grads if flat is None else [g.view_as(p) for g, p in zip(self._split(flat), self.params)]
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        for p, g in zip(self.params, grads):
            self.ddp.add_grad(p, g)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for p in self.params:
            out.append(flat[off : off + p.numel()])
            off += p.numel()
        return out

    def step(self) -> float:
        success, grad_norm, _ = self.opt.step()
        if self.cuda_graph:  # device tensors: reading them here would put a host sync in the timed region
            return grad_norm
        if not success:
            raise RuntimeError(f"megatron_opt skipped a step ({self.opt.last_skip_reason})")
        return grad_norm

    def masters(self, data: Data) -> list[torch.Tensor]:
        full = self.opt.gather_main_params()
        return [full[name].reshape(shape) for name, shape in data.shapes]

    def bf16_params(self) -> list[torch.Tensor]:
        self.ddp.finish_param_sync()
        return [p.detach() for p in self.params]

    def backend(self) -> str:
        return mo.ops.resolve_backend(self.params[0])


class MegatronLike:
    name = "megatron_like"

    def __init__(self, data: Data, args, device: torch.device) -> None:
        self.args = args
        self.grad_flat = data.grad.clone()  # the main-grad buffer; its views are the main grads
        self.grads = data.views(self.grad_flat)
        self.param_flat = data.w0.clone()  # the bf16 param buffer
        self.model_params = data.views(self.param_flat)
        self.masters = [p.float() for p in self.model_params]  # Megatron: shard_model_param.clone().float()
        self.exp_avg = [torch.zeros_like(w) for w in self.masters]
        self.exp_avg_sq = [torch.zeros_like(w) for w in self.masters]
        self.steps = [torch.zeros((), device=device) for _ in self.masters]
        self.groups = []
        for decay in (True, False):
            idx = [i for i, (name, shape) in enumerate(data.shapes) if no_decay(name, shape) != decay]
            if idx:
                self.groups.append((args.weight_decay if decay else 0.0,
                                    [self.masters[i] for i in idx], [self.grads[i] for i in idx],
                                    [self.exp_avg[i] for i in idx], [self.exp_avg_sq[i] for i in idx],
                                    [self.steps[i] for i in idx]))
        self.found_inf = torch.zeros(1, device=device)
        self.inv_scale = torch.ones(1, device=device)  # bf16: no loss scaling

    def set_grads(self, flat: Optional[torch.Tensor] = None, source: Optional[Data] = None) -> None:
        self.grad_flat.copy_(flat if flat is not None else source.grad)

    def step(self) -> torch.Tensor:
        a = self.args
        if a.megatron_unscale:  # _unscale_main_grads_and_check_for_nan: found_inf, then a host read
            self.found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self.found_inf, self.inv_scale)
            if self.found_inf.item() != 0:
                raise RuntimeError("megatron-like: non-finite gradients")
        norms = torch._foreach_norm(self.grads)  # get_grad_norm_fp32 (+ the norm reduce, a no-op at DP=1)
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = (a.clip_grad / (total + 1e-6)).clamp(max=1.0)  # clip_grad_by_total_norm_fp32
        torch._foreach_mul_(self.grads, coef)
        torch._foreach_add_(self.steps, 1)
        for wd, masters, grads, m, v, steps in self.groups:  # the inner fused AdamW, per param group
            torch._fused_adamw_(masters, grads, m, v, [], steps, lr=a.lr, beta1=a.beta1, beta2=a.beta2,
                                weight_decay=wd, eps=a.eps, amsgrad=False, maximize=False)
        for p, w in zip(self.model_params, self.masters):  # _copy_main_params_to_model_params
            p.copy_(w)
        return total

    def result(self) -> list[torch.Tensor]:
        return self.masters


class TorchFused:
    name = "torch_fused"

    def __init__(self, data: Data, args, device: torch.device) -> None:
        self.args = args
        self.params = [torch.nn.Parameter(w.float()) for w in data.views(data.w0)]
        self.grad_flat = data.grad.clone()
        for p, g in zip(self.params, data.views(self.grad_flat)):
            p.grad = g
        groups = weight_decay_groups(((name, p) for p, (name, _) in zip(self.params, data.shapes)), args.weight_decay)
        self.opt = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                     weight_decay=args.weight_decay, fused=True)

    def set_grads(self, flat: Optional[torch.Tensor] = None, source: Optional[Data] = None) -> None:
        self.grad_flat.copy_(flat if flat is not None else source.grad)

    def step(self) -> torch.Tensor:
        total = torch.nn.utils.clip_grad_norm_(self.params, self.args.clip_grad, foreach=True)
        self.opt.step()
        return total

    def result(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]


# ---------------------------------------------------------------------------------------------- memory
def free_memory(device: torch.device, collect: bool = False) -> None:
    """Release what the last implementation held (gc: DDP's hooks hold reference cycles) before the next
    allocates; on CPU only when asked (one gc pass per size: collecting is slow after torch's imports)."""
    if device.type == "cuda" or collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits(need_bytes: int, device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    free_b, _ = torch.cuda.mem_get_info(device)
    return need_bytes <= 0.9 * free_b, f"needs ~{need_bytes / 2**30:.1f} GiB, {free_b / 2**30:.1f} GiB free"


# ---------------------------------------------------------------------------------------------- check
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def run_check(data: Data, args, device: torch.device) -> dict:
    """Two steps of fresh copies of the three on the same data; ours against each of the others."""
    grads = [data.grad, data.second_grad()]
    w0 = [w.float() for w in data.views(data.w0)]
    ours = Ours(data, args, device)
    ours_norms = []
    for g in grads:
        ours.set_grads(g)
        ours_norms.append(float(ours.step()))
    ours_masters = [t.clone() for t in ours.masters(data)]
    ours_bf16 = [t.clone() for t in ours.bf16_params()]
    del ours
    free_memory(device)
    report = {"ours_grad_norms": ours_norms}
    ok = True
    for cls in (MegatronLike, TorchFused):
        peer = cls(data, args, device)
        norms = []
        for g in grads:
            peer.set_grads(g)
            norms.append(float(peer.step()))
        result = peer.result()
        master_rel = max(rel(a, b) for a, b in zip(ours_masters, result))
        upd_num = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(ours_masters, result))
        upd_den = sum(float((b.double() - w.double()).square().sum()) for b, w in zip(result, w0))
        update_rel = math.sqrt(upd_num / max(upd_den, 1e-300))
        norm_rel = max(abs(a - b) / abs(b) for a, b in zip(ours_norms, norms))
        entry = {"grad_norms": norms, "master_rel_diff": master_rel, "update_rel_diff": update_rel,
                 "grad_norm_rel_diff": norm_rel}
        # ours' bf16 params against the peer's masters rounded to bf16 (what Megatron writes back)
        mismatched = sum(int((a != b.to(torch.bfloat16)).sum()) for a, b in zip(ours_bf16, result))
        entry["bf16_param_mismatch_fraction"] = mismatched / data.n
        entry["ok"] = (master_rel <= TOL_MASTER and update_rel <= TOL_UPDATE and norm_rel <= TOL_NORM
                       and entry["bf16_param_mismatch_fraction"] <= TOL_BF16_MISMATCH)
        for key in ("master_rel_diff", "update_rel_diff", "grad_norm_rel_diff", "bf16_param_mismatch_fraction"):
            if not math.isfinite(entry[key]):
                entry["ok"] = False
        ok = ok and entry["ok"]
        report[cls.name] = entry
        del peer, result
        free_memory(device)
    report["states"] = {}
    for state in args.mo_states:
        if state == "fp32":
            continue
        entry = check_state(state, data, args, device, grads, w0, ours_masters, ours_norms)
        ok = ok and entry["ok"]
        report["states"][state] = entry
    report["ok"] = ok
    return report


def check_state(state: str, data: Data, args, device: torch.device, grads: list[torch.Tensor],
                w0: list[torch.Tensor], ref_masters: list[torch.Tensor], ref_norms: list[float]) -> dict:
    """Two steps of ours with a 16-bit state option against the fp32-state ours (same data, same grads)."""
    opt = Ours(data, args, device, state=state)
    norms = []
    for g in grads:
        opt.set_grads(g)
        norms.append(float(opt.step()))
    masters = [t.clone() for t in opt.masters(data)]
    bf16 = opt.bf16_params()
    # the bf16 params must be these masters rounded (the write-back of pass 2)
    mismatched = sum(int((p != m.to(torch.bfloat16)).sum()) for p, m in zip(bf16, masters))
    del opt, bf16
    free_memory(device)
    update_rel = max(rel(a - w, b - w) for a, b, w in zip(masters, ref_masters, w0))
    entry = {"grad_norms": norms, "master_rel_diff": max(rel(a, b) for a, b in zip(masters, ref_masters)),
             "update_rel_diff": update_rel, "grad_norm_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                                      zip(norms, ref_norms)),
             "bf16_param_mismatch_fraction": mismatched / data.n,
             "tolerance": {"update_rel_diff (max per tensor)": TOL_STATE_UPDATE, "grad_norm_rel_diff": TOL_NORM,
                           "bf16_param_mismatch_fraction": TOL_BF16_MISMATCH}}
    entry["ok"] = (update_rel <= TOL_STATE_UPDATE and entry["grad_norm_rel_diff"] <= TOL_NORM
                   and entry["bf16_param_mismatch_fraction"] <= TOL_BF16_MISMATCH
                   and all(math.isfinite(entry[k]) for k in ("master_rel_diff", "update_rel_diff",
                                                              "grad_norm_rel_diff")))
    return entry


# ---------------------------------------------------------------------------------------------- driver
def time_peer(impl, data: Data, args, device: torch.device) -> list[float]:
    return time_calls(impl.step, device, args.warmup, args.iters, prepare=lambda: impl.set_grads(source=data))


def bench_size(log2: int, args, device: torch.device, copy_cache: dict) -> Optional[dict]:
    spec = Spec.for_size(2**log2, args.num_tensors)
    n = spec.numel
    # data (2 + 4 B) + the largest implementation (ours and megatron-like: 2 + 4 + 4 + 4 + 4 B), the copy
    # test, and for --check a second gradient and ours' kept masters and params (4 + 4 + 2 B)
    need = (6 + 18 + (10 if args.check else 0)) * n + 64 * 2**20
    ok, why = fits(need, device)
    if not ok:
        print(f"skip 2^{log2}: {why}", file=sys.stderr, flush=True)
        return {"log2_size": log2, "n": n, "skipped": why}
    copy_numel = max(n, args.copy_min_mib * 2**20 // 4)
    if copy_numel not in copy_cache:
        ok, why = fits(8 * copy_numel, device)
        if not ok:
            copy_numel = n
        copy_cache[copy_numel] = (copy_bandwidth(copy_numel, device, args.warmup, max(args.iters, 5)), copy_numel)
    copy_gbs, copy_n = copy_cache[copy_numel]
    data = Data(spec, device, args.seed + log2)
    row = {"log2_size": log2, "n": n, "num_params": len(data.shapes),
           "spec": {"rows": spec.rows, "cols": spec.cols, "linear_weights": spec.weights, "biases": spec.biases,
                    "norms": spec.norms},
           "copy_gbs": copy_gbs, "copy_elements": copy_n,
           "floor_ms": FLOOR_BYTES * n / (copy_gbs * 1e9) * 1e3, "impls": {}}

    def record(name: str, times: list[float]) -> None:
        ms = statistics.median(times)
        row["impls"][name] = {"ms": ms, "min_ms": min(times), "times_ms": times,
                              "gbs": FLOOR_BYTES * n / (ms * 1e-3) / 1e9, "floor_ratio": ms / row["floor_ms"]}
        print(f"  2^{log2} {LABELS[name]:<20} {ms:9.3f} ms", file=sys.stderr, flush=True)

    row["states"] = {}
    for state in args.mo_states:  # fp32 first: "ours" and "ours_graph"; then each 16-bit state option
        floor_b = STATE_FLOOR_BYTES[state]
        st = row["states"][state] = {"label": STATE_LABELS[state], "floor_bytes": floor_b,
                                     "floor_ms": floor_b * n / (copy_gbs * 1e9) * 1e3,
                                     "ideal_speedup_vs_fp32": FLOOR_BYTES / floor_b}
        for mode, graph in (("eager", False), ("graph", True)):
            try:
                ours = Ours(data, args, device, cuda_graph=graph, state=state)
            except mo.UnsupportedConfigError as e:  # optimizer_cuda_graph for a moment pair without kernels
                st[mode] = {"skipped": str(e)}
                print(f"  2^{log2} {STATE_LABELS[state]}, {mode}: skipped ({e})", file=sys.stderr, flush=True)
                continue
            if state == "fp32" and not graph:
                row["ours_backend"] = ours.backend()
            times = time_calls(ours.step, device, args.warmup, args.iters, prepare=ours.set_grads)
            if graph and not bool(ours.opt.skipped_steps == 0):
                raise RuntimeError(f"optimizer_cuda_graph skipped a step ({state} state)")
            del ours
            free_memory(device)
            ms = statistics.median(times)
            st[mode] = {"ms": ms, "min_ms": min(times), "times_ms": times, "gbs": floor_b * n / (ms * 1e-3) / 1e9,
                        "floor_ratio": ms / st["floor_ms"]}
            if state == "fp32":
                record("ours_graph" if graph else "ours", times)
            else:
                print(f"  2^{log2} {STATE_LABELS[state] + (', graph' if graph else ''):<20} {ms:9.3f} ms",
                      file=sys.stderr, flush=True)
    for state, st in row["states"].items():  # against the fp32-state step of the same mode
        for mode in ("eager", "graph"):
            base = row["states"]["fp32"][mode]
            if "ms" in st[mode] and "ms" in base:
                st[mode]["speedup_vs_fp32"] = base["ms"] / st[mode]["ms"]
    for cls in (MegatronLike, TorchFused):  # each allocated only for its own measurement
        record(cls.name, time_peer(cls(data, args, device), data, args, device))
        free_memory(device)
    ours_ms = row["impls"]["ours"]["ms"]
    row["speedup_vs_megatron_like"] = row["impls"]["megatron_like"]["ms"] / ours_ms
    row["speedup_vs_torch_fused"] = row["impls"]["torch_fused"]["ms"] / ours_ms
    graph_ms = row["impls"]["ours_graph"]["ms"]
    row["graph_speedup_vs_megatron_like"] = row["impls"]["megatron_like"]["ms"] / graph_ms
    if args.check:
        row["check"] = run_check(data, args, device)
        c = row["check"]
        print(f"  2^{log2} check {'ok' if c['ok'] else 'MISMATCH'}: " + "; ".join(
            f"{k}: master {c[k]['master_rel_diff']:.1e}, update {c[k]['update_rel_diff']:.1e}, "
            f"norm {c[k]['grad_norm_rel_diff']:.1e}, bf16 mismatch {c[k]['bf16_param_mismatch_fraction']:.1e}"
            for k in ("megatron_like", "torch_fused")), file=sys.stderr, flush=True)
        for state, e in c["states"].items():
            print(f"  2^{log2} check {STATE_LABELS[state]} vs fp32 state {'ok' if e['ok'] else 'MISMATCH'}: "
                  f"update {e['update_rel_diff']:.1e} (tol {TOL_STATE_UPDATE:g}), master {e['master_rel_diff']:.1e}, "
                  f"norm {e['grad_norm_rel_diff']:.1e}, bf16 vs own masters {e['bf16_param_mismatch_fraction']:.1e}",
                  file=sys.stderr, flush=True)
    del data
    free_memory(device, collect=True)
    return row


def gbs(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def markdown_table(results: list[dict]) -> str:
    head = ["elements (2^k)", "copy GB/s", "floor ms (34 B/elem)"]
    for name in IMPLS:
        head += [f"{LABELS[name]} ms", f"{LABELS[name]} GB/s", f"{LABELS[name]} / floor"]
    head += ["ours vs megatron-like", "ours vs torch fused", "graph vs megatron-like"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['n']:,} (2^{r['log2_size']}) | skipped: {r['skipped']} |" + " |" * (len(head) - 2))
            continue
        cells = [f"{r['n']:,} (2^{r['log2_size']})", gbs(r["copy_gbs"]), f"{r['floor_ms']:.3g}"]
        for name in IMPLS:
            i = r["impls"][name]
            cells += [f"{i['ms']:.3f}", gbs(i["gbs"]), f"{i['floor_ratio']:.2f}"]
        cells += [f"{r['speedup_vs_megatron_like']:.2f}x", f"{r['speedup_vs_torch_fused']:.2f}x",
                  f"{r['graph_speedup_vs_megatron_like']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def has_states(results: list[dict]) -> bool:
    return any(len(r.get("states", {})) > 1 for r in results)


def states_table(results: list[dict]) -> str:
    """One row per size and state option: 16-bit state against fp32 state at a glance."""
    head = ["elements (2^k)", "state", "floor B/elem", "floor ms", "eager ms", "eager GB/s", "eager / floor",
            "eager vs fp32", "graph ms", "graph GB/s", "graph / floor", "graph vs fp32", "floor vs fp32",
            "check vs fp32 (update)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for r in results:
        if "skipped" in r:
            continue
        check = r.get("check", {}).get("states", {})
        for state, st in r["states"].items():
            cells = [f"{r['n']:,} (2^{r['log2_size']})", st["label"], str(st["floor_bytes"]), f"{st['floor_ms']:.3g}"]
            for mode in ("eager", "graph"):
                m = st[mode]
                if "ms" not in m:
                    cells += ["skipped (config refuses)", "", "", ""]
                    continue
                speedup = f"{m['speedup_vs_fp32']:.2f}"
                cells += [f"{m['ms']:.3f}", gbs(m["gbs"]), f"{m['floor_ratio']:.2f}",
                          f"{speedup}x" + (" (slower)" if float(speedup) < 1 else "")]
            cells.append(f"{st['ideal_speedup_vs_fp32']:.2f}x")
            if state == "fp32":
                cells.append("reference" if "check" in r else "")
            elif state in check:
                c = check[state]
                cells.append(f"{'ok' if c['ok'] else 'MISMATCH'} ({c['update_rel_diff']:.1e})")
            else:
                cells.append("")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if "skipped" not in r]
    states = has_states(rows)
    if states:  # a second panel: each state option's speedup against the fp32-state step
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["n"] for r in rows]
    for name, marker in zip(IMPLS, "o^sd"):
        ax.plot(xs, [r["impls"][name]["gbs"] for r in rows], marker=marker, label=LABELS[name])
    ax.plot(xs, [r["copy_gbs"] for r in rows], linestyle="--", color="gray", label="copy bandwidth (fp32 copy_)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("shard size N (elements owned by the rank)")
    ax.set_ylabel(f"effective GB/s ({FLOOR_BYTES} B/element / step time)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Optimizer step (AdamW, bf16 params, fp32 grads, clip) on {report['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if states:
        names = [k for k in rows[0]["states"] if k != "fp32"]
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, state in enumerate(names):
            color = colors[i % len(colors)]
            label = rows[0]["states"][state]["label"]
            for mode, style in (("eager", "-"), ("graph", "--")):
                pts = [(r["n"], r["states"][state][mode].get("speedup_vs_fp32")) for r in rows]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax2.plot(*zip(*pts), marker="o", linestyle=style, color=color, label=f"{label}, {mode}")
            ax2.axhline(rows[0]["states"][state]["ideal_speedup_vs_fp32"], color=color, linestyle=":",
                        label=f"{label}: byte floor {FLOOR_BYTES}/{rows[0]['states'][state]['floor_bytes']}")
        ax2.axhline(1.0, color="gray", linewidth=1)
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("shard size N (elements owned by the rank)")
        ax2.set_ylabel("speedup vs fp32-state step (fp32 ms / option ms; > 1 is faster)")
        ax2.set_ylim(bottom=0)
        ax2.set_title("16-bit optimizer state vs fp32 state (same mode)")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("bench_optimizer_step: --plot needs matplotlib, which is not installed here "
                 "(pip install matplotlib, or drop --plot and re-plot later with --from-json PATH --plot PATH).")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if available, else cpu (gloo, host timers: a smoke test, not a benchmark)")
    ap.add_argument("--log2-sizes", default="22,24,26,28", help="comma-separated log2 shard sizes (elements)")
    ap.add_argument("--num-tensors", type=int, default=256, help="params (tensors) per size, all implementations")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--megatron-unscale", action=argparse.BooleanOptionalAction, default=True,
                    help="megatron-like runs the unscale + found_inf pass and its host read (Megatron does so "
                         "with a loss scaler; its bf16 default has none: --no-megatron-unscale)")
    ap.add_argument("--copy-min-mib", type=int, default=None,
                    help="smallest copy for the bandwidth test (default 256 MiB on CUDA, 4 MiB on CPU)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true",
                    help="compare ours' two-step result with megatron-like and torch fused; exit 1 on mismatch")
    ap.add_argument("--allow-no-ext", action="store_true",
                    help="on CUDA, run ours even when megatron_opt's CUDA extension is not built (torch reference)")
    ap.add_argument("--json", metavar="PATH", help="write every number, the device, versions, date and command")
    ap.add_argument("--plot", metavar="PATH", help="PNG: effective GB/s against shard size (needs matplotlib)")
    ap.add_argument("--from-json", metavar="PATH", help="only re-plot (--plot) / re-print a saved --json file")
    ap.add_argument("--mo-states", default="fp32",
                    help="comma-separated optimizer-state options of ours, timed side by side (names as in "
                         "scripts/bench_step.py): fp32 (default; always run, the baseline), bf16 (bf16 moments, "
                         "fp32 masters), bf16+rem (bf16 moments, bf16 params + int16 remainders; Megatron-LM's "
                         "precision-aware optimizer). With more than fp32 a second table (and plot panel) shows "
                         "each option's ms, GB/s and ms / floor against its own byte floor and its speedup vs fp32 "
                         "state; --check also compares each option's masters with the fp32-state run")
    ap.add_argument("--perturb-ours-lr", type=float, default=1.0, help=argparse.SUPPRESS)  # tests of --check
    ap.add_argument("--perturb-state-lr", type=float, default=1.0, help=argparse.SUPPRESS)  # the 16-bit options
    args = ap.parse_args(argv)
    states = [x.strip() for x in args.mo_states.split(",") if x.strip()]
    unknown = [x for x in states if x not in MO_STATES]
    if unknown:
        ap.error(f"--mo-states: unknown option(s) {unknown}; choose from {', '.join(MO_STATES)}")
    args.mo_states = ["fp32"] + [x for x in dict.fromkeys(states) if x != "fp32"]
    if args.num_tensors < 2:
        ap.error("--num-tensors must be at least 2")
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        if args.plot:
            plot(report, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        print(markdown_table(report["results"]))
        if has_states(report["results"]):
            print()
            print(states_table(report["results"]))
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_optimizer_step: --device cuda but no CUDA device is visible")
        if not mo.ops.HAS_CUDA_EXT and not args.allow_no_ext:
            sys.exit("bench_optimizer_step: megatron_opt's CUDA extension is not built "
                     f"({mo.ops.CUDA_EXT_ERROR}); build it first (`pip install -e . --no-build-isolation`, "
                     "see docs/kernels.md) or pass --allow-no-ext to time the torch reference instead.")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        device_name = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(1)  # a smoke test: one thread is steady on a shared machine (no OpenMP spinning)
        device_name = f"CPU ({platform.processor() or platform.machine()}, 1 thread)"
    if args.copy_min_mib is None:
        args.copy_min_mib = 256 if device.type == "cuda" else 4
    sizes = [int(x) for x in args.log2_sizes.split(",") if x.strip()]

    tmpdir = tempfile.mkdtemp(prefix="bench_optimizer_step_")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmpdir, 'pg')}", rank=0, world_size=1)
    try:
        print(f"# optimizer step on {device_name}, torch {torch.__version__}"
              + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else "")
              + f"; {args.num_tensors} params per size; median of {args.iters} steps after {args.warmup} warm-up"
              + ("" if device.type == "cuda" else " (CPU smoke mode: host timers, not a benchmark)"), flush=True)
        copy_cache: dict = {}
        results = []
        for log2 in sizes:
            results.append(bench_size(log2, args, device, copy_cache))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmpdir, ignore_errors=True)

    backends = sorted({r["ours_backend"] for r in results if "ours_backend" in r})
    report = {
        "device": device_name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "ours_backend": ",".join(backends),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable] + sys.argv),
        "args": vars(args),
        "floor_bytes_per_element": FLOOR_BYTES,
        "mo_states": args.mo_states,
        "state_options": {k: {"config": {f: str(v) if isinstance(v, torch.dtype) else v
                                         for f, v in MO_STATES[k].items()},
                              "label": STATE_LABELS[k], "floor_bytes_per_element": STATE_FLOOR_BYTES[k]}
                          for k in args.mo_states},
        "bytes_per_element_moved": {"ours": FLOOR_BYTES,
                                    "megatron_like": MEGATRON_BYTES + (8 if args.megatron_unscale else 0),
                                    "torch_fused": TORCH_FUSED_BYTES},
        "timing": "CUDA events around optimizer.step() after torch.cuda.synchronize()" if device.type == "cuda"
                  else "time.perf_counter around the step",
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    failed = [r["log2_size"] for r in results if "check" in r and not r["check"]["ok"]]
    print()
    print(f"ours: megatron_opt ({report['ours_backend']}); megatron-like: unscale "
          f"{'on' if args.megatron_unscale else 'off'} ({report['bytes_per_element_moved']['megatron_like']} B/elem); "
          f"torch fused: clip_grad_norm_(foreach) + AdamW(fused) on fp32 params (40 B/elem). GB/s and '/ floor' use "
          f"{FLOOR_BYTES} B/elem for all three; floor = {FLOOR_BYTES} B * N / copy GB/s; 'ours vs X' = X ms / ours ms."
          + (f" --check: {'MISMATCH at 2^' + ', 2^'.join(map(str, failed)) if failed else 'ours agrees with both'}."
             if args.check else ""))
    print()
    print(markdown_table(results))
    if has_states(results):
        print()
        print("optimizer state (ours): " + "; ".join(
            f"{STATE_LABELS[k]} floor {STATE_FLOOR_BYTES[k]} B/elem" for k in args.mo_states)
              + ". GB/s and '/ floor' use each option's own floor; 'vs fp32' = fp32-state ms / option ms in the "
                "same mode (> 1: faster); 'floor vs fp32' = 34 B / the option's floor, the speedup if both ran "
                "at their floor."
              + (" CPU: the precision-aware step widens to fp32 copies, so bytes do not bound it here."
                 if device.type == "cpu" else "")
              + (f" --check: masters after two steps vs the fp32-state run, update within {TOL_STATE_UPDATE:g} "
                 "per tensor." if args.check else ""))
        print()
        print(states_table(results))
    if failed:
        print(f"bench_optimizer_step: --check failed at sizes 2^{failed}: ours' step does not match "
              f"the reference implementations or a state option does not match the fp32-state run "
              f"(see the check lines above and the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
