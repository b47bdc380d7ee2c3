"""Worker-side cases for Muon beyond plain data parallelism: partial sharding
(num_distributed_optimizer_instances = k), expert-parallel params (their own Muon and AdamW leaves,
exchanged over the expert data-parallel group) and overlap_param_gather_with_optimizer_step, each
against the float64 reference of tests/support/reference_muon.py fed the same global batch.

The expert layer here has no token dispatch: every rank runs its own tokens through the experts of
its expert-parallel rank (``rank % EP``), which gives expert params exactly the gradient structure
of expert parallelism (summed over the expert DP group, scaled by 1/DP as megatron-core does)
without an all-to-all; tests/mcore covers a real MoE dispatcher.
"""
from __future__ import annotations

import copy
import re
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_opt as mo
from tests.distributed.cases_muon import SPLIT, VOCAB, HIDDEN, MuonNet, batch
from tests.support import reference_muon as rm
from tests.support.common import flat_params, whole_from_parts

LR, WD, CLIP = 0.02, 0.1, 0.5
EXPERT_FFN = 20


def _loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), t.reshape(-1))


class Experts(torch.nn.Module):
    """One expert-parallel rank's experts (a gated MLP; 'experts' in the names, as megatron-core's).
    The gated fc1 (2 x EXPERT_FFN rows) straddles the expert DP group's shard boundary at EP 2, DP 4."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.linear_fc1 = torch.nn.Linear(HIDDEN, 2 * EXPERT_FFN)
        self.linear_fc2 = torch.nn.Linear(EXPERT_FFN, HIDDEN, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(h).chunk(2, dim=-1)
        return self.linear_fc2(F.gelu(gate) * up)


class ExpertMuonNet(torch.nn.Module):
    """MuonNet's params plus the experts of one expert-parallel rank, applied after the dense body."""

    def __init__(self, ep_rank: int, mark: bool = True) -> None:
        super().__init__()
        self.dense = MuonNet()
        self.experts = Experts(100 + ep_rank)
        if mark:
            for p in self.experts.parameters():
                p.allreduce = False  # megatron-core's marker for expert-parallel params

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _logits_with(self.dense, self.experts, tokens)


def _logits_with(dense: MuonNet, experts: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    h = dense.emb(tokens)
    q = dense.attn.linear_qkv(h)
    h = h + torch.tanh(q[..., :HIDDEN]) * q[..., HIDDEN:2 * HIDDEN] + 0.1 * q[..., 2 * HIDDEN:].sum(-1, keepdim=True)
    h = h + dense.fc2(F.gelu(dense.fc1(h)))
    h = h + experts(h)
    return dense.out(dense.norm(h))


class ReferenceEP(torch.nn.Module):
    """The float64 whole model: the dense params once and every expert-parallel rank's experts."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        self.dense = MuonNet().double()
        self.dense.emb.weight.is_embedding_or_output_parameter = True
        self.dense.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
        self.experts = torch.nn.ModuleList([Experts(100 + e).double() for e in range(ep)])

    def loss_of_rank(self, rank: int, ep: int, step: int) -> torch.Tensor:
        x, t = batch(step, rank)
        return _loss(_logits_with(self.dense, self.experts[rank % ep], x), t)


def _model_names(part: dict) -> dict:
    """state_dict names without the ``chunk<i>.`` prefix several model chunks add."""
    return {re.sub(r"^chunk\d+\.", "", n): v for n, v in part.items()}


def _rel(mine: torch.Tensor, theirs: torch.Tensor, base: torch.Tensor) -> float:
    return float((mine.double() - theirs).norm() / base.norm())


def train_partial(k: int, steps: int = 3, bucket_size: Optional[int] = None, verify: bool = False) -> dict:
    """MuonNet on DP ranks with k optimizer instances (overlapped reduce-scatter and all-gather);
    per step the errors against the float64 reference, and what the test needs to check that the
    instances stay bitwise equal (each rank's params, its state_dict part, its shard coordinates)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MuonNet()
    ref = copy.deepcopy(model).double()
    ref.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ref.emb.weight.is_embedding_or_output_parameter = True
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True,
        bucket_size=bucket_size, num_distributed_optimizer_instances=k))
    cfg = mo.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True,
                             muon_fp32_matmul_prec="highest", verify_interval=1 if verify else 0)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    shard = ddp.local_shards()[0]
    reference = rm.reference_muon(ref, LR, WD, split_shapes=SPLIT)
    return _train(ddp, model, opt, ref, reference, steps,
                  losses=lambda step: [_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world)],
                  loss=lambda step: _loss(ddp(batch(step, rank)[0]), batch(step, rank)[1]),
                  shard_coords=(shard.instance_rank, shard.rank, dist.get_world_size(shard.group)))


def _train(ddp, model, opt, ref, reference, steps, losses, loss, shard_coords, expert_of=None) -> dict:
    """The common loop: our step, the reference's step on the whole global batch, the errors."""
    world = dist.get_world_size()
    ref_params = dict(ref.named_parameters())
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_name = expert_of or (lambda n: n)
    muon_names = sorted(n for n, p in model.named_parameters() if rm.uses_muon(p))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = dict(param_err=[], momentum_err=[], norm_rel=[], success=[], muon_names=muon_names)
    for step in range(steps):
        ddp.zero_grad_buffer()
        loss(step).backward()
        success, norm, _ = opt.step()
        out["success"].append(bool(success))
        reference.zero_grad()
        for r_loss in losses(step):
            (r_loss / world).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        reference.step()
        out["norm_rel"].append(abs(norm - ref_norm) / ref_norm if norm is not None else float("nan"))
        ddp.finish_param_sync()
        out["param_err"].append({n: _rel(p.detach(), ref_params[ref_name(n)].detach(),
                                         ref_params[ref_name(n)].detach() - initial[ref_name(n)])
                                 for n, p in model.named_parameters()})
        # The momentum, assembled from the state_dict parts of the ranks that hold the same params.
        part = _model_names(opt.state_dict()["state"].get("momentum_buffer", {}))
        parts = [None] * world
        dist.all_gather_object(parts, (expert_of(None) if expert_of else 0, part))
        mine = expert_of(None) if expert_of else 0
        # dense params from every rank; an expert param from the ranks of this rank's expert DP group
        momentum = whole_from_parts([{n: v for n, v in p.items() if tag == mine or not n.startswith("experts.")}
                              for tag, p in parts], {n: shapes[n] for n in muon_names})
        out["momentum_err"].append({
            n: float((momentum[n] - reference.state[ref_params[ref_name(n)]]["momentum_buffer"]).norm()
                     / reference.state[ref_params[ref_name(n)]]["momentum_buffer"].norm())
            for n in muon_names})
    out["params"] = flat_params(model).clone()
    sd = opt.state_dict()["state"]
    out["state"] = {(s, n): v["values"].clone() for s, vals in sd.items() for n, v in vals.items()}
    out["coords"] = shard_coords
    # this rank's owned elements of each Muon matrix (uneven ownership shows across ranks)
    out["owned"] = {n: v["values"].numel() for n, v in _model_names(sd.get("momentum_buffer", {})).items()}
    out["kinds"] = [(c.config.optimizer, c.is_expert_parallel) for c in opt.chained_optimizers]
    out["verified"] = opt.verify_report.verified_steps if opt.verify_report is not None else None
    return out


def train_expert_parallel(ep: int, steps: int = 3, verify: bool = False) -> dict:
    """ExpertMuonNet at DP = world with EP = ``ep`` (expert DP groups: ranks with equal ``rank % ep``)
    against the float64 whole model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    expert_groups = [dist.new_group(list(range(e, world, ep))) for e in range(ep)]  # every rank creates each
    e = rank % ep
    model = ExpertMuonNet(e)
    model.dense.emb.weight.is_embedding_or_output_parameter = True
    model.dense.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ref = ReferenceEP(ep)
    ref.dense.load_state_dict({k: v.double() for k, v in model.dense.state_dict().items()})
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True),
        expert_data_parallel_group=expert_groups[e])
    cfg = mo.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True,
                             muon_fp32_matmul_prec="highest", verify_interval=1 if verify else 0)
    opt = mo.get_megatron_optimizer(cfg, ddp)
    reference = rm.reference_muon(ref, LR, WD, split_shapes=SPLIT)

    def ref_name(n: Optional[str]):
        if n is None:
            return e
        return n.replace("experts.", f"experts.{e}.", 1) if n.startswith("experts.") else n

    out = _train(ddp, model, opt, ref, reference, steps,
                 losses=lambda step: [ref.loss_of_rank(r, ep, step) for r in range(world)],
                 loss=lambda step: _loss(ddp(batch(step, rank)[0]), batch(step, rank)[1]),
                 shard_coords=(e,), expert_of=ref_name)
    out["expert_group_size"] = dist.get_world_size(expert_groups[e])
    return out



class FirstChunk(torch.nn.Module):
    """MuonNet's embedding and attention (its params, under MuonNet's names)."""

    def __init__(self, net: MuonNet) -> None:
        super().__init__()
        self.emb, self.attn = net.emb, net.attn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        q = self.attn.linear_qkv(h)
        return (h + torch.tanh(q[..., :HIDDEN]) * q[..., HIDDEN:2 * HIDDEN]
                + 0.1 * q[..., 2 * HIDDEN:].sum(-1, keepdim=True))


class LastChunk(torch.nn.Module):
    """The rest of MuonNet.forward, from the attention's output."""

    def __init__(self, net: MuonNet) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm, self.out = net.fc1, net.fc2, net.norm, net.out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.out(self.norm(h))


def train_overlap_with_step(steps: int = 3) -> dict:
    """MuonNet as two model chunks (each its own DDP with overlap_param_gather) and
    overlap_param_gather_with_optimizer_step: the first chunk's Muon and AdamW children step first
    and its all-gather is dispatched while the second chunk's children update."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = MuonNet()
    ref = copy.deepcopy(net).double()
    ref.attn.linear_qkv.weight.qkv_split_shapes = SPLIT
    ref.emb.weight.is_embedding_or_output_parameter = True
    ddp_cfg = mo.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               overlap_param_gather=True, grad_reduce_in_fp32=True, bucket_size=400)
    chunks = [mo.DistributedDataParallel(FirstChunk(net), ddp_cfg), mo.DistributedDataParallel(LastChunk(net), ddp_cfg)]
    cfg = mo.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True,
                             muon_fp32_matmul_prec="highest", overlap_param_gather_with_optimizer_step=True)
    opt = mo.get_megatron_optimizer(cfg, chunks)
    reference = rm.reference_muon(ref, LR, WD, split_shapes=SPLIT)

    class Both:
        """The two chunks as one GradSource-like for the loop (zero_grad_buffer / finish_param_sync)."""

        @staticmethod
        def zero_grad_buffer():
            for c in chunks:
                c.zero_grad_buffer()

        @staticmethod
        def finish_param_sync():
            for c in chunks:
                c.finish_param_sync()

    out = _train(Both, net, opt, ref, reference, steps,
                 losses=lambda step: [_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(world)],
                 loss=lambda step: _loss(chunks[1](chunks[0](batch(step, rank)[0])), batch(step, rank)[1]),
                 shard_coords=())
    out["chunk_params"] = [sorted(n for n, _ in c.module.named_parameters()) for c in chunks]
    # megatron-core's protocol: the step dispatches the first chunk's all-gather, not its own start_param_sync
    out["step_dispatches"] = [c.overlap_param_gather_with_optimizer_step for c in chunks]
    return out
