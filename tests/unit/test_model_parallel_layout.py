"""Model-parallel worlds as pure math (tests/support/parallel_layout.py, stats_role.element_counts).

For random (TP, PP, VPP, DP, CP, instances, EP, expert-TP) that fit in 8 ranks: megatron-core's rank
order, every element of every param owned by exactly one rank of each (expert) DP instance under the
real bucket layout, and every logical element counted exactly once in the world's gradient statistics
(issue 20, item 3). The counting rule is then broken on purpose three ways, and the same check must
catch each.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.parallel_layout import (
    ModelDims,
    OwnedElements,
    ParallelSizes,
    chunk_params,
    logical_numels,
    owned_elements,
    rank_coordinates,
    world_counts,
)
from megatron_opt.distributed.stats_role import (StatsRole, chain_stats_groups, element_counts, param_counts_in_norm,
                                                 shard_counts, stats_span_model_parallel, step_stats_groups)

WORLD = 8


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _all_layouts(max_world: int = WORLD) -> tuple[tuple[ParallelSizes, bool], ...]:
    """Every (sizes, distributed optimizer) megatron-core accepts in at most ``max_world`` ranks."""
    out = []
    for world in range(1, max_world + 1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                for cp in _divisors(world // (tp * pp)):
                    dp = world // (tp * pp * cp)
                    for vpp in ((1, 2) if pp > 1 else (1,)):
                        for etp in _divisors(world // pp):
                            for ep in _divisors(world // (pp * etp)):
                                expert_dp = world // (etp * ep * pp)
                                for k in _divisors(dp * cp):
                                    for dist_opt in ((True, False) if k == 1 else (True,)):
                                        if expert_dp % k == 0:
                                            out.append((ParallelSizes(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, expert_tp=etp,
                                                                      vpp=vpp, instances=k), dist_opt))
    return tuple(out)


LAYOUTS = _all_layouts()


@st.composite
def worlds(draw) -> tuple[ParallelSizes, ModelDims, Optional[int], bool]:
    sizes, distributed_optimizer = draw(st.sampled_from(LAYOUTS))
    dims = ModelDims(hidden=draw(st.integers(1, 70)), column=draw(st.integers(1, 150)),
                     vocab=draw(st.integers(1, 150)), expert=draw(st.integers(1, 100)),
                     experts_per_rank=draw(st.sampled_from([2, 1, 0])))
    bucket_size = draw(st.sampled_from([None, 1, 100, 300]))
    return sizes, dims, bucket_size, distributed_optimizer


def _ownership_errors(sizes: ParallelSizes, dims: ModelDims, owned: list[OwnedElements],
                      distributed_optimizer: bool = True) -> list[str]:
    """Each instance of each (chunk, dense or expert) gradient group owns each element of each of its
    params exactly once (sharded), or every rank of it holds them all (all-reduced), and the group's
    ranks hold the same params."""
    coords = rank_coordinates(sizes)
    errors = []
    by_group: dict[tuple, dict[str, list[int]]] = {}
    runs = defaultdict(list)
    for o in owned:
        c = coords[o.rank]
        group = c.expert_dp_ranks if o.expert else c.dp_cp_ranks
        runs[(o.chunk, o.expert, group, o.instance)].append(o)
    for c in coords:
        for chunk in range(sizes.vpp):
            params = chunk_params(sizes, dims, c, chunk)
            for expert in (False, True):
                members = [p for p in params if p.expert == expert]
                if not members:
                    continue
                group = c.expert_dp_ranks if expert else c.dp_cp_ranks
                signature = [(p.key, p.numel, p.logical_offset, p.shared) for p in members]
                for r in group:  # every rank of the group holds the same params
                    theirs = [p for p in chunk_params(sizes, dims, coords[r], chunk) if p.expert == expert]
                    if [(p.key, p.numel, p.logical_offset, p.shared) for p in theirs] != signature:
                        errors.append(f"rank {r} differs from rank {c.rank} in group {group}")
                instances = {o.instance for k, v in runs.items() if k[:3] == (chunk, expert, group) for o in v}
                for inst in instances | {0}:
                    key = (chunk, expert, group, inst)
                    if key in by_group:
                        continue
                    seen = {p.key: [0] * p.numel for p in members}
                    for o in runs[key]:
                        p = next(m for m in members if m.key == o.key)
                        for i in range(o.logical_start - p.logical_offset, o.logical_end - p.logical_offset):
                            seen[o.key][i] += 1
                    by_group[key] = seen
                    per_instance = len(group) // sizes.instances
                    expected = 1 if distributed_optimizer and per_instance > 1 else per_instance
                    bad = {k: v for k, v in seen.items() if any(x != expected for x in v)}
                    if bad:
                        errors.append(f"group {group} chunk {chunk} expert {expert} instance {inst}: "
                                      f"{ {k: sorted(set(v)) for k, v in bad.items()} }")
    return errors


def _count_errors(sizes: ParallelSizes, dims: ModelDims, owned: list[OwnedElements]) -> list[str]:
    counts = world_counts(sizes, dims, owned)
    errors = [f"{k}: counted {sorted(set(v))} times" for k, v in counts.items() if any(x != 1 for x in v)]
    total = sum(o.logical_end - o.logical_start for o in owned if o.counts)
    if total != sum(logical_numels(sizes, dims).values()):
        errors.append(f"{total} elements counted, the model has {sum(logical_numels(sizes, dims).values())}")
    return errors


# ------------------------------------------------------------------------------------------------ the property
@settings(max_examples=150, deadline=None, derandomize=True)
@given(worlds())
def test_every_element_owned_once_per_instance_and_counted_once_in_the_world(world):
    sizes, dims, bucket_size, distributed_optimizer = world
    owned = owned_elements(sizes, dims, bucket_size=bucket_size, distributed_optimizer=distributed_optimizer)
    assert _ownership_errors(sizes, dims, owned, distributed_optimizer) == []
    assert _count_errors(sizes, dims, owned) == []


# ------------------------------------------------------------------------------------------------ broken on purpose
def _count_tp_duplicates(**kw) -> bool:
    kw.update(tensor_parallel_rank=0, expert_tensor_parallel_rank=0)
    return element_counts(**kw)


def _expert_by_dense_tp_rank(**kw) -> bool:  # megatron-core 0.16.1 (Megatron-LM #5916, #6470)
    kw["expert_tensor_parallel_rank"] = kw["tensor_parallel_rank"]
    return element_counts(**kw)


def _count_tied_copy(**kw) -> bool:
    kw["shared"] = False
    return element_counts(**kw)


def _count_every_instance(**kw) -> bool:
    kw["instance_rank"] = 0
    return element_counts(**kw)


MOE = ModelDims(hidden=5, column=9, vocab=11, expert=6, experts_per_rank=2)


@pytest.mark.parametrize("rule, sizes", [
    (_count_tp_duplicates, ParallelSizes(tp=2, dp=2)),
    (_expert_by_dense_tp_rank, ParallelSizes(tp=2, dp=2, ep=2, expert_tp=1)),
    (_expert_by_dense_tp_rank, ParallelSizes(tp=1, dp=4, ep=2, expert_tp=2)),
    (_count_tied_copy, ParallelSizes(pp=2, dp=2)),
    (_count_tied_copy, ParallelSizes(pp=2, vpp=2, tp=2, dp=2)),
    (_count_every_instance, ParallelSizes(dp=4, instances=2)),
], ids=["tp-duplicates", "expert-dense-tp-undercount", "expert-dense-tp-overcount", "tied-copy", "tied-copy-vpp",
        "every-instance"])
def test_the_check_catches_a_broken_rule(rule, sizes):
    owned = owned_elements(sizes, MOE, bucket_size=100, rule=rule)
    assert _count_errors(sizes, MOE, owned)
    assert _count_errors(sizes, MOE, owned_elements(sizes, MOE, bucket_size=100)) == []


@settings(max_examples=150, deadline=None, derandomize=True)
@given(worlds())
def test_a_broken_rule_is_caught_wherever_it_matters(world):
    """Each broken rule is caught in every drawn world where it changes some count."""
    sizes, dims, bucket_size, distributed_optimizer = world
    good = owned_elements(sizes, dims, bucket_size=bucket_size, distributed_optimizer=distributed_optimizer)
    for rule in (_count_tp_duplicates, _expert_by_dense_tp_rank, _count_tied_copy):
        bad = owned_elements(sizes, dims, bucket_size=bucket_size, distributed_optimizer=distributed_optimizer,
                             rule=rule)
        if [o.counts for o in bad] != [o.counts for o in good]:
            assert _count_errors(sizes, dims, bad), rule.__name__


# ------------------------------------------------------------------------------------------------ rank order
def test_coordinates_by_hand():
    # TP2 x DP2 x PP2, EP2 with expert TP 1: expert DP = 8 / (1 * 2 * 2) = 2.
    coords = rank_coordinates(ParallelSizes(tp=2, pp=2, dp=2, ep=2, expert_tp=1))
    assert [(c.tp, c.dp, c.pp) for c in coords[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert coords[5].pp == 1 and coords[5].dp_cp_ranks == (5, 7)
    assert [(c.etp, c.ep, c.edp) for c in coords[:4]] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert coords[0].expert_dp_ranks == (0, 2)


# ------------------------------------------------------------------------------------------------ the rule itself
def test_counts_in_norm_keeps_its_tp1_behaviour():
    """optimizer/state/shard_store.py's call shape: unchanged for every attribute combination at TP rank 0 and 1."""
    for shared in (None, False, True):
        for tmp in (None, False, True):
            for allreduce in (None, True, False):
                p = torch.nn.Parameter(torch.zeros(2))
                for name, value in (("shared", shared), ("tensor_model_parallel", tmp), ("allreduce", allreduce)):
                    if value is not None:
                        setattr(p, name, value)
                for tp_rank in (0, 1):
                    old = (not getattr(p, "shared", False)) and (bool(getattr(p, "tensor_model_parallel", False))
                                                               or tp_rank == 0)
                    assert StatsRole((), True).counts_in_norm(p, tp_rank) == old
                    assert StatsRole((), True, tensor_parallel_rank=tp_rank).counts_in_norm(p) == old


def test_expert_params_dedup_by_expert_tp_rank():
    kw = dict(shared=False, tensor_model_parallel=False, expert_parallel=True)
    assert param_counts_in_norm(**kw, tensor_parallel_rank=1, expert_tensor_parallel_rank=0)
    assert not param_counts_in_norm(**kw, tensor_parallel_rank=0, expert_tensor_parallel_rank=1)
    dense = dict(kw, expert_parallel=False)
    assert not param_counts_in_norm(**dense, tensor_parallel_rank=1, expert_tensor_parallel_rank=0)
    p = torch.nn.Parameter(torch.zeros(2))
    p.allreduce = False
    assert StatsRole((), True, tensor_parallel_rank=1, expert_tensor_parallel_rank=0).counts_in_norm(p)
    assert not StatsRole((), True, tensor_parallel_rank=0, expert_tensor_parallel_rank=1).counts_in_norm(p)


def test_shard_counts():
    assert shard_counts(sharded=True, group_rank=3, instance_rank=0)
    assert not shard_counts(sharded=True, group_rank=0, instance_rank=1)
    assert shard_counts(sharded=False, group_rank=0, instance_rank=0)
    assert not shard_counts(sharded=False, group_rank=1, instance_rank=0)


def test_the_stats_groups_have_one_owner():
    """stats_role decides which groups a step sums over, the older model_parallel_group and
    grad_stats_group keywords included (the groups are only passed through: stand-ins do)."""
    dp, mp, chain = object(), object(), object()
    plain, spanning = StatsRole((dp,), True), StatsRole((None,), True, spans_model_parallel=True)
    assert step_stats_groups([StatsRole((), False), plain]) == [dp]  # the first role that has groups
    assert step_stats_groups([plain], mp) == [dp, mp]
    assert step_stats_groups([spanning], mp) == [None]  # the chunks' groups already reach every rank
    assert step_stats_groups([StatsRole((), True)], mp) == [mp]  # one data-parallel rank
    assert step_stats_groups([StatsRole((), True)]) == []
    assert chain_stats_groups() == [None] and chain_stats_groups(chain) == [chain]
    assert stats_span_model_parallel([plain], mp) and stats_span_model_parallel([spanning])
    assert not stats_span_model_parallel([plain])


def test_every_layout_in_8_ranks_counts_each_element_once():
    """Exhaustive over the 1021 layouts (fixed MoE dims), beside the random dims above."""
    for sizes, distributed_optimizer in LAYOUTS:
        owned = owned_elements(sizes, MOE, bucket_size=100, distributed_optimizer=distributed_optimizer)
        assert _count_errors(sizes, MOE, owned) == [], sizes
