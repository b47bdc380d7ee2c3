"""Worker-side cases: model-parallel groups through megatron_opt's own API (no megatron-core).

World size 4, laid out as megatron-core lays out ranks (the model-parallel dimension innermost):
pairs {0, 1} and {2, 3} are the context- (or tensor-) parallel groups, {0, 2} and {1, 3} the
data-parallel ones.

* Context parallelism: each rank of a pair holds half of every sequence of its replica's
  micro-batches. TinyLM is token-wise, so the split is exact, and the gradients must be reduced
  over data x context (here the world) with the global token count: the result must equal a float64
  single-process step on the whole batch.
* Replicated tensor-parallel params: both ranks of a pair hold the same params and the same data
  (as a LayerNorm is replicated over TP ranks); the grad norm must count each element once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.support.common import (TinyLM, fp64_copy, global_batch, reference_adamw, rel_l2, token_loss_sum)

LR, WD, CLIP = 1e-2, 0.1, 1.0


def _pairs() -> tuple:
    """(this rank's model-parallel pair group, its data-parallel group), created on every rank."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    return pairs[rank // 2], columns[rank % 2]


def _build(model: torch.nn.Module, data_parallel_group, groups: mo.ModelParallelGroups):
    ddp = mo.DistributedDataParallel(
        model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                check_for_nan_in_grad=True, bucket_size=300),
        data_parallel_group=data_parallel_group, model_parallel_groups=groups)
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                       use_distributed_optimizer=True), ddp)
    return ddp, opt


def _reference_step(ref, ref_opt, batches: list) -> tuple[float, float]:
    """(loss, grad norm) of one float64 step on the whole global batch, per-token loss."""
    ref_opt.zero_grad()
    total = sum(int((y != -100).sum()) for _, y in batches)
    loss = sum(token_loss_sum(ref(x), y)[0] for x, y in batches) / total
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    ref_opt.step()
    return float(loss), float(norm)


def _per_token(model, batch):
    tokens, labels = batch
    return token_loss_sum(model(tokens), labels)


def run_context_parallel(steps: int = 3, ga: int = 2, cp_in_reduction: bool = True) -> dict:
    """CP2 x DP2 through train_step. ``cp_in_reduction=False`` reduces over the data-parallel ranks
    only (what a missing context group in the reduction would do): the figures must then differ."""
    cp_group, dp_only = _pairs()
    rank = dist.get_rank()
    replica, cp_rank = rank // 2, rank % 2
    model = TinyLM()
    ref = fp64_copy(model)
    ref_opt = reference_adamw(ref, LR, WD)
    ddp, opt = _build(model, None if cp_in_reduction else dp_only, mo.ModelParallelGroups(context=cp_group))
    half = global_batch(1)[0][0].shape[1] // 2
    out = {"loss": [], "norm": [], "ref_loss": [], "ref_norm": []}
    for step in range(steps):
        batches = global_batch(2 * ga, seed=100 + step, ragged=True)
        mine = [(x[:, cp_rank * half:(cp_rank + 1) * half], y[:, cp_rank * half:(cp_rank + 1) * half])
                for x, y in batches[replica * ga:(replica + 1) * ga]]
        result = mo.train_step(ddp, opt, None, mine, _per_token, loss_mode="per_token")
        ref_loss, ref_norm = _reference_step(ref, ref_opt, batches)
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
        out["ref_loss"].append(ref_loss)
        out["ref_norm"].append(ref_norm)
    masters = opt.gather_main_params()
    got = torch.cat([masters[n].double().reshape(-1) for n, _ in ref.named_parameters()])
    want = torch.cat([p.detach().reshape(-1) for _, p in ref.named_parameters()])
    start = torch.cat([p.detach().double().reshape(-1) for p in TinyLM().parameters()])
    out["update_error"] = rel_l2(got - start, want - start)
    out["params_crc"] = float(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).sum())
    return out


def run_replicated_tensor_parallel(steps: int = 3, ga: int = 2, nan_on_rank: int = -1) -> dict:
    """TP2 x DP2 with every param replicated over the TP pair (same data on both): the grad norm counts
    each element once (on TP rank 0). ``nan_on_rank`` makes that rank's loss NaN at step 1: every
    rank must raise, not only that rank's data-parallel group."""
    tp_group, dp_only = _pairs()
    rank = dist.get_rank()
    replica = dist.get_rank(dp_only)  # TP peers hold the same replica, so the same data
    model = TinyLM()
    ref = fp64_copy(model)
    ref_opt = reference_adamw(ref, LR, WD)
    ddp, opt = _build(model, dp_only, mo.ModelParallelGroups(tensor=tp_group))
    out = {"norm": [], "ref_norm": [], "error": None}
    for step in range(steps):
        batches = global_batch(2 * ga, seed=200 + step, ragged=True)
        mine = batches[replica * ga:(replica + 1) * ga]
        poison = step == 1 and rank == nan_on_rank

        def loss_fn(m, batch, poison=poison):
            loss, count = _per_token(m, batch)
            return (loss * float("nan") if poison else loss), count
        try:
            result = mo.train_step(ddp, opt, None, mine, loss_fn, loss_mode="per_token")
        except Exception as exc:  # noqa: BLE001  (the case reports what every rank raised)
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        _, ref_norm = _reference_step(ref, ref_opt, batches)
        out["norm"].append(result.grad_norm)
        out["ref_norm"].append(ref_norm)
    return out


def run_expert_data_parallel_group_is_required() -> dict:
    """With an expert-parallel group of 2 ranks, expert params must get their own data-parallel group:
    megatron_opt's call shape and a megatron-core pg_collection both refuse to fall back to the dense one."""
    pair, _ = _pairs()
    errors = {}
    try:
        mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(),
                                   model_parallel_groups=mo.ModelParallelGroups(expert=pair))
    except ValueError as exc:
        errors["ours"] = str(exc)

    class Collection:  # the fields megatron-core's ProcessGroupCollection would have, minus expt_dp
        dp_cp = dist.group.WORLD
        ep = pair
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return errors
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, expert_model_parallel_size=2,
                               num_moe_experts=2)
    try:
        mo.DistributedDataParallel(config, mo.DistributedDataParallelConfig(), TinyLM(), pg_collection=Collection())
    except ValueError as exc:
        errors["megatron-core"] = str(exc)
    return errors


def run_optimizer_pg_collection_must_match_the_wrapper() -> str:
    """get_megatron_optimizer(pg_collection=...) whose TP size is not the chunks' is refused."""
    pair, dp_only = _pairs()
    ddp = mo.DistributedDataParallel(TinyLM(), mo.DistributedDataParallelConfig(use_distributed_optimizer=True),
                                     data_parallel_group=dp_only,
                                     model_parallel_groups=mo.ModelParallelGroups(tensor=pair))

    class Collection:  # a data-parallel-only collection
        tp = None
    try:
        mo.get_megatron_optimizer(mo.OptimizerConfig(lr=LR, use_distributed_optimizer=True), ddp,
                                  pg_collection=Collection())
    except mo.InvalidConfigError as exc:
        return str(exc)
    return ""


def run_edit_after_grad_sync_survives(overlap: bool, instances: int) -> bool:
    """finalize_model_grads edits main_grad in place after finish_grad_sync() (TP sum of
    sequence-parallel grads, the tied-embedding all-reduce); the optimizer's own later
    finish_grad_sync() must keep that edit (a second wait() of a gloo reduce-scatter re-copies it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, num_distributed_optimizer_instances=instances))
    ddp.zero_grad_buffer()
    model(torch.ones(2, 4) * (dist.get_rank() + 1)).sum().backward()
    ddp.finish_grad_sync()
    shard = ddp.local_shards()[0]
    shard.grad.add_(1000.0)
    edited = shard.grad.clone()
    ddp.finish_grad_sync()
    return torch.equal(edited, shard.grad)


def run_tensor_parallel_replica_check(param: str) -> dict:
    """TP2 x DP2 with verify mode at every step. After step 1, one element of ``param`` is changed on
    both ranks of TP rank 1 (so the data-parallel replicas still agree). ``fc.weight`` is tagged
    ``tensor_model_parallel`` (a different slice per TP rank: no finding); ``norm.weight`` is replicated
    across TP and must be reported."""
    tp_group, dp_only = _pairs()
    model = TinyLM()
    model.fc.weight.tensor_model_parallel = True
    ddp = mo.DistributedDataParallel(
        model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        data_parallel_group=dp_only, model_parallel_groups=mo.ModelParallelGroups(tensor=tp_group))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=LR, use_distributed_optimizer=True, verify_interval=1), ddp)
    batches = global_batch(4, seed=300)
    mine = batches[dist.get_rank(dp_only) * 2:(dist.get_rank(dp_only) + 1) * 2]
    mo.train_step(ddp, opt, None, mine, _per_token, loss_mode="per_token")
    if dist.get_rank(tp_group) == 1:
        with torch.no_grad():
            dict(model.named_parameters())[param].view(-1)[3] += 0.5
    try:
        mo.train_step(ddp, opt, None, mine, _per_token, loss_mode="per_token")
    except mo.VerificationError as exc:
        return {"error": str(exc), "last_verified": opt.verify_report.last_verified_step}
    return {"error": None, "last_verified": opt.verify_report.last_verified_step}
