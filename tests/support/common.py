"""Models, data and reference computations shared by the test cases (imported inside workers too)."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_opt as mo

VOCAB, HIDDEN, SEQ = 64, 16, 8


class TinyLM(torch.nn.Module):
    """Embedding -> Linear -> LayerNorm -> Linear, plus two fp32 'keep' params (like Mamba's A_log, D).

    In a bf16 model the keep params stay fp32 and land in their own buffer, where ``keep_a`` straddles
    a shard boundary at DP 2, 3 and 4 (layout: keep_d at 0..7, keep_a at 64..176).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 1234) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)
        self.keep_a = torch.nn.Parameter(torch.zeros(7 * HIDDEN))
        self.keep_d = torch.nn.Parameter(torch.zeros(7))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.to(dtype)
        self.keep_a.data = self.keep_a.data.float()
        self.keep_d.data = self.keep_d.data.float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(tokens)))
        mix = torch.tanh(h[..., :7]) @ self.keep_a.to(h.dtype).view(7, HIDDEN)
        h = h + 0.5 * mix + torch.cat([h[..., :7] * self.keep_d.to(h.dtype), torch.zeros_like(h[..., 7:])], -1)
        return self.out(self.norm(h))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, supervised token count); labels == -100 are ignored."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def global_batch(num_microbatches: int, mb_size: int = 2, seed: int = 7, ragged: bool = False):
    """Micro-batches of (tokens, labels); ragged masks a varying number of labels per sequence."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (mb_size, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (mb_size, SEQ), generator=g)
        if ragged:
            keep = torch.randint(0, SEQ + 1, (mb_size, 1), generator=g)
            labels = torch.where(torch.arange(SEQ) < keep, labels, torch.full_like(labels, -100))
        batches.append((tokens, labels))
    return batches


def rank_microbatches(batches: list, rank: int, world: int) -> list:
    per = len(batches) // world
    return batches[rank * per : (rank + 1) * per]


def build(model: torch.nn.Module, *, distributed: bool = True, grad_fp32: bool = True, overlap_grad: bool = False,
          overlap_param: bool = False, bucket_size: Optional[int] = None, **opt_kwargs):
    ddp_cfg = mo.DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_param, bucket_size=bucket_size,
    )
    ddp = mo.DistributedDataParallel(model, ddp_cfg)
    opt_cfg = mo.OptimizerConfig(use_distributed_optimizer=distributed, **{"lr": 1e-2, **opt_kwargs})
    return ddp, mo.get_megatron_optimizer(opt_cfg, ddp)


def reference_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999), eps=1e-8):
    """torch AdamW with Megatron's default groups: no weight decay on biases and 1-D params."""
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


class ReferenceLion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023) written out per param, for float64 references: c = b1*m + (1-b1)*g,
    w = w*(1 - lr*wd) - lr*sign(c), m = b2*m + (1-b2)*g."""

    def __init__(self, params, lr: float, betas=(0.95, 0.98), weight_decay: float = 0.0) -> None:  # OptimizerConfig's
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                direction = (m * beta1 + p.grad * (1 - beta1)).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(direction * group["lr"])
                m.mul_(beta2).add_(p.grad * (1 - beta2))


def reference_optimizer(kind: str, model: torch.nn.Module, lr: float, weight_decay: float):
    """torch AdamW, torch SGD (momentum 0.9, OptimizerConfig's default) or ReferenceLion with Megatron's
    default groups (no decay on biases and 1-D params)."""
    if kind == "adam":
        return reference_adamw(model, lr, weight_decay)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    if kind == "sgd":
        return torch.optim.SGD([{"params": decay, "weight_decay": weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=0.9)
    return ReferenceLion([{"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def fp64_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.double()
    return ref


def full_main_params(ddp: mo.DistributedDataParallel, opt) -> dict[str, torch.Tensor]:
    """Every param's fp32 master, assembled from all ranks' shards (a collective)."""
    return opt.gather_main_params()


def whole_from_parts(parts: list[dict], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Whole float64 tensors (NaN where no part covers) from state_dict parts ({key: {"start", "values"}})
    of the ranks that together own them."""
    out = {}
    for key, shape in shapes.items():
        full = torch.full((torch.Size(shape).numel(),), float("nan"), dtype=torch.float64)
        for part in parts:
            if key in part:
                values = part[key]["values"].double()
                full[part[key]["start"]:part[key]["start"] + values.numel()] = values
        out[key] = full.view(shape)
    return out


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def the_same_on_every_rank(values: Iterable[Any]) -> Any:
    """The one value every rank reported (an error message raised on every rank together); AssertionError listing
    them when the ranks differ."""
    distinct = set(values)
    assert len(distinct) == 1, distinct
    return distinct.pop()


def assert_identical_across_ranks(t: torch.Tensor) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    for r, other in enumerate(gathered):
        assert torch.equal(other, t), f"rank {dist.get_rank()} and rank {r} hold different values"


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def cosine_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """pith-train's metric 1 - 2<x,y>/(|x|^2+|y|^2): 0 for equal vectors."""
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    return float(1 - 2 * (x @ y) / (x @ x + y @ y).clamp_min(1e-30))


def microbatch_contexts(ddp: mo.DistributedDataParallel, n: int):
    """no_sync for every micro-batch but the last."""
    return [ddp.no_sync() if i < n - 1 else contextlib.nullcontext() for i in range(n)]


class Probe(torch.nn.Module):
    """One weight vector w; a micro-batch (c, n) has per-token loss sum n * c * w.sum(), so the
    normalised gradient of every element is the token-weighted mean of c (closed form)."""

    def __init__(self, dtype: torch.dtype = torch.float32, numel: int = 10) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(numel, dtype=dtype))

    def forward(self, c: float) -> torch.Tensor:
        return c * self.w.float().sum()


def full_reduced_grads(ddp: mo.DistributedDataParallel) -> dict[str, torch.Tensor]:
    """The reduced, normalised (x grad_scale_factor) gradient of every param, assembled on all ranks."""
    scale = float(ddp.grad_scale_factor)
    out = {}
    for shard in ddp.local_shards():  # per shard: 16-bit grads were pre-divided by grad_prescale
        full = mo.assemble_full_tensors([shard], lambda s: s.grad, dtype=torch.float64)
        out.update({name: g * scale / shard.grad_prescale for name, g in full.items()})
    return out


def sgd_exact(**kw) -> dict:
    """Optimizer settings under which the update is exactly -gradient."""
    return {**dict(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, lr=1.0), **kw}


def train_with_reference(ddp, opt, ga: int, steps: int, reference_step, loss_mult: float = 1.0) -> list[tuple]:
    """``steps`` optimizer steps of TinyLM, each on this rank's ``ga`` micro-batches of a fresh global
    batch (a token-mean loss per micro-batch, / GA), and ``reference_step(batches)`` on the whole
    global batch. Returns (our grad norm, the reference's return value) per step."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    norms = []
    for step in range(steps):
        batches = global_batch(world * ga, seed=100 + step)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for ctx, (x, y) in zip(microbatch_contexts(ddp, ga), rank_microbatches(batches, rank, world)):
            with ctx:
                loss_sum, n = token_loss_sum(ddp(x), y)
                opt.scale_loss(loss_sum / n / ga * loss_mult).backward()
        success, norm, _ = opt.step()
        assert success, f"step {step} skipped unexpectedly"
        norms.append((norm, reference_step(batches)))
    return norms


def assert_within(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    """|got - want| <= atol + rtol * |want| elementwise (NaNs must match); cheap on large tensors."""
    got, want = got.double(), want.to(device=got.device, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ"
    err = (got - want).abs().masked_fill_(nan_w, 0.0)
    same_inf = torch.isinf(want) & (got == want)
    err.masked_fill_(same_inf, 0.0)
    tol = atol + rtol * want.abs().masked_fill(nan_w | same_inf, 0.0)
    bad = err > tol
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements out of tolerance; first at {i}: "
            f"got {got[i].item()!r}, want {want[i].item()!r} (rtol={rtol}, atol={atol})"
        )


class FakeOptimizer:
    """Only what an LR scheduler touches: a list of param-group dicts."""

    def __init__(self, *groups: dict[str, Any]) -> None:
        self.param_groups = [{"params": [], **g} for g in (groups or ({},))]


def scale_of(scaler) -> float:
    """A grad scaler's current loss scale."""
    return scaler.scale.item()


def trackers(scaler) -> tuple[int, int]:
    """A dynamic grad scaler's (growth tracker, hysteresis tracker), read through its state dict."""
    sd = scaler.state_dict()
    return sd["growth_tracker"], sd["hysteresis_tracker"]
