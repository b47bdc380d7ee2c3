"""Loading a chained optimizer's scalar state saved with another split (e.g. EP2's dense and expert
children at EP1): param groups are matched by megatron-core's identity keys, and the update count
is carried over only when the saved parts agree on it."""
from __future__ import annotations

import pytest

from megatron_opt.optimizer.state.torch_dist import regrouped_scalar_state, scalar_state_from


class _Leaves:
    """Stands in for an optimizer: its param groups and the shape of its scalar_state()."""

    def __init__(self, groups: list[dict], leaves: int) -> None:
        self.param_groups, self.leaves = groups, leaves
        self.grad_scaler, self.skipped_steps = None, 0

    def scalar_state(self) -> dict:
        return {"param_groups": [], "steps": [0] * self.leaves}


def _group(wd_mult: float, is_expert: bool, lr: float) -> dict:
    return {"params": [], "wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": is_expert,
            "is_decoupled_lr": False, "lr": lr, "weight_decay": 0.1 * wd_mult}


def test_groups_are_matched_by_identity_and_unknown_ones_keep_their_values():
    optimizer = _Leaves([_group(1.0, False, lr=9.0), _group(0.0, True, lr=9.0), _group(0.5, False, lr=9.0)], 1)
    saved = {"param_groups": [_group(0.0, True, lr=2.0), _group(1.0, False, lr=1.0)], "steps": [7, 7]}
    out = regrouped_scalar_state(optimizer, saved)
    assert [g["lr"] for g in out["param_groups"]] == [1.0, 2.0, 9.0]
    assert all("params" not in g for g in out["param_groups"]) and out["steps"] == [7]


def test_one_update_count_goes_to_every_leaf_and_disagreeing_counts_are_refused():
    optimizer = _Leaves([_group(1.0, False, lr=1.0)], 2)
    assert regrouped_scalar_state(optimizer, {"param_groups": [], "steps": [5]})["steps"] == [5, 5]
    with pytest.raises(ValueError, match=r"disagree on the update count \(\[4, 5\]\).*layout that saved it"):
        regrouped_scalar_state(optimizer, {"param_groups": [], "steps": [4, 5]})
    common = {"optimizer": {"param_groups": [], "megatron_opt": {"param_groups": [], "steps": [4, 5]}}}
    with pytest.raises(ValueError, match=r"disagree on the update count"):
        scalar_state_from(_Leaves([], 1), common)
    assert scalar_state_from(_Leaves([], 2), common)["steps"] == [4, 5]  # the same split: each leaf its own
