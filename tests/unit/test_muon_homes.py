"""Home ranks for Muon matrices (megatron_opt.optimizer.whole_tensor.homes): hand-checkable placements."""
from __future__ import annotations

import random

import pytest

from megatron_opt.optimizer.whole_tensor.homes import (
    MatrixPlacement,
    assign_homes,
    newton_schulz_cost,
    placement_cost,
    rank_costs,
    traffic_elements,
)


def test_cost_formula_by_hand() -> None:
    # s=2, l=3: one step 2*2*(2*3+2) = 32; five steps 160; orientation does not matter.
    assert newton_schulz_cost((2, 3), steps=1) == 32.0
    assert newton_schulz_cost((3, 2)) == 160.0
    assert newton_schulz_cost((4, 4), steps=0) == 0.0
    # Split QKV: three (2, 6) problems, each 5 * 4 * 14 = 280.
    assert placement_cost(MatrixPlacement((6, 6), (36,), pieces=3)) == 3 * 280.0


def test_matrix_owned_by_one_rank_is_home_there_and_moves_nothing() -> None:
    placements = [MatrixPlacement((4, 5), (0, 0, 20, 0)), MatrixPlacement((3, 3), (9, 0, 0, 0))]
    homes = assign_homes(placements, dp_size=4)
    assert homes == [2, 0]
    assert traffic_elements(placements, homes) == 0


def test_straddling_matrix_home_is_an_owner_and_traffic_counts_the_rest_twice() -> None:
    # 4x6 = 24 elements: rank 1 owns 10, rank 2 owns 14. Home rank 2 (owns most, both idle):
    # rank 1 sends 10 elements there and gets 10 back.
    placement = MatrixPlacement((4, 6), (0, 10, 14))
    homes = assign_homes([placement], dp_size=3)
    assert homes == [2]
    assert traffic_elements([placement], homes) == 20
    assert traffic_elements([placement], [1]) == 28
    assert traffic_elements([placement], [0]) == 48  # a non-owner home would receive everything


def test_balance_on_many_equal_matrices() -> None:
    # 16 equal matrices every rank owns a share of: greedy puts 4 on each of 4 ranks.
    placements = [MatrixPlacement((8, 8), (16, 16, 16, 16)) for _ in range(16)]
    homes = assign_homes(placements, dp_size=4)
    assert sorted(homes.count(r) for r in range(4)) == [4, 4, 4, 4]
    costs = rank_costs(placements, homes, dp_size=4)
    assert max(costs) == min(costs)


def test_largest_first_balances_unequal_matrices() -> None:
    # One big matrix (16x16 costs 8x an 8x8) and eight small ones; every rank owns a share of each.
    big, small = (16, 16), (8, 8)
    placements = [MatrixPlacement(small, (32, 32)) for _ in range(8)] + [MatrixPlacement(big, (128, 128))]
    homes = assign_homes(placements, dp_size=2)
    assert newton_schulz_cost(big) == 8 * newton_schulz_cost(small)
    assert homes[-1] != homes[0]  # the big one alone on one rank, the eight small on the other
    assert len(set(homes[:8])) == 1
    costs = rank_costs(placements, homes, dp_size=2)
    assert costs[0] == costs[1]


def test_deterministic_and_independent_of_call_history() -> None:
    rng = random.Random(7)
    placements = []
    for _ in range(40):
        rows, cols = rng.randint(1, 9), rng.randint(1, 9)
        cuts = sorted(rng.randint(0, rows * cols) for _ in range(3))
        owned = (cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], rows * cols - cuts[2])
        placements.append(MatrixPlacement((rows, cols), owned))
    first = assign_homes(placements, dp_size=4)
    assign_homes(placements[::-1], dp_size=4)
    assert assign_homes(list(placements), dp_size=4) == first
    for placement, home in zip(placements, first):
        assert placement.owned[home] > 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MatrixPlacement((2, 3), (1, 2)), "sums to 3, not rows\\*cols = 6"),
        (lambda: MatrixPlacement((2,), (2,)), "shape must be two positive ints"),
        (lambda: MatrixPlacement((0, 3), ()), "shape must be two positive ints"),
        (lambda: MatrixPlacement((2, 3), ()), "owned is empty"),
        (lambda: MatrixPlacement((2, 3), (7, -1)), "non-negative"),
        (lambda: MatrixPlacement((2, 3), (6,), pieces=0), "pieces must be a positive int"),
        (lambda: assign_homes([MatrixPlacement((2, 3), (6,))], dp_size=2), "owned counts for 1 ranks, dp_size is 2"),
        (lambda: assign_homes([], dp_size=0), "dp_size must be >= 1"),
        (lambda: traffic_elements([MatrixPlacement((2, 3), (6,))], [1]), "home 1 of placement 0 is not a DP rank"),
        (lambda: traffic_elements([MatrixPlacement((2, 3), (6,))], []), "0 homes for 1 placements"),
        (lambda: newton_schulz_cost((3, 0)), "two positive sizes"),
    ],
)
def test_invalid_input_names_the_problem(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_matrices_without_a_choice_are_placed_before_the_big_ones() -> None:
    # Eight small matrices wholly on rank 0 (cost c each) and one big one (8c) both ranks own, rank 0 more.
    # Largest first would put the big one on rank 0 (both idle, rank 0 owns more) and then the eight
    # small ones on top of it (16c vs 0); fewest owners first gives 8c and 8c.
    small = [MatrixPlacement((8, 8), (64, 0)) for _ in range(8)]
    big = MatrixPlacement((16, 16), (200, 56))
    homes = assign_homes([big, *small], dp_size=2)
    assert homes == [1] + [0] * 8
    assert rank_costs([big, *small], homes, dp_size=2) == [8 * newton_schulz_cost((8, 8))] * 2


def test_a_move_off_the_busiest_rank_fixes_what_both_greedy_orders_miss() -> None:
    # a: 3x3 (cost 405) on ranks 1 (6) and 2 (3); b: 2x2 (cost 120) on ranks 0 (1) and 1 (3); c: 3x3 wholly on
    # rank 0. Both greedy orders give a -> 1 (owns more), c -> 0, then b -> 1 (tie at 405, owns more):
    # [405, 525, 0]. Moving a to rank 2 gives [405, 120, 405].
    a, b, c = MatrixPlacement((3, 3), (0, 6, 3)), MatrixPlacement((2, 2), (1, 3, 0)), MatrixPlacement((3, 3), (9, 0, 0))
    assert (newton_schulz_cost((3, 3)), newton_schulz_cost((2, 2))) == (405.0, 120.0)
    homes = assign_homes([a, b, c], dp_size=3)
    assert homes == [2, 1, 0]
    assert rank_costs([a, b, c], homes, dp_size=3) == [405.0, 120.0, 405.0]
