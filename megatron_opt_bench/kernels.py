"""Benchmark the fused step kernels (megatron_opt._C) on one GPU against PyTorch's own ops.

For each configuration and size it measures, with CUDA events (warm-up, then the median of N runs):

* the device-to-device copy bandwidth (``dst.copy_(src)``, fp32, read + write bytes counted);
* pass 1 (``grad_stats``) and pass 2 (``adamw_step``) in GB/s, from the bytes each pass must move
  (docs/kernels.md, "Byte budget"), and as a fraction of the copy bandwidth;
* the whole step (pass 1 + advance_step + pass 2) against its byte floor (two-pass bytes / copy BW);
* a Megatron-like step built from PyTorch ops over ``--num-tensors`` param-sized tensors
  (bf16/fp16 -> fp32 main-grad copy where Megatron does one, ``_amp_foreach_non_finite_check_and_unscale_``
  with loss scaling, ``_foreach_norm`` + clip with ``_foreach_mul_``, ``torch._fused_adamw_``,
  per-tensor ``copy_`` fp32 -> model dtype);
* ``torch.optim.AdamW(fused=True).step()`` on the same fp32 master params and main grads.

Configurations (names from docs/kernels.md):
  A  bf16 params, fp32 main grads (Megatron's bf16 default)      pass 1: 4 B, pass 2: 30 B
  B  bf16 params, bf16 grads                                     pass 1: 2 B, pass 2: 28 B
  C  fp16 params, fp16 grads, loss scaling                       pass 1: 2 B, pass 2: 28 B
  D  fp32 params (the master is the param: no param_out)         pass 1: 4 B, pass 2: 28 B

Usage: python scripts/bench_kernels.py [--log2-sizes 26,27,28,29,30] [--configs A,B,C,D] [--iters 20]
Sizes that do not fit in the free GPU memory are skipped. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .timing import copy_bandwidth, time_calls


@dataclass(frozen=True)
class Config:
    name: str
    grad_dtype: torch.dtype
    param_dtype: torch.dtype
    loss_scaling: bool
    description: str

    @property
    def has_param_out(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def main_grad_copy(self) -> bool:
        """Megatron copies 16-bit grads into fp32 main grads before the optimizer."""
        return self.grad_dtype != torch.float32

    def pass1_bytes(self) -> int:
        return _size(self.grad_dtype)

    def pass2_bytes(self) -> int:
        read = _size(self.grad_dtype) + 4 + 4 + 4  # grad, master, exp_avg, exp_avg_sq
        write = 4 + 4 + 4 + (_size(self.param_dtype) if self.has_param_out else 0)
        return read + write

    def memory_bytes(self, n: int) -> int:
        """Everything this config allocates for one size (ours + baselines), per element * n."""
        per = _size(self.grad_dtype) + 12 + (_size(self.param_dtype) if self.has_param_out else 0)
        per += 4 if self.main_grad_copy else 0  # fp32 main grads for the PyTorch baseline
        per += 8  # torch.optim.AdamW state
        return per * n


CONFIGS = {
    "A": Config("A", torch.float32, torch.bfloat16, False, "bf16 params + fp32 main grads"),
    "B": Config("B", torch.bfloat16, torch.bfloat16, False, "bf16 params + bf16 grads"),
    "C": Config("C", torch.float16, torch.float16, True, "fp16 params + fp16 grads, loss scaling"),
    "D": Config("D", torch.float32, torch.float32, False, "fp32 params"),
}

LR, WD, BETA1, BETA2, EPS, MAX_NORM = 1e-4, 0.1, 0.9, 0.95, 1e-8, 1.0
LOSS_SCALE = 2.0**16
DEVICE = "cuda"


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median time of fn on the GPU, in ms, from CUDA events."""
    return statistics.median(time_calls(fn, torch.device(DEVICE), warmup, iters))


def make_table(n: int, num_tensors: int):
    from megatron_opt.ops import PieceTable

    bounds = [round(i * n / num_tensors) for i in range(num_tensors + 1)]
    starts, ends = tuple(bounds[:-1]), tuple(bounds[1:])
    keep = [(s, e) for s, e in zip(starts, ends) if e > s]
    k = len(keep)
    return PieceTable(tuple(s for s, _ in keep), tuple(e for _, e in keep), (True,) * k,
                        tuple(i % 2 for i in range(k)), n)


def bench_config(cfg: Config, n: int, num_tensors: int, warmup: int, iters: int, copy_gbs: float) -> Optional[dict]:
    import megatron_opt.ops as ops
    from megatron_opt import AdamW

    dev = torch.device(DEVICE)
    free, _ = torch.cuda.mem_get_info()
    need = cfg.memory_bytes(n)
    if need > 0.9 * free:
        print(f"skip {cfg.name} n=2^{n.bit_length() - 1}: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
              file=sys.stderr)
        return None

    table = make_table(n, num_tensors)
    scale = LOSS_SCALE if cfg.loss_scaling else 1.0
    grad = (torch.randn(n, device=dev) * (1e-3 * scale)).to(cfg.grad_dtype)
    master = torch.randn(n, device=dev)
    exp_avg = torch.zeros(n, device=dev)
    exp_avg_sq = torch.zeros(n, device=dev)
    param_out = master.to(cfg.param_dtype) if cfg.has_param_out else None
    inv_scale = torch.full((1,), 1.0 / scale, device=dev)
    grad_scale = inv_scale.clone()  # inv_scale * clip_coef, a device scalar
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    # Built once, as the optimizer builds them: one plan, one device (lr, wd) table.
    plan = ops.StepPlan((ops.ShardOperands(table, grad, master, (exp_avg, exp_avg_sq), param_out),))
    lr_wd = ops.DeviceHyperparams(2, dev).update([LR, LR], [WD, 0.0])

    def pass1():
        ops.grad_stats(plan, inv_scale, stats, count_zeros=False)  # Megatron-LM default

    def pass2():
        AdamW(beta1=BETA1, beta2=BETA2, eps=EPS).apply(plan, lr_wd=lr_wd, grad_scale=grad_scale, step=step,
                                                       backend="auto")

    def our_step():
        stats.zero_()
        pass1()
        ops.advance_step(step)
        pass2()

    if dev.type == "cuda" and ops.backend_for(grad) != "cuda-ext":
        raise RuntimeError("the fused ops did not dispatch to the CUDA extension")
    step.fill_(1)
    p1 = time_ms(pass1, warmup, iters)
    p2 = time_ms(pass2, warmup, iters)
    whole = time_ms(our_step, warmup, iters)

    # ---------------- Megatron-like sequence from PyTorch ops over num_tensors tensors
    views = lambda flat: [flat[s:e] for s, e in zip(table.starts, table.ends)]  # noqa: E731
    main_flat = torch.empty(n, device=dev) if cfg.main_grad_copy else grad
    model_grads, main_grads = views(grad), views(main_flat)
    masters, ms, vs = views(master), views(exp_avg), views(exp_avg_sq)
    model_params = views(param_out) if param_out is not None else None
    steps = [torch.zeros((), device=dev) for _ in masters]
    found_inf = torch.zeros(1, device=dev)
    inv = torch.full((1,), 1.0 / scale, device=dev)

    def megatron_like():
        if cfg.main_grad_copy:  # _copy_model_grads_to_main_grads
            for dst, src in zip(main_grads, model_grads):
                dst.copy_(src)
        if cfg.loss_scaling:  # _unscale_main_grads_and_check_for_nan (+ the host read of found_inf)
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, inv)
            if found_inf.item() != 0:
                return
        norms = torch._foreach_norm(main_grads)
        total = torch.linalg.vector_norm(torch.stack(norms))
        clip = (MAX_NORM / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(main_grads, clip)
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(masters, main_grads, ms, vs, [], steps, lr=LR, beta1=BETA1, beta2=BETA2,
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
        if model_params is not None:  # _copy_main_params_to_model_params
            for dst, src in zip(model_params, masters):
                dst.copy_(src)

    megatron = time_ms(megatron_like, warmup, iters)
    # the Megatron-like sequence scaled the grads in place: restore a sane scale for what follows
    if not cfg.main_grad_copy:
        grad.normal_().mul_(1e-3)

    # ---------------- torch.optim.AdamW(fused=True) on the fp32 master params and fp32 main grads
    if cfg.main_grad_copy:
        for dst, src in zip(main_grads, model_grads):
            dst.copy_(src)
    params = [torch.nn.Parameter(t) for t in masters]
    for p, g in zip(params, main_grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)
    fused = time_ms(opt.step, warmup, iters)
    del opt, params

    b1, b2 = cfg.pass1_bytes(), cfg.pass2_bytes()
    floor_ms = (b1 + b2) * n / (copy_gbs * 1e9) * 1e3
    return {
        "config": cfg.name,
        "n": n,
        "p1_ms": p1,
        "p1_gbs": b1 * n / (p1 * 1e-3) / 1e9,
        "p2_ms": p2,
        "p2_gbs": b2 * n / (p2 * 1e-3) / 1e9,
        "step_ms": whole,
        "floor_ms": floor_ms,
        "megatron_ms": megatron,
        "fused_ms": fused,
        "b1": b1,
        "b2": b2,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log2-sizes", default="26,27,28,29,30", help="comma-separated log2 element counts")
    ap.add_argument("--configs", default="A,B,C,D", help="subset of A,B,C,D")
    ap.add_argument("--num-tensors", type=int, default=512, help="param-sized tensors in the PyTorch baselines")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device is visible; this benchmark needs one GPU.", file=sys.stderr)
        return 2
    import megatron_opt.ops as ops

    if not ops.HAS_CUDA_EXT:
        print(
            "bench_kernels: the CUDA extension megatron_opt._C is not available "
            f"({ops.CUDA_EXT_ERROR}). Build it first, e.g. `pip install -e . --no-build-isolation` "
            "or `python setup.py build_ext --inplace` (see docs/kernels.md).",
            file=sys.stderr,
        )
        return 2
    sizes = [2 ** int(x) for x in args.log2_sizes.split(",") if x.strip()]
    configs = [CONFIGS[c.strip().upper()] for c in args.configs.split(",") if c.strip()]

    props = torch.cuda.get_device_properties(0)
    print(f"# megatron_opt kernels on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; median of {args.iters} runs after {args.warmup} warm-up runs\n")
    for c in configs:
        print(f"- {c.name}: {c.description}; pass 1 {c.pass1_bytes()} B/elem, pass 2 {c.pass2_bytes()} B/elem")
    print()
    header = ("| cfg | elements | copy GB/s | pass 1 ms | pass 1 GB/s (% copy) | pass 2 ms | pass 2 GB/s (% copy) "
              "| step ms | floor ms | step / floor | Megatron-like ms | AdamW(fused) ms | Megatron-like / step |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    torch.manual_seed(0)
    for n in sizes:
        free, _ = torch.cuda.mem_get_info()
        if 8 * n > 0.9 * free:
            print(f"skip n=2^{n.bit_length() - 1}: the copy benchmark alone does not fit", file=sys.stderr)
            continue
        copy_gbs = copy_bandwidth(n, torch.device(DEVICE), args.warmup, args.iters)
        for cfg in configs:
            r = bench_config(cfg, n, args.num_tensors, args.warmup, args.iters, copy_gbs)
            torch.cuda.empty_cache()
            if r is None:
                continue
            print(
                f"| {r['config']} | 2^{n.bit_length() - 1} | {copy_gbs:.0f} | {r['p1_ms']:.3f} | "
                f"{r['p1_gbs']:.0f} ({100 * r['p1_gbs'] / copy_gbs:.0f}%) | {r['p2_ms']:.3f} | "
                f"{r['p2_gbs']:.0f} ({100 * r['p2_gbs'] / copy_gbs:.0f}%) | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | "
                f"{r['step_ms'] / r['floor_ms']:.2f} | {r['megatron_ms']:.3f} | {r['fused_ms']:.3f} | "
                f"{r['megatron_ms'] / r['step_ms']:.2f} |",
                flush=True,
            )
    return 0
