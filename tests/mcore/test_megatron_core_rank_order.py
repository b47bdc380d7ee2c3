"""megatron-core's rank order against tests/support/parallel_layout.py's model of it."""
from __future__ import annotations

from megatron.core import parallel_state as ps

from tests.support.parallel_layout import ParallelSizes, orthogonal_rank_groups, rank_coordinates


def test_rank_order_matches_megatron_core():
    for sizes, mask in [([2, 1, 1, 2, 2], [False, True, False, True, False]), ([2, 2, 1, 2, 1], [True] * 5),
                        ([1, 2, 2, 2, 1], [False, False, True, False, True]),
                        ([2, 3, 1, 1, 2], [True, False] * 2 + [True])]:
        world = 1
        for s in sizes:
            world *= s
        assert orthogonal_rank_groups(sizes, mask) == ps.generate_masked_orthogonal_rank_groups(world, sizes, mask)
    sizes = ParallelSizes(tp=2, pp=2, dp=2, ep=2, expert_tp=1)
    dense = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    expert = ps.RankGenerator(tp=1, ep=2, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    coords = rank_coordinates(sizes)
    for token, field in [("tp", "tp"), ("dp", "dp"), ("pp", "pp")]:
        for g in dense.get_ranks(token):
            others = [f for f in ("tp", "dp", "pp") if f != field]
            assert [getattr(coords[r], field) for r in g] == list(range(len(g)))
            assert len({tuple(getattr(coords[r], f) for f in others) for r in g}) == 1
    for g in expert.get_ranks("dp"):
        assert all(coords[r].expert_dp_ranks == tuple(g) for r in g)
    for g in expert.get_ranks("ep"):
        assert [coords[r].ep for r in g] == list(range(len(g)))
    for g in dense.get_ranks("dp-cp"):
        assert all(coords[r].dp_cp_ranks == tuple(g) for r in g)
