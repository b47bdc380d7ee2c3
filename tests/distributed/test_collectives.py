"""collectives.py: one agreement helper (every rank raises together, with the failing rank's message
or the first differing item), its cheap per-step form, and the host reduce-scatter of CPU tensors."""
from __future__ import annotations

import pytest

from tests.distributed import cases_collectives as cc


def test_a_failure_on_some_ranks_raises_on_every_rank(pools):
    messages = pools(3).run(cc.agree_failure_on, [1, 2])
    text = "RankError: loading on rank 1 (and 1 more): KeyError: 'no such batch'. Retry."
    # the same error everywhere, chained to the rank's own failure where it had one
    assert messages == [f"{text} | cause=None", f"{text} | cause=KeyError", f"{text} | cause=KeyError"], messages


def test_differing_fingerprints_name_the_item_and_the_rank(pools):
    for message in pools(2).run(cc.agree_fingerprints, 1):
        assert message.startswith("ValueError: Builder: the ranks disagree: lr is 0.1 on rank 0 but 0.5 on rank 1. "
                                  "Build the same thing everywhere."), message


def test_agree_returns_every_ranks_payload(pools):
    for payloads in pools(2).run(cc.agree_payloads):
        assert payloads == [{"rank": 0}, {"rank": 1}]


def test_raise_together_returns_the_result_or_raises_everywhere(pools):
    assert pools(2).run(cc.raise_together_result, -1) == ["7", "7"]
    for message in pools(2).run(cc.raise_together_result, 1):
        assert message.startswith("RuntimeError: saving failed on rank 1: OSError: disk full"), message


@pytest.mark.parametrize("fail_on, names_differ", [(-1, False), (1, False), (-1, True)])
def test_agree_each_step_is_one_small_all_reduce_unless_something_is_wrong(pools, fail_on, names_differ):
    for res in pools(2).run(cc.agree_each_step_traffic, fail_on, names_differ):
        assert res["reduced"] == [5], res  # [failed, n, -n, crc, -crc]
        if fail_on < 0 and not names_differ:
            assert res["error"] == "" and res["gathered"] == 0, res
            continue
        assert res["gathered"] == 1, res
        if names_differ:
            assert "the ranks disagree: aux loss names is ['aux'] on rank 0 but ['aux', 'z'] on rank 1" in res["error"]
        else:
            assert res["error"].startswith("RankError: train_step failed on rank 1: ValueError: bad batch"), res


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_reductions_on_gloo_sum_in_rank_order(pools, world, dtype):
    for res in pools(world).run(cc.host_reduce_scatter, dtype):
        # (3 buckets + one synchronous call) x (in place, not), each bitwise the rank-order sum with
        # the rest of the bucket untouched, then 3 all-reduces, then an abandoned one that never writes
        # while 2 later ones reuse its slot; no gloo reduce-scatter or all-reduce; two slots reused
        assert res == {"ok": [True] * 14, "native_calls": 0, "slots_allocated": 2}, res


def test_agree_each_step_reaches_ranks_through_later_groups(pools):
    messages = pools(4).run(cc.agree_each_step_over_two_groups, 3)
    peer = "RankError: the update failed on a rank of another process group (a model-parallel peer) | cause=None"
    own = "RankError: the update failed on rank 1 (global rank 3): RuntimeError: kernel failed | cause="
    assert messages == [peer, peer, own + "None", own + "RuntimeError"], messages
