"""Worker-side cases for partial sharding (DistributedDataParallelConfig.num_distributed_optimizer_instances).

k optimizer instances of DP / k ranks each: gradients are reduce-scattered inside an instance, the
shard is all-reduced across instances, the optimizer updates its shard and the params are
all-gathered inside the instance. Every case runs on every rank of a gloo pool.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist

import megatron_opt as mo
from megatron_opt import collectives
from megatron_opt.distributed import ddp_call
from tests.support.common import (TinyLM, assert_identical_across_ranks, cosine_diff, flat_params, full_reduced_grads,
                    global_batch, microbatch_contexts, rank_microbatches, rel_l2, token_loss_sum,
                    train_with_reference)
from tests.distributed.cases_parity import PRECISIONS, MasterWeightReference


def ddp_config(k: int, *, overlap: bool = False, grad_fp32: bool = True, bucket_size=None, core: bool = False):
    kwargs = dict(use_distributed_optimizer=True, grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=overlap,
                  overlap_param_gather=overlap, bucket_size=bucket_size, num_distributed_optimizer_instances=k)
    if core:  # megatron-core's own config object, converted field by field by the wrapper
        from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig
        return CoreDDPConfig(**kwargs)
    return mo.DistributedDataParallelConfig(**kwargs)


def build_partial(model: torch.nn.Module, k: int, *, overlap: bool = False, grad_fp32: bool = True,
                  bucket_size=None, core_config: bool = False, **opt_kwargs):
    ddp = mo.DistributedDataParallel(model, ddp_config(k, overlap=overlap, grad_fp32=grad_fp32,
                                                       bucket_size=bucket_size, core=core_config))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(use_distributed_optimizer=True, **{"lr": 1e-2, **opt_kwargs}),
                                    ddp)
    return ddp, opt


def check_shards(ddp: mo.DistributedDataParallel, k: int) -> None:
    """The published shards: sharded over one instance (DP / k ranks), replicated over k instances,
    16-bit pre-scale and the step's gradient scale over the whole DP group."""
    world = dist.get_world_size()
    instance = world // k
    assert float(ddp.grad_scale_factor) == 1.0 / world, float(ddp.grad_scale_factor)
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        assert buf.layout.shard_count == instance, (buf.layout.shard_count, instance)
    for shard in ddp.local_shards():
        assert shard.shard_count == instance, (shard.shard_count, instance)
        assert collectives.world_size(shard.group) == instance
        assert shard.rank == dist.get_rank() % instance, (shard.rank, dist.get_rank())
        assert shard.instance_count == k and shard.instance_rank == dist.get_rank() // instance
        assert shard.sharded == (instance > 1)
        expected = 1.0 / world if shard.grad.dtype in (torch.bfloat16, torch.float16) else 1.0
        assert shard.grad_prescale == expected, (shard.grad_prescale, expected)
        if k > 1:
            assert ddp_call.global_ranks(shard.inter_instance_group) == list(range(dist.get_rank() % instance, world,
                                                                                   instance))
            assert ddp_call.global_ranks(shard.group) == list(range(shard.instance_rank * instance,
                                                                    (shard.instance_rank + 1) * instance))


def run_partial_parity(precision: str, k: int, overlap: bool, grad_fp32: bool = True, ga: int = 2, steps: int = 4,
                       clip_grad: float = 1.0, lr: float = 1e-2, weight_decay: float = 0.1,
                       core_config: bool = False) -> dict:
    """cases_parity.run_parity with k optimizer instances: TinyLM for ``steps`` steps on DP ranks x ``ga``
    micro-batches against the float64 AdamW reference on the same global batch."""
    world = dist.get_world_size()
    spec = PRECISIONS[precision]
    model = TinyLM(spec["dtype"])
    ref = MasterWeightReference(model, lr, weight_decay)
    ddp, opt = build_partial(model, k, overlap=overlap, grad_fp32=grad_fp32, bucket_size=300 if overlap else None,
                             core_config=core_config, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                             **spec["opt"])
    if overlap:
        assert sum(len(b.buckets) for b in ddp.buffers) > 2, "the overlap runs must use several buckets"
    check_shards(ddp, k)
    init = {n: p.detach().double().clone() for n, p in ref.masters.named_parameters()}
    norms = train_with_reference(ddp, opt, ga, steps, lambda batches: ref.step(batches, clip_grad, world))
    if ddp.ddp_config.overlap_param_gather:
        ddp.finish_param_sync()
    assert_identical_across_ranks(flat_params(model))  # every rank of every instance
    masters = opt.gather_main_params()
    assert_identical_across_ranks(torch.cat([masters[n].reshape(-1) for n in sorted(masters)]))
    errors = {}
    for name, p in ref.masters.named_parameters():
        delta_ours, delta_ref = masters[name].double() - init[name], p.detach() - init[name]
        errors[name] = (rel_l2(delta_ours, delta_ref), cosine_diff(delta_ours, delta_ref))
    return {"errors": errors, "norms": norms}


def _snapshot(model: torch.nn.Module, opt) -> dict:
    state = {n: t.detach().clone() for n, t in opt.leaf.state_tensors().items()}
    return {"params": flat_params(model).clone(), "state": state}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["params"], b["params"]) and a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][n], b["state"][n]) for n in a["state"])


def run_one_rank_nonfinite(k: int, mode: str) -> dict:
    """One rank (the last: the last instance) gets a non-finite gradient in step 2 of 3; every rank of
    every instance must skip that step and leave params and optimizer state bitwise unchanged.

    mode 'element': one element of one param's main_grad is set to NaN after the backward (overlap
    off, so it enters the reduction); 'loss': that rank's loss is multiplied by inf with
    overlap_grad_reduce on (the buckets are reduced during the backward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM()
    overlap = mode == "loss"
    ddp, opt = build_partial(model, k, overlap=overlap, bucket_size=300 if overlap else None)
    results = []
    for step in range(3):
        bad = step == 1 and rank == world - 1
        x, y = rank_microbatches(global_batch(world, seed=200 + step), rank, world)[0]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss_sum, n = token_loss_sum(ddp(x), y)
        loss = loss_sum / n
        if bad and mode == "loss":
            loss = loss * float("inf")
        loss.backward()
        if bad and mode == "element":
            with torch.no_grad():
                model.out.weight.main_grad.view(-1)[5] = float("nan")
        before = _snapshot(model, opt)
        success, norm, _ = opt.step()
        if ddp.ddp_config.overlap_param_gather:
            ddp.finish_param_sync()
        results.append({"success": bool(success), "norm": norm, "unchanged": _same(before, _snapshot(model, opt)),
                        "step_count": opt.step_count})
    assert_identical_across_ranks(flat_params(model))
    return {"steps": results, "skipped": opt.skipped_steps}


def run_construction_error(k: int, use_distributed_optimizer: bool = True) -> tuple[str, str]:
    """Build a DDP with k instances; return (exception type, message), or ('', '') if it built."""
    try:
        cfg = mo.DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               num_distributed_optimizer_instances=k)
        mo.DistributedDataParallel(TinyLM(), cfg)
    except Exception as exc:  # noqa: BLE001  (the test inspects it)
        return type(exc).__name__, str(exc)
    return "", ""


def run_broadcast_params(k: int) -> None:
    """broadcast_params() makes every rank of every instance start from rank 0's params."""
    model = TinyLM(seed=1000 + dist.get_rank())  # a different init on every rank
    ddp = mo.DistributedDataParallel(model, ddp_config(k))
    ddp.broadcast_params()
    assert torch.equal(flat_params(model), flat_params(TinyLM(seed=1000)))  # rank 0's, on every rank


def run_groups_are_shared(k: int) -> dict:
    """A second chunk given the first one's groups (instance_groups=...) uses exactly them, and the
    created intra/inter groups are the ones megatron-core's parallel_state would build."""
    a = mo.DistributedDataParallel(TinyLM(), ddp_config(k))
    b = mo.DistributedDataParallel(TinyLM(), ddp_config(k),
                                   instance_groups=(a.intra_instance_group, a.inter_instance_group))
    return {"same": (a.intra_instance_group is b.intra_instance_group
                     and a.inter_instance_group is b.inter_instance_group),
            "intra": ddp_call.global_ranks(a.intra_instance_group),
            "inter": ddp_call.global_ranks(a.inter_instance_group)}


def _one_step_reduced_grads(ddp: mo.DistributedDataParallel, model: torch.nn.Module, overlap: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp.zero_grad_buffer()
    for ctx, (x, y) in zip(microbatch_contexts(ddp, 2),
                           rank_microbatches(global_batch(world * 2, seed=5), rank, world)):
        with ctx:
            loss_sum, n = token_loss_sum(ddp(x), y)
            (loss_sum / n / 2).backward()
    ddp.finish_grad_sync()
    return full_reduced_grads(ddp)


def _tc():
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)


@contextlib.contextmanager
def _fake_parallel_state(intra, inter):
    """megatron-core's parallel_state as initialize_model_parallel(num_distributed_optimizer_instances=k)
    leaves it (its hierarchical groups need einops, which the test environment lacks): the functions
    megatron_opt's DDP reads, answering with the given groups; restored on exit."""
    from megatron.core import parallel_state as ps
    answers = {
        "model_parallel_is_initialized": lambda: True,
        "get_tensor_model_parallel_world_size": lambda: 1,
        "get_pipeline_model_parallel_world_size": lambda: 1,
        "get_context_parallel_world_size": lambda: 1,
        "get_expert_model_parallel_world_size": lambda: 1,
        "get_data_parallel_group": lambda with_context_parallel=False, partial_data_parallel=False: (
            intra if partial_data_parallel else dist.group.WORLD),
        "get_inter_distributed_optimizer_instance_group": lambda check_initialized=True: inter,
        "get_expert_data_parallel_group": lambda *a, **kw: dist.group.WORLD,
    }
    saved = {name: getattr(ps, name) for name in answers}
    try:
        for name, fn in answers.items():
            setattr(ps, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(ps, name, fn)


def run_megatron_core_groups(k: int, source: str) -> dict:
    """megatron-core's call shape with k instances: the groups come from pg_collection ('pg_collection')
    or parallel_state ('parallel_state'), or are created ('created'); the reduced gradients equal those
    of a one-instance wrapper. Groups built here have megatron-core's rank split."""
    world = dist.get_world_size()
    own_intra, own_inter = ddp_call.instance_groups(None, k)  # the same ranks megatron-core would choose
    # Fresh groups over the same ranks (every rank creates every group, in the same order), so that
    # "the given groups were used" is an identity check.
    s = world // k
    intra = inter = None
    for i in range(k):
        g = dist.new_group(list(range(i * s, (i + 1) * s)))
        intra = g if dist.get_rank() // s == i else intra
    for j in range(s):
        g = dist.new_group(list(range(j, world, s)))
        inter = g if dist.get_rank() % s == j else inter
    torch.manual_seed(0)
    model = TinyLM()
    reference_model = TinyLM()
    cfg = ddp_config(k, core=True)
    if source == "pg_collection":
        pgc = types.SimpleNamespace(dp_cp=dist.group.WORLD, expt_dp=dist.group.WORLD, intra_dp_cp=intra,
                                    inter_dist_opt=inter)
        ddp = mo.DistributedDataParallel(_tc(), cfg, model, pg_collection=pgc)
    elif source == "parallel_state":
        with _fake_parallel_state(intra, inter):
            ddp = mo.DistributedDataParallel(_tc(), cfg, model)
    else:
        pgc = types.SimpleNamespace(dp_cp=dist.group.WORLD, expt_dp=dist.group.WORLD)
        ddp = mo.DistributedDataParallel(_tc(), cfg, model, pg_collection=pgc)
        intra, inter = own_intra, own_inter
    if source == "created":  # new groups over the ranks megatron-core would choose
        used = (ddp_call.global_ranks(ddp.intra_instance_group) == ddp_call.global_ranks(intra),
                ddp_call.global_ranks(ddp.inter_instance_group) == ddp_call.global_ranks(inter))
    else:
        used = (ddp.intra_instance_group is intra, ddp.inter_instance_group is inter)
    check_shards(ddp, k)
    reference = mo.DistributedDataParallel(reference_model,
                                           mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    ours, theirs = (_one_step_reduced_grads(ddp, model, False),
                    _one_step_reduced_grads(reference, reference_model, False))
    diff = max(float((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp_min(1e-30)) for n in theirs)
    return {"used_given_groups": used, "max_rel_diff": diff}


def run_wrong_groups(kind: str) -> tuple[str, str]:
    """Groups from megatron-core that do not split DP=4 into 2 instances: InvalidConfigError on every rank."""
    world = dist.get_world_size()
    if kind == "parallel_state_k1":  # parallel_state initialised with one instance: its partial group is all DP
        intra, inter = dist.group.WORLD, dist.new_group([dist.get_rank()], use_local_synchronization=True)
    else:  # 'crossed': instances {0, 1} and {2, 3}, but the inter groups {0, 3} and {1, 2} pair shard 0 with shard 1
        intra = inter = None
        for ranks in ([0, 1], [2, 3]):
            g = dist.new_group(ranks)
            intra = g if dist.get_rank() in ranks else intra
        for ranks in ([0, 3], [1, 2]):
            g = dist.new_group(ranks)
            inter = g if dist.get_rank() in ranks else inter
    assert world == 4
    pgc = types.SimpleNamespace(dp_cp=dist.group.WORLD, expt_dp=dist.group.WORLD, intra_dp_cp=intra,
                                inter_dist_opt=inter)
    try:
        mo.DistributedDataParallel(_tc(), ddp_config(2, core=True), TinyLM(), pg_collection=pgc)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "", ""


def run_subgroup_dp(k: int) -> dict:
    """A data-parallel group that is a subgroup of the world ({0, 1} and {2, 3} at world 4): the
    instance groups are created by their members only. Reduced gradients equal one instance's."""
    rank = dist.get_rank()
    dp = None
    for ranks in ([0, 1], [2, 3]):
        g = dist.new_group(ranks)
        dp = g if rank in ranks else dp
    torch.manual_seed(0)
    model, reference_model = TinyLM(), TinyLM()
    cfg = ddp_config(k)
    ddp = mo.DistributedDataParallel(model, cfg, dp)
    reference = mo.DistributedDataParallel(reference_model,
                                           mo.DistributedDataParallelConfig(use_distributed_optimizer=True), dp)

    def grads(d, m):
        d.zero_grad_buffer()
        x, y = global_batch(4, seed=9)[rank]
        loss_sum, n = token_loss_sum(d(x), y)
        (loss_sum / n).backward()
        d.finish_grad_sync()
        return full_reduced_grads(d)

    ours, theirs = grads(ddp, model), grads(reference, reference_model)
    diff = max(float((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp_min(1e-30)) for n in theirs)
    return {"intra": ddp_call.global_ranks(ddp.intra_instance_group),
            "inter": ddp_call.global_ranks(ddp.inter_instance_group), "max_rel_diff": diff}


def run_expert_params(k: int, separate_expert_group: bool) -> tuple[str, str]:
    """Expert-parallel params (allreduce=False) with k instances: partially sharded like the dense
    ones when their group is the data-parallel group; UnsupportedConfigError on every rank otherwise."""
    model = TinyLM()
    model.keep_a.allreduce = False  # an 'expert' param: its own buffer over the expert data-parallel group
    expert_group = None
    if separate_expert_group:
        for ranks in ([0, 1], [2, 3]):
            g = dist.new_group(ranks)
            expert_group = g if dist.get_rank() in ranks else expert_group
    try:
        ddp = mo.DistributedDataParallel(model, ddp_config(k), None, expert_group)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    assert ddp.expert_parallel_buffers and ddp.expert_parallel_buffers[0].inter_group is ddp.inter_instance_group
    if not separate_expert_group:
        check_shards(ddp, k)
        _one_step_reduced_grads(ddp, model, False)  # both buffers reduce (and agree on their collectives)
    return "", ""


def run_chained_optimizer_norm(k: int) -> float:
    """megatron-core's call shape: get_megatron_optimizer returns a ChainedOptimizer whose statistics
    are summed over its grad_stats_group (the world by default). Returns the step's grad norm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    pgc = types.SimpleNamespace(dp_cp=dist.group.WORLD, expt_dp=dist.group.WORLD)
    ddp = mo.DistributedDataParallel(_tc(), ddp_config(k, core=True), model, pg_collection=pgc)
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, clip_grad=0.0), ddp)
    ddp.zero_grad_buffer()
    x, y = rank_microbatches(global_batch(world, seed=11), rank, world)[0]
    loss_sum, n = token_loss_sum(ddp(x), y)
    (loss_sum / n).backward()
    success, norm, _ = opt.step()
    assert success
    return float(norm)


def run_missing_backward_on_one_rank(k: int) -> str:
    """The last rank runs no backward: every rank must raise StepOrderError (rule: all ranks decide
    together). Returns 'raised' or 'stepped'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM()
    ddp, opt = build_partial(model, k)
    ddp.zero_grad_buffer()
    if rank != world - 1:
        x, y = rank_microbatches(global_batch(world, seed=12), rank, world)[0]
        loss_sum, n = token_loss_sum(ddp(x), y)
        (loss_sum / n).backward()
    try:
        opt.step()
    except mo.StepOrderError:
        return "raised"
    return "stepped"


__all__ = [name for name in dir(sys.modules[__name__]) if name.startswith("run_")]


def run_zero_count(k: int) -> dict:
    """One step with k instances and log_num_zeros_in_grad: the step's num_zeros and a float64 count of the
    whole model's zero gradient elements on the same global batch (each element once, not once per instance)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM()
    ref = TinyLM().double()
    ref.load_state_dict({n: p.detach().double() for n, p in model.state_dict().items()})
    ddp, opt = build_partial(model, k, log_num_zeros_in_grad=True)
    batches = global_batch(world, seed=3)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    x, y = batches[rank]
    loss, n = token_loss_sum(ddp(x), y)
    opt.scale_loss(loss / n).backward()
    success, _, num_zeros = opt.step()
    ref_loss = sum(token_loss_sum(ref(bx), by)[0] / (by != -100).sum() for bx, by in batches) / world
    ref_loss.backward()
    return {"success": bool(success), "num_zeros": num_zeros,
            "ref_zeros": int(sum((p.grad == 0).sum() for p in ref.parameters()))}
