"""Parity with a single-process fp64 torch AdamW after 5 steps, DP 1-4, GA 1/4, three precisions,
overlap options on and off (overlap also uses several buckets). Params must be bitwise identical
on all ranks after the all-gather (checked inside the case)."""
import pytest

from tests.distributed import cases_parity

# fp32 follows the fp64 reference to float32 rounding; bf16/fp16 forward passes add rounding noise
# (reference/seeds.md section 0 tolerances, applied to the parameter *updates*, which is stricter).
TOL = {"fp32": dict(rel_l2=1e-4, cos=1e-8), "bf16": dict(rel_l2=2e-2, cos=1e-3), "fp16": dict(rel_l2=2e-2, cos=1e-3)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_parity_with_torch_adamw(pools, world, precision):
    pool = pools(world)
    for ga in (1, 4):
        for overlap in (False, True):
            results = pool.run(cases_parity.run_parity, precision, ga, overlap)
            for rank, res in enumerate(results):
                for name, (rl2, cos, _) in res["errors"].items():
                    where = f"world={world} ga={ga} overlap={overlap} rank={rank} param={name}"
                    assert rl2 <= TOL[precision]["rel_l2"], f"{where}: update rel L2 {rl2:.3g}"
                    assert cos <= TOL[precision]["cos"], f"{where}: update cosine diff {cos:.3g}"
                for ours, ref in res["norms"]:
                    assert ours == pytest.approx(ref, rel=1e-5 if precision == "fp32" else 3e-2), where


# Lion's update is lr * sign(c). In fp32 the error is the rounding of the fp32 master (AdamW's tolerance, and
# a few ulps of |w| <~ 1 per element, far below the 2*lr of one flipped sign); a sign flip between fp32 and
# fp64 needs |c| below float32 rounding of the gradient. In bf16 the forward noise can flip the sign of a
# near-zero c, which moves that element by 2*lr: one flip in keep_a is ~2.4e-2 of its update.
LION_TOL = {"fp32": dict(rel_l2=1e-4, max_abs=1e-6), "bf16": dict(rel_l2=5e-2, max_abs=None)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parity_lion_with_float64_reference(pools, world, precision):
    pool = pools(world)
    for overlap in (False, True):
        results = pool.run(cases_parity.run_parity, precision, 2, overlap, optimizer="lion", lr=1e-3)
        for rank, res in enumerate(results):
            for name, (rl2, _, max_abs) in res["errors"].items():
                where = f"lion world={world} overlap={overlap} rank={rank} param={name}"
                assert rl2 <= LION_TOL[precision]["rel_l2"], f"{where}: update rel L2 {rl2:.3g}"
                if LION_TOL[precision]["max_abs"] is not None:
                    assert max_abs <= LION_TOL[precision]["max_abs"], f"{where}: max abs error {max_abs:.3g}"
            for ours, ref in res["norms"]:
                assert ours == pytest.approx(ref, rel=1e-5 if precision == "fp32" else 3e-2), where
