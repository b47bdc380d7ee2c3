"""The three implementations bench_optimizer_step.py times (docs in megatron_opt_bench.optimizer_step):
ours (megatron_opt's optimizer.step()), a Megatron-like pass sequence and torch fused AdamW, on the
same params and gradients of one shard size; and the device memory they need."""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Optional

import torch

import megatron_opt as mo

from .adamw import MO_STATES, adamw_config, weight_decay_groups


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
        config = adamw_config(args, bf16=True, optimizer_cuda_graph=cuda_graph, **MO_STATES[state])
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
        # Megatron's param groups, here over the masters: each group's index lists its grads and moments
        index = {id(w): i for i, w in enumerate(self.masters)}
        named = [(name, w) for (name, _), w in zip(data.shapes, self.masters)]
        self.groups = []
        for group in weight_decay_groups(named, adamw_config(args)):
            idx = [index[id(w)] for w in group["params"]]
            self.groups.append((group["weight_decay"],
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
        named = [(name, p) for p, (name, _) in zip(self.params, data.shapes)]
        groups = weight_decay_groups(named, adamw_config(args))
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
