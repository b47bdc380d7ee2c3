"""Worker-side cases for Muon through the distributed optimizer (DP only), against the float64
reference of tests/support/reference_muon.py fed the same global batch."""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_opt as mo
from tests.support import reference_muon as rm
from tests.support.common import whole_from_parts

VOCAB, HIDDEN, FFN, SEQ, BATCH = 32, 16, 24, 6, 3
HEADS, GROUPS, KV = 4, 2, 4  # linear_qkv.weight: 2 groups x (8 q + 4 k + 4 v) rows = 32 rows
SPLIT = rm.qkv_split_shapes(HEADS, GROUPS, KV)


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_qkv = torch.nn.Linear(HIDDEN, GROUPS * sum(SPLIT), bias=False)


class MuonNet(torch.nn.Module):
    """An embedding (marked: AdamW), a QKV matrix (split into Q, K, V), two MLP matrices with biases,
    a LayerNorm (1-D: AdamW) and an unmarked output matrix (Muon): 2-D params whose ranges straddle
    the shard boundaries at DP 2, 3 and 4."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.attn = Attn()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.emb.weight.is_embedding_or_output_parameter = True
        self.attn.linear_qkv.weight.qkv_split_shapes = SPLIT

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        q = self.attn.linear_qkv(h)
        h = (h + torch.tanh(q[..., :HIDDEN]) * q[..., HIDDEN:2 * HIDDEN]
             + 0.1 * q[..., 2 * HIDDEN:].sum(-1, keepdim=True))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.out(self.norm(h))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), t.reshape(-1))


def _assemble(state_dict: dict, name: str, shapes: dict) -> dict[str, torch.Tensor]:
    """Whole tensors of state ``name`` from every rank's state_dict part (an all_gather_object)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state_dict["state"].get(name, {}))
    return whole_from_parts(parts, shapes)


def model_and_reference() -> tuple[torch.nn.Module, torch.nn.Module]:
    """MuonNet from seed 0, and its float64 copy tagged for the reference (QKV split, embedding)."""
    torch.manual_seed(0)
    model = MuonNet()
    ref = copy.deepcopy(model).double()
    ref.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ref.emb.weight.is_embedding_or_output_parameter = True
    return model, ref


def train(dtype: str, steps: int, nesterov: bool = False, clip: float = 0.5, weight_decay: float = 0.1,
          split_qkv: bool = True, scale_mode: str = "spectral", extra_scale: float = 1.0,
          inject_nonfinite_at: Optional[int] = None, matmul_prec: str = "highest", scheduled: bool = False,
          bucket_size: Optional[int] = None, distributed: bool = True, verify: bool = False,
          precision_aware: bool = False) -> dict:
    """Train MuonNet ``steps`` steps at this world size; per step the errors against the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = model_and_reference()
    bf16 = dtype == "bf16"
    if bf16:
        model = model.bfloat16()
        model.emb.weight.is_embedding_or_output_parameter = True
        model.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, overlap_grad_reduce=True, overlap_param_gather=distributed,
        grad_reduce_in_fp32=True, bucket_size=bucket_size))
    lr = 0.02
    cfg = mo.OptimizerConfig(optimizer="muon", lr=lr, min_lr=lr / 10, weight_decay=weight_decay, bf16=bf16,
                             clip_grad=clip, use_distributed_optimizer=distributed, muon_nesterov=nesterov,
                             muon_split_qkv=split_qkv, muon_scale_mode=scale_mode, muon_extra_scale_factor=extra_scale,
                             muon_fp32_matmul_prec=matmul_prec, verify_interval=1 if verify else 0,
                             **(dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16)
                                if precision_aware else {}))
    opt = mo.get_megatron_optimizer(cfg, ddp)
    reference = rm.reference_muon(ref, lr, weight_decay, split_shapes=SPLIT, nesterov=nesterov,
                                  split_qkv=split_qkv, scale_mode=scale_mode, extra_scale_factor=extra_scale)
    schedulers = []
    if scheduled:  # one OptimizerParamScheduler drives both children (and, alike, the reference's groups)
        for target in (opt, reference):
            schedulers.append(mo.OptimizerParamScheduler(
                target, init_lr=lr / 4, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2, lr_decay_steps=6,
                lr_decay_style="cosine", start_wd=weight_decay, end_wd=2 * weight_decay, wd_incr_steps=6,
                wd_incr_style="linear"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = dict(param_err=[], momentum_err=[], norm_rel=[], success=[], muon_names=[], changed=[])
    out["muon_names"] = sorted(n for n, p in model.named_parameters() if rm.uses_muon(p))
    for step in range(steps):
        ddp.zero_grad_buffer()
        x, t = batch(step, rank)
        _loss(ddp, x, t).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if inject_nonfinite_at == step:
            ddp.finish_grad_sync()
            shard = next(s for s in ddp.local_shards() if s.pieces)
            if rank == world - 1:
                shard.grad[shard.pieces[0].shard_range.start] = float("nan")
        state_before = opt.state_dict()
        success, norm, _ = opt.step()
        out["success"].append(bool(success))
        if not success:
            state_after = opt.state_dict()
            same_state = all(torch.equal(state_before["state"][k][p]["values"], state_after["state"][k][p]["values"])
                             for k in state_before["state"] for p in state_before["state"][k])
            out["changed"].append(not same_state or any(not torch.equal(before[n], p.detach())
                                                        for n, p in model.named_parameters()))
            continue
        # The reference: the mean of every rank's loss gradient (DDP's 1/DP), clipped by the global norm.
        reference.zero_grad()
        for r in range(world):
            xr, tr = batch(step, r)
            (_loss(ref, xr, tr) / world).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf")))
        reference.step()
        for scheduler in schedulers:
            scheduler.step(1)
        out["norm_rel"].append(abs(norm - ref_norm) / ref_norm)
        # Params: the error relative to the reference's change since the start (the params themselves
        # move little, so an error relative to them would hide a wrong update).
        ddp.finish_param_sync()  # the overlapped all-gather (a forward's pre-hooks would wait for it)
        errs = {}
        for n, p in model.named_parameters():
            mine = p.detach().double()
            theirs = ref_params[n].detach()
            errs[n] = float((mine - theirs).norm() / (theirs - initial[n]).norm())
        out["param_err"].append(errs)
        sd = opt.state_dict()
        muon_shapes = {n: shapes[n] for n in out["muon_names"]}
        momentum = _assemble(sd, "momentum_buffer", muon_shapes)
        merr = {}
        for n in out["muon_names"]:
            theirs = reference.state[ref_params[n]]["momentum_buffer"]
            merr[n] = float((momentum[n] - theirs).norm() / theirs.norm())
        out["momentum_err"].append(merr)
    out["verified"] = opt.verify_report.verified_steps if verify else None
    return out



def refused(kind: str, tp_mode: str = "blockwise") -> str:
    """What is not implemented for Muon yet is refused by name, on every rank alike, before any collective."""
    model = MuonNet()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    cfg = mo.OptimizerConfig(optimizer="muon", lr=0.01, use_distributed_optimizer=True, muon_tp_mode=tp_mode)
    extra = {}
    if kind == "tensor_parallel_group":
        extra["tensor_parallel_group"] = dist.new_group(list(range(dist.get_world_size())))
    try:
        mo.get_megatron_optimizer(cfg, ddp, **extra)
    except mo.UnsupportedConfigError as exc:
        return str(exc)
    return "not refused"


def failure_on_one_rank() -> dict:
    """An invalid lr on the last rank only: that rank fails before its update while the others have
    run Muon's first part; every rank must raise RankError together (none left in the exchange)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MuonNet()
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(optimizer="muon", lr=0.01, use_distributed_optimizer=True),
                                    ddp)
    if rank == world - 1:
        opt.param_groups[0]["lr"] = float("nan")
    ddp.zero_grad_buffer()
    _loss(ddp, *batch(0, rank)).backward()
    try:
        opt.step()
    except mo.RankError as exc:
        return dict(error=str(exc))
    return dict(error=None)


def resume_is_bitwise(dtype: str) -> dict:
    """state_dict after 2 steps, one more step, load it back, the same step again: the same params and
    momentum bitwise (the load rounds the masters into the params and all-gathers them)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MuonNet()
    if dtype == "bf16":
        model = model.bfloat16()
        model.emb.weight.is_embedding_or_output_parameter = True
        model.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(optimizer="muon", lr=0.02, bf16=dtype == "bf16",
                                                       use_distributed_optimizer=True, muon_nesterov=True), ddp)

    def step(i: int) -> None:
        ddp.zero_grad_buffer()
        _loss(ddp, *batch(i, rank)).backward()
        opt.step()
        ddp.finish_param_sync()

    step(0)
    step(1)
    saved = opt.state_dict()
    step(2)
    first = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict())
    opt.load_state_dict(saved)
    ddp.finish_param_sync()
    step(2)
    second = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict())
    momentum = first[1]["state"]["momentum_buffer"]
    return dict(params=all(torch.equal(first[0][n], second[0][n]) for n in first[0]),
                momentum=all(torch.equal(v["values"], second[1]["state"]["momentum_buffer"][k]["values"])
                             for k, v in momentum.items()),
                moved=not all(torch.equal(saved["state"]["momentum_buffer"][k]["values"], v["values"])
                              for k, v in momentum.items()))


def qkv_split_missing_on_one_rank() -> dict:
    """The last rank's QKV weight lacks its split: every rank must raise together (none left waiting)."""
    model = MuonNet()
    if dist.get_rank() == dist.get_world_size() - 1:
        del model.attn.linear_qkv.weight.qkv_split_shapes
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    try:
        mo.get_megatron_optimizer(mo.OptimizerConfig(optimizer="muon", lr=0.01, use_distributed_optimizer=True), ddp)
    except mo.InvalidConfigError as exc:
        return dict(error=str(exc))
    return dict(error=None)
