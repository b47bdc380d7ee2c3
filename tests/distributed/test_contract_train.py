"""train_step contract tests: CONTRACT rules 10-15 (reference/seeds.md T1.1-T1.4, T3.1-T3.3).

The probe model has closed-form gradients: a micro-batch with constant c and n tokens contributes
n*c*w.sum() to the token-loss sum, so every element of the normalised gradient is sum(n_i c_i) / N.
With SGD (lr 1, no momentum, no weight decay, no clipping) the update is exactly -grad, so the
normalisation is read off the parameters. Worker-side code is in cases_train.py.
"""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from tests.distributed import cases_train

RTOL = 1e-6

# seeds T1.1: W=2, GA=2, rank0 c=[1,2] tokens [3,5], rank1 c=[3,4] tokens [7,9] -> 70/24
T11 = [[(1, 3), (2, 5)], [(3, 7), (4, 9)]]
# a second step with different counts (torchtune #1917 review: [5,20] then [10,3])
T11_NEXT = [[(2, 5), (1, 20)], [(1, 10), (3, 3)]]


# ----------------------------------------------------------------------------- helpers
def token_mean(step: list, key=lambda e: e[0]) -> float:
    """sum(n_i * key_i) / max(N, 1) over every micro-batch of every rank."""
    entries = [e for rank in step for e in rank]
    total = sum(e[1] for e in entries)
    return sum(e[1] * key(e) for e in entries) / max(total, 1)


def applied_grad(step_result: dict) -> np.ndarray:
    """delta w = -grad for SGD lr 1: the gradient the optimizer applied, per element (float64)."""
    return np.asarray(step_result["w_before"], dtype=np.float64) - np.asarray(step_result["w_after"], dtype=np.float64)


def assert_update(results: list, step: int, expected: float, what: str, rtol: float = RTOL) -> None:
    for rank, res in enumerate(results):
        s = res["steps"][step]
        g = applied_grad(s)
        assert s["finite"], f"{what}: rank {rank} step {step}: non-finite params {s['w_after']}"
        np.testing.assert_allclose(g, np.full_like(g, expected), rtol=rtol, atol=0.0,
                                   err_msg=f"{what}: rank {rank} step {step}: applied gradient != {expected!r}")


def assert_same_on_all_ranks(results: list, step: int, key: str) -> None:
    values = [res["steps"][step][key] for res in results]
    assert all(v == values[0] for v in values), f"step {step}: {key} differs across ranks: {values}"


def probe(pool, steps, **scenario) -> list:
    results = pool.run(cases_train.run_probe, {"steps": steps, **scenario})
    for rank, res in enumerate(results):
        assert res["error"] is None, f"rank {rank}: {res['error']}"
        for s in res["steps"]:  # every rank owns a piece of w, so a per-shard factor would show
            assert 0 < s["owned_w"] < cases_train.PROBE_NUMEL or len(results) == 1, f"rank {rank} owns {s['owned_w']}"
    return results


# ----------------------------------------------------------------------------- rule 10
def test_contract_10_global_token_count_probe(pools):
    """T1.1: the gradient is sum(n c)/N_global (70/24); catches mean of means (2.5), local counts
    after the DP average (4.375 / 2.1875), no division (17.5) and the mean of per-rank means (2.59375)."""
    results = probe(pools(2), [T11, T11_NEXT])
    assert_update(results, 0, 70 / 24, "T1.1 W=2 GA=2")
    assert_update(results, 1, 49 / 38, "T1.1 second step (rule 14)")
    assert [s["num_tokens"] for s in results[0]["steps"]] == [24, 38]


def test_contract_10_global_token_count_probe_w3(pools):
    """T1.1 at W=3 (the shards cut w into 128/128/44): the global-count value on every rank and every
    shard; a per-shard (owner's local count) factor would differ between shard owners."""
    steps = [
        [[(1, 3), (2, 5)], [(3, 7), (4, 9)], [(-1, 2), (5, 4)]],
        [[(0.5, 11), (2, 1)], [(1, 6), (3, 2)], [(4, 8), (-2, 13)]],
    ]
    results = probe(pools(3), steps)
    for i, step in enumerate(steps):
        assert_update(results, i, token_mean(step), f"T1.1 W=3 step {i}")
        assert results[0]["steps"][i]["num_tokens"] == sum(e[1] for r in step for e in r)


def test_contract_10_ragged_ranks_distributed_trap(pools):
    """T3.2: W=2, GA=1, rank0 3 tokens c=1, rank1 7 tokens c=3 -> 2.4; the naive 'skip the scaling
    at GA=1' (local-count loss, W/N grad) gives 2.0."""
    results = probe(pools(2), [[[(1, 3)], [(3, 7)]]])
    assert_update(results, 0, 2.4, "T3.2")


def test_contract_10_zero_token_rank_is_safe(pools):
    """T1.3: a rank whose micro-batches have no supervised token gives no NaN and the other rank's
    token mean (13/8; a local clamp to 1 gives 13/9, a local division NaN); an all-zero step gives a
    finite zero update (only the global N is clamped)."""
    pool = pools(2)
    one_empty = [[(1, 3), (2, 5)], [(3, 0), (4, 0)]]
    results = probe(pool, [one_empty])
    assert_update(results, 0, 13 / 8, "T1.3 one rank without tokens")
    assert results[0]["steps"][0]["num_tokens"] == 8

    all_empty = [[(1, 0), (2, 0)], [(3, 0), (4, 0)]]
    results = probe(pool, [all_empty])
    for rank, res in enumerate(results):
        s = res["steps"][0]
        assert s["success"], f"rank {rank}: the all-zero-token step was skipped ({s['skip_reason']})"
        assert s["finite"] and s["unchanged_bitwise"], f"rank {rank}: zero-token step moved w: {s['w_after']}"
        assert s["loss"] == 0.0 and not math.isnan(s["loss"]), f"rank {rank}: loss {s['loss']}"
        assert s["grad_norm"] == 0.0, f"rank {rank}: grad norm {s['grad_norm']}"
        assert s["num_tokens"] == 0


def test_contract_10_count_scope_is_the_dp_group(pools):
    """T1.4: W=4 as 2 DP groups ([0,2], [1,3]) x 2 replicas with identical data: N counts the DP
    group's tokens only; counting over the replicas too halves the update (35/24 instead of 70/24)."""
    a, b = [(1, 3), (2, 5)], [(3, 7), (4, 9)]
    results = probe(pools(4), [[a, a, b, b]], dp_groups=[[0, 2], [1, 3]])
    assert_update(results, 0, 70 / 24, "T1.4 DP-group count")
    assert [r["steps"][0]["num_tokens"] for r in results] == [24] * 4


def test_contract_10_one_count_all_reduce_per_step(pools):
    """T3.3 spy: train_step issues exactly one all-reduce per step (N and the loss sums packed);
    catches a separate collective per micro-batch, per aux term or for the loss."""
    res = _prescale_vs_postscale(pools)
    for rank, r in enumerate(res):
        for step in range(len(r["steps"])):
            calls = [c for c in r["calls"] if c["step"] == step]
            # Besides the one that carries N and the loss sums, train_step may issue at most one
            # agreement (did any rank fail, do the aux names agree) before the last backward; its
            # length is the agreement's business, not the contract's.
            agreement = [c for c in calls if c["phase"] == "agreement"]
            assert len(agreement) <= 1, agreement
            counts = [c for c in calls if c["phase"] == "train_step"]
            assert len(counts) == 1, f"rank {rank} step {step}: all-reduces outside the optimizer: {calls}"


@pytest.mark.parametrize("world,ga,mbs", [(1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 1, 4)])
def test_contract_10_partition_invariance_tinylm(pools, world, ga, mbs):
    """T1.2: TinyLM fp32 + AdamW + clip 1.0, 8 ragged sequences (one fully masked) per step: after
    3 steps every split (W, GA, micro-batch size) equals the fp64 sum(CE)/N reference; catches any
    split-dependent normalisation (mean of means, local N, leftover 1/GA or 1/DP)."""
    results = pools(world).run(cases_train.run_partition, ga, mbs)
    where = f"W={world} GA={ga} mbs={mbs}"
    for rank, res in enumerate(results):
        bad = {n: v for n, v in res["params"].items() if not v["allclose"]}
        assert not bad, f"{where} rank {rank}: params differ from the fp64 reference (rtol 1e-5, atol 1e-7): {bad}"
        for step, (ours, ref) in enumerate(zip(res["losses"], res["ref_losses"])):
            assert ours == pytest.approx(ref, rel=1e-6), f"{where} rank {rank} step {step}: loss {ours} vs {ref}"
        for step, (ours, ref) in enumerate(zip(res["norms"], res["ref_norms"])):
            assert ours == pytest.approx(ref, rel=1e-5), f"{where} rank {rank} step {step}: grad norm {ours} vs {ref}"
    for key in ("losses", "norms", "num_tokens"):
        values = [r[key] for r in results]
        assert all(v == values[0] for v in values), f"{where}: {key} differs across ranks: {values}"


# ----------------------------------------------------------------------------- rule 11
def test_contract_11_normalisation_applied_once(pools):
    """per_token: grad_scale_factor is exactly fp32(1/N) (a leftover 1/DP or 1/GA would show) and the
    update is 70/24; mean mode gives the plain mean of c over micro-batches and ranks (2.5); per_token
    with average_in_collective=True is rejected (it would divide by DP a second time)."""
    pool = pools(2)
    results = probe(pool, [T11, T11_NEXT])
    for i, n in enumerate((24, 38)):
        for rank, res in enumerate(results):
            s = res["steps"][i]
            assert s["grad_scale_factor_dtype"] == "torch.float32"
            expected = float(np.float32(1.0 / n))
            assert s["grad_scale_factor"] == expected, (
                f"rank {rank} step {i}: grad_scale_factor {s['grad_scale_factor']!r}, "
                f"expected fp32(1/{n}) = {expected!r}")
    assert_update(results, 0, 70 / 24, "rule 11 per_token")

    results = probe(pool, [T11, T11_NEXT], mode="mean")
    assert_update(results, 0, 2.5, "rule 11 mean mode")
    assert_update(results, 1, (2 + 1 + 1 + 3) / 4, "rule 11 mean mode, second step")
    for rank, res in enumerate(results):
        s = res["steps"][0]
        assert s["grad_scale_factor"] == 0.25, f"rank {rank}: mean-mode grad_scale_factor {s['grad_scale_factor']}"
        wsum = float(np.sum(np.asarray(s["w_before"], dtype=np.float32), dtype=np.float64))
        assert s["loss"] == pytest.approx(2.5 * wsum, rel=RTOL), f"rank {rank}: mean-mode loss {s['loss']}"

    results = pool.run(cases_train.run_probe, {"steps": [T11], "average_in_collective": True})
    for rank, res in enumerate(results):
        assert res["error"] is not None and res["error"].startswith("ValueError"), (
            f"rank {rank}: per_token loss with average_in_collective=True was accepted: {res}")
        assert not res["steps"], f"rank {rank}: a step ran before the config was rejected"


# ----------------------------------------------------------------------------- rule 12
def _op_violations(rec: dict, ga: int, num_params: int, num_buffers: int) -> list:
    """Everything in one recorded train_step that is not: zero_ per buffer, one add_ per param per
    micro-batch (both outside optimizer.step), and reads by optimizer.step only."""
    problems = []
    writes = collections.Counter(name for _, name in rec["writes"])
    expected = collections.Counter({"zero_": num_buffers, "add_": num_params * ga})
    if writes != expected:
        problems.append(f"grad-buffer writes {dict(writes)} != {dict(expected)}")
    in_step = [name for phase, name in rec["writes"] if phase == "optimizer.step"]
    if in_step:
        problems.append(f"optimizer.step() writes the grad buffers: {in_step}")
    outside = [name for phase, name in rec["reads"] if phase != "optimizer.step"]
    if outside:
        problems.append(f"grad-buffer reads outside optimizer.step(): {outside}")
    return problems


def _step_reads(rec: dict) -> collections.Counter:
    return collections.Counter(name for phase, name in rec["reads"] if phase == "optimizer.step")


def test_contract_12_no_extra_pass_over_grads(pools):
    """T3.1: under a TorchDispatchMode, the only grad-buffer writes are zero_ and the backward add_
    (one per param per micro-batch), and optimizer.step() reads the buffers the same number of
    times at GA=1 and GA=4; a normalisation pass (mul_/div_/_foreach_mul_) would show up."""
    for world in (1, 2):
        pool = pools(world)
        step_reads = {}
        for ga in (1, 4):
            results = pool.run(cases_train.run_op_count, ga)
            for rank, res in enumerate(results):
                for i, rec in enumerate(res["per_step"]):
                    problems = _op_violations(rec, ga, res["num_params"], res["num_buffers"])
                    assert not problems, f"W={world} GA={ga} rank {rank} step {i}: {problems}"
                    assert _step_reads(rec), "the recorder saw no optimizer read of the grads: it is blind"
                    step_reads.setdefault(rank, {}).setdefault(ga, _step_reads(rec))
                    assert _step_reads(rec) == step_reads[rank][ga]
        for rank, by_ga in step_reads.items():
            assert by_ga[1] == by_ga[4], \
                f"W={world} rank {rank}: optimizer grad reads GA=1 {by_ga[1]} vs GA=4 {by_ga[4]}"


def test_contract_12_detector_flags_an_extra_pass(pools):
    """Self-check of the T3.1 detector: with set_grad_scale_factor patched to also run
    grad_data.mul_ (the forbidden normalisation pass), the recorder reports it."""
    results = pools(2).run(cases_train.run_op_count, 1, steps=1, inject_extra_pass=True)
    for rank, res in enumerate(results):
        rec = res["per_step"][0]
        assert "mul_" in [name for _, name in rec["writes"]], f"rank {rank}: the injected mul_ was not seen: {rec}"
        assert _op_violations(rec, 1, res["num_params"], res["num_buffers"]), f"rank {rank}: not flagged"


_T33_CACHE: dict = {}


def _prescale_vs_postscale(pools) -> list:
    pool = pools(2)
    if id(pool) not in _T33_CACHE:
        _T33_CACHE.clear()
        _T33_CACHE[id(pool)] = pool.run(cases_train.run_prescale_vs_postscale, 4)
    return _T33_CACHE[id(pool)]


def test_contract_12_prescale_free_matches_post_scaled_reference(pools):
    """T3.3: W=2, GA=4, ragged TinyLM: train_step's per_token path (raw-sum backward, 1/N in the
    unscale scalar) equals raw-sum backward followed by .grad / N_global (SGD lr 1): max rel diff of
    the params <= 1e-6 (and of the updates <= 1e-5); any other factor moves the update by >= 14%."""
    res = _prescale_vs_postscale(pools)
    for rank, r in enumerate(res):
        for step, s in enumerate(r["steps"]):
            assert s["num_tokens"] == s["N"], f"rank {rank} step {step}: N {s['num_tokens']} vs {s['N']}"
            for name, d in s["diffs"].items():
                where = f"rank {rank} step {step} param {name}"
                assert d["param_rel"] <= 1e-6, f"{where}: params max rel diff {d['param_rel']:.3g}"
                assert d["update_rel"] <= 1e-5, f"{where}: update max rel diff {d['update_rel']:.3g}"


# ----------------------------------------------------------------------------- rule 13
def test_contract_13_aux_losses_same_denominator(pools):
    """T1.5: an aux term returned as a token sum is divided by the same global N as the main loss:
    update = sum n(c+a)/N and aux_losses['aux'] = sum(n a) w.sum()/N on every rank; in mean mode it
    shares GA*DP. Catches aux divided by local counts, by N twice, or left unnormalised."""
    pool = pools(2)
    steps = [
        [[(1, 3, 0.5), (2, 5, -1.0)], [(3, 7, 2.0), (4, 9, 0.25)]],
        [[(2, 5, 1.5), (1, 20, 0.0)], [(1, 10, -0.5), (3, 3, 3.0)]],
    ]
    for mode in ("per_token", "mean"):
        results = probe(pool, steps, aux=True, mode=mode)
        for i, step in enumerate(steps):
            if mode == "per_token":
                update = token_mean(step, key=lambda e: e[0] + e[2])
                aux_coef = token_mean(step, key=lambda e: e[2])
            else:
                entries = [e for r in step for e in r]
                update = sum(e[0] + e[2] for e in entries) / len(entries)
                aux_coef = sum(e[2] for e in entries) / len(entries)
            assert_update(results, i, update, f"rule 13 {mode} step {i}")
            for rank, res in enumerate(results):
                s = res["steps"][i]
                wsum = float(np.sum(np.asarray(s["w_before"], dtype=np.float32), dtype=np.float64))
                assert set(s["aux_losses"]) == {"aux"}
                assert s["aux_losses"]["aux"] == pytest.approx(aux_coef * wsum, rel=RTOL), (
                    f"{mode} rank {rank} step {i}: aux loss {s['aux_losses']['aux']} vs {aux_coef * wsum}")
            assert_same_on_all_ranks(results, i, "aux_losses")


# ----------------------------------------------------------------------------- rule 14
def test_contract_14_counters_reset_every_step(pools):
    """Token counts, loss sums and aux sums start from zero every step: repeating T1.1 after other
    steps gives 70/24 again and num_tokens 24; a counter carried over (or an in-place all-reduce result
    reused as the next partial sum) changes N, the loss and the update."""
    steps = [[[(c, n, 0.5) for c, n in r] for r in s] for s in (T11, T11_NEXT, T11)]
    results = probe(pools(2), steps, aux=True)
    for i, step in enumerate(steps):
        assert_update(results, i, token_mean(step, key=lambda e: e[0] + e[2]), f"rule 14 step {i}")
        n = sum(e[1] for r in step for e in r)
        for rank, res in enumerate(results):
            s = res["steps"][i]
            assert s["num_tokens"] == n, f"rank {rank} step {i}: num_tokens {s['num_tokens']} != {n}"
            wsum = float(np.sum(np.asarray(s["w_before"], dtype=np.float32), dtype=np.float64))
            assert s["loss"] == pytest.approx(token_mean(step) * wsum, rel=RTOL), f"rank {rank} step {i}: loss"
            assert s["aux_losses"]["aux"] == pytest.approx(0.5 * wsum, rel=RTOL), f"rank {rank} step {i}: aux"


# ----------------------------------------------------------------------------- rule 15
def test_contract_15_reported_loss_and_grad_norm(pools):
    """result.loss = sum of token losses / N and result.grad_norm = sqrt(numel) * 70/24 (the global,
    unscaled, pre-clip norm), bitwise identical on all ranks; catches a rank-local loss or norm."""
    results = probe(pools(2), [T11, T11_NEXT])
    for i, step in enumerate((T11, T11_NEXT)):
        value = token_mean(step)
        for rank, res in enumerate(results):
            s = res["steps"][i]
            wsum = float(np.sum(np.asarray(s["w_before"], dtype=np.float32), dtype=np.float64))
            expected_loss = sum(n * c * wsum for r in step for c, n in r) / sum(n for r in step for _, n in r)
            assert s["loss"] == pytest.approx(expected_loss, rel=RTOL), f"rank {rank} step {i}: loss {s['loss']}"
            assert s["grad_norm"] == pytest.approx(math.sqrt(cases_train.PROBE_NUMEL) * value, rel=RTOL), (
                f"rank {rank} step {i}: grad norm {s['grad_norm']} vs {math.sqrt(cases_train.PROBE_NUMEL) * value}")
        assert_same_on_all_ranks(results, i, "loss")
        assert_same_on_all_ranks(results, i, "grad_norm")


def test_contract_15_skipped_step_reported_and_scheduler_held(pools):
    """A non-finite loss on rank 1 only: every rank reports success False, grad_norm None, a
    skip_reason and skipped_steps 1, w is bitwise unchanged, the LR scheduler does not advance; the
    next clean step updates by its own 49/38 and advances the scheduler by exactly samples_per_step."""
    samples = 16
    results = probe(pools(2), [T11, T11_NEXT, T11_NEXT], inf=(1, 1), scheduler=samples)
    for rank, res in enumerate(results):
        clean, skipped, after = res["steps"]
        assert clean["success"] and clean["sched_after"] - clean["sched_before"] == samples
        assert skipped["success"] is False, f"rank {rank}: the non-finite step was not skipped: {skipped}"
        assert skipped["grad_norm"] is None, f"rank {rank}: grad norm {skipped['grad_norm']} on a skipped step"
        assert skipped["skip_reason"], f"rank {rank}: skip_reason not set"
        assert skipped["skipped_steps"] == 1, f"rank {rank}: skipped_steps {skipped['skipped_steps']}"
        assert skipped["unchanged_bitwise"], f"rank {rank}: params changed on a skipped step"
        assert skipped["sched_after"] == skipped["sched_before"], f"rank {rank}: scheduler advanced on a skip"
        assert after["success"], f"rank {rank}: the step after a skip failed: {after['skip_reason']}"
        assert after["skipped_steps"] == 1
        assert after["sched_after"] - after["sched_before"] == samples, (
            f"rank {rank}: scheduler advanced by {after['sched_after'] - after['sched_before']}, not {samples}")
        assert after["grad_norm"] == pytest.approx(math.sqrt(cases_train.PROBE_NUMEL) * 49 / 38, rel=RTOL)
        assert after["lr"] == 1.0
    assert_update(results, 2, 49 / 38, "rule 15 step after the skip")
    for i in range(3):
        for key in ("success", "grad_norm", "skip_reason", "skipped_steps", "sched_after"):
            assert_same_on_all_ranks(results, i, key)
