"""ChainedOptimizer: dense + expert-parallel children with one norm, one decision, one scaler."""
import pytest

from tests.distributed import cases_chained as cch
from tests.distributed import cases_parity


def test_chained_optimizer_one_global_norm(pools):
    for res in pools(2).run(cch.chained_expert_step, False):
        assert res["kind"] == "ChainedOptimizer" and res["children"] == 2 and res["one_scaler"]
        assert res["success"]
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5), "expert grads missing from the norm?"


def test_chained_optimizer_one_skip_decision(pools):
    """An inf in one rank's expert grads must skip the dense child too, on every rank."""
    for res in pools(2).run(cch.chained_expert_step, True):
        assert res["success"] is False and res["norm"] is None
        assert res["all_unchanged"] and res["dense_unchanged"]


def test_shared_param_not_counted_in_norm(pools):
    for res in pools(2).run(cch.shared_param_excluded_from_norm):
        assert res["norm"] == pytest.approx(res["ref"], rel=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_non_sharded_mode_matches_reference(pools, world):
    """use_distributed_optimizer=False: all-reduce and every rank updates the whole buffer."""
    for ga in (1, 4):
        for res in pools(world).run(cases_parity.run_parity, "fp32", ga, False, distributed=False):
            for name, (rl2, _, _) in res["errors"].items():
                assert rl2 <= 1e-4, f"ga={ga} {name}: {rl2}"
