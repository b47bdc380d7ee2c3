"""Step plans: the chunk and pointer tables, the device (lr, wd) table, and the planned passes.

CPU part: chunk tables cover every piece element once and nothing else, respect the chunk size and
record the vector phase; the (lr, wd) table is updated in place only when a value changes; planned
passes over many shards equal the single-shard ops shard by shard (reference and cpu backends).
CUDA part (``@pytest.mark.cuda``): one launch over many shards against the reference; 20k tiny
pieces against the same bytes in one piece; the norm's overflow/underflow cases; bitwise repeatable
stats; a captured CUDA graph replaying the current lr; a shard on a second device.
"""
from __future__ import annotations

from tests.support.gap_helpers import pieces_table  # noqa: E402

import math

import pytest
import torch

import megatron_opt.ops as ops
from tests.kernels import front
from megatron_opt.ops.piece_table import PieceTable, full_table
from megatron_opt.ops.step_plan import CHUNK

BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
HAS_GPU_EXT = torch.cuda.is_available() and ops.HAS_CUDA_EXT
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_GPU_EXT, reason=f"needs a CUDA device and the compiled extension "
                                f"(cuda: {torch.cuda.is_available()}, extension: {ops.HAS_CUDA_EXT})")



def shard(table: PieceTable, gdtype, pdtype, seed: int, device="cpu", nstate: int = 2) -> ops.ShardOperands:
    g = torch.Generator().manual_seed(seed)
    n = table.numel
    grad = torch.randn(n, generator=g).to(gdtype)
    master = torch.randn(n, generator=g)
    state = tuple(torch.rand(n, generator=g) * (1e-3 if i else 1e-2) for i in range(nstate))
    pout = None if pdtype is None else master.to(pdtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ops.ShardOperands(table, to(grad), to(master), tuple(to(t) for t in state), to(pout))


def many_shards(device="cpu", gdtype=torch.bfloat16, pdtype=torch.bfloat16, nstate=2, seed=0):
    tables = [pieces_table([5, 1, 70000, 3, 64, 1031], [3, 0, 64]), full_table(1), full_table(CHUNK + 7),
              pieces_table([17] * 300, [1, 0, 5], lead=3), pieces_table([2 * CHUNK, 9], [0])]
    return [shard(t, gdtype, pdtype, seed + i, device, nstate) for i, t in enumerate(tables)]


def clone_shards(shards):
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return [ops.ShardOperands(s.table, c(s.grad), c(s.master), tuple(c(t) for t in s.state), c(s.param_out))
            for s in shards]


# ================================================================================================ CPU
def test_chunks_cover_each_piece_element_once_and_no_padding():
    shards = many_shards()
    plan = ops.StepPlan(tuple(shards))
    rows = plan.chunk_rows()
    assert plan.num_chunks == len(rows) > len(shards)
    for k, s in enumerate(shards):
        covered = torch.zeros(s.table.numel, dtype=torch.int32)
        for kk, a, e, group, in_norm, phase in rows:
            if kk != k:
                continue
            assert 0 < e - a <= CHUNK
            covered[a:e] += 1
            p = max(i for i, st in enumerate(s.table.starts) if st <= a)  # the piece holding the chunk
            assert e <= s.table.ends[p] and group == s.table.group[p] and in_norm == s.table.in_norm[p]
        want = torch.zeros_like(covered)
        for st, en in zip(s.table.starts, s.table.ends):
            want[st:en] = 1
        assert torch.equal(covered, want), f"shard {k}: chunks must cover piece elements once and skip gaps"


def test_chunk_phase_records_common_alignment():
    t = full_table(1000)
    aligned = ops.StepPlan((shard(t, torch.bfloat16, torch.bfloat16, 1),))
    assert {r[5] for r in aligned.chunk_rows()} == {0}
    buf = torch.zeros(1001, dtype=torch.bfloat16)
    s = shard(t, torch.bfloat16, torch.bfloat16, 1)
    off = ops.ShardOperands(t, buf[1:], s.master, s.state, s.param_out)  # grad one element off
    assert {r[5] for r in ops.StepPlan((off,)).chunk_rows()} == {-1}


def test_plan_rejects_mixed_dtypes_and_overlaps():
    a = shard(full_table(64), torch.bfloat16, torch.bfloat16, 1)
    b = shard(full_table(64), torch.float32, torch.bfloat16, 2)
    with pytest.raises(TypeError, match="one grad dtype"):
        ops.StepPlan((a, b))
    bad = ops.ShardOperands(a.table, a.grad, a.master, (a.master, a.state[1]), a.param_out)
    with pytest.raises(ValueError, match="overlap"):
        ops.StepPlan((bad,))
    short = ops.ShardOperands(a.table, a.grad[:10], a.master, a.state, a.param_out)
    with pytest.raises(ValueError, match="elements"):
        ops.StepPlan((short,))


def test_lr_table_is_updated_in_place_only_on_change(monkeypatch):
    hp = ops.DeviceHyperparams(3, torch.device("cpu"))
    staged = hp.update([1e-3, 2e-3, 3e-3], [0.1, 0.0, 0.1])
    table = staged.table
    assert torch.equal(table, torch.tensor([[1e-3, 0.1], [2e-3, 0.0], [3e-3, 0.1]], dtype=torch.float64))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: (copies.append(1), real_copy(self, *a, **k))[1])
    assert hp.update([1e-3, 2e-3, 3e-3], [0.1, 0.0, 0.1]) is staged and not copies
    changed = hp.update([5e-4, 2e-3, 3e-3], [0.1, 0.0, 0.1])
    assert changed.table is table and len(copies) == 1  # the same tensor, updated in place (graphs replay it)
    assert table[0, 0].item() == 5e-4 and list(changed.host.lr) == [5e-4, 2e-3, 3e-3]
    with pytest.raises(ValueError, match="param groups"):
        hp.update([1.0], [0.0])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("rule", ["adamw", "sgd", "sgd-momentum", "lion"])
def test_planned_pass2_equals_single_shard_ops(backend, rule):
    nstate = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "lion": 1}[rule]
    shards = many_shards(nstate=nstate, seed=3)
    mine, theirs = clone_shards(shards), clone_shards(shards)
    lr, wd = [1e-3, 3e-4, 2e-2], [0.1, 0.0, 0.01]
    lr_wd = ops.lr_wd_table(lr, wd, torch.device("cpu"))
    gs, clip, step = torch.tensor([0.5]), 0.75, torch.tensor([3])
    plan = ops.StepPlan(tuple(mine))
    if rule == "adamw":
        front.adamw_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip, step=step, beta1=BETA1,
                               beta2=BETA2, eps=EPS, backend=backend)
    elif rule == "lion":
        front.lion_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip, beta1=BETA1, beta2=BETA2,
                              backend=backend)
    else:
        front.sgd_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip, momentum=0.9 if nstate else 0.0,
                             nesterov=True, backend=backend)
    for s in theirs:
        kw = dict(lr=lr, weight_decay=wd, grad_scale=gs * clip, backend=backend)
        if rule == "adamw":
            front.adamw_step(s.grad, s.master, *s.state, s.param_out, s.table, step=step, beta1=BETA1, beta2=BETA2,
                           eps=EPS, **kw)
        elif rule == "lion":
            front.lion_step(s.grad, s.master, s.state[0], s.param_out, s.table, beta1=BETA1, beta2=BETA2, **kw)
        else:
            front.sgd_step(s.grad, s.master, s.state[0] if nstate else None, s.param_out, s.table,
                         momentum=0.9 if nstate else 0.0, nesterov=True, **kw)
    for a, b in zip(mine, theirs):
        for x, y in zip([a.master, *a.state, a.param_out], [b.master, *b.state, b.param_out]):
            assert torch.equal(x, y)
    assert not torch.equal(mine[0].master, shards[0].master), "the update must move the masters"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_planned_stats_sum_over_shards(backend):
    shards = many_shards(seed=5)
    got = torch.zeros(3, dtype=torch.float64)
    ops.grad_stats(ops.StepPlan(tuple(shards), update=False), torch.tensor([0.25]), got, backend=backend)
    want = torch.zeros(3, dtype=torch.float64)
    for s in shards:
        front.grad_stats(s.grad, s.table, torch.tensor([0.25]), want, backend=backend)
    assert torch.allclose(got, want, rtol=1e-12, atol=0) and got[1] > 0


def test_plan_group_ids_checked_against_lr_table():
    plan = ops.StepPlan(tuple(many_shards(nstate=2)))
    with pytest.raises(ValueError, match="param group 2"):
        front.adamw_step_planned(plan, lr_wd=ops.lr_wd_table([1e-3, 1e-3], [0.0, 0.0], torch.device("cpu")),
                               grad_scale=torch.ones(1), step=torch.ones(1, dtype=torch.int64), beta1=BETA1,
                               beta2=BETA2, eps=EPS)


# ================================================================================================ CUDA
DEV = "cuda"
DTYPE_PAIRS = [(torch.float32, None), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
               (torch.float16, torch.float16), (torch.bfloat16, torch.float32)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.double(), want.double()
    tol = 2e-6 * w.abs() + 1e-7 * w.abs().max().clamp_min(1e-30)
    bad = ((g - w).abs() > tol) | (g.isnan() != w.isnan())
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {float((g - w).abs().max())}"


def _run_rule(rule: str, plan, lr_wd, gs, clip, step, backend, found=None):
    if rule == "adamw":
        front.adamw_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip, step=step, beta1=BETA1,
                               beta2=BETA2, eps=EPS, found_inf=found, backend=backend)
    elif rule == "lion":
        front.lion_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip, beta1=BETA1, beta2=BETA2,
                              found_inf=found, backend=backend)
    else:
        front.sgd_step_planned(plan, lr_wd=lr_wd, grad_scale=gs * clip,
                             momentum=0.9 if rule == "sgd-momentum" else 0.0, nesterov=False, found_inf=found,
                             backend=backend)


@cuda
@needs_cuda
@pytest.mark.parametrize("gdtype,pdtype", DTYPE_PAIRS)
@pytest.mark.parametrize("rule", ["adamw", "sgd", "sgd-momentum", "lion"])
def test_cuda_one_launch_over_many_shards_matches_reference(gdtype, pdtype, rule):
    nstate = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "lion": 1}[rule]
    shards = many_shards(DEV, gdtype, pdtype, nstate, seed=7)
    ours, ref = clone_shards(shards), clone_shards(shards)
    lr_wd = ops.lr_wd_table([1e-3, 3e-4, 2e-2], [0.1, 0.0, 0.01], torch.device(DEV))
    gs, step = torch.tensor([0.5], device=DEV), torch.tensor([4], device=DEV)
    _run_rule(rule, ops.StepPlan(tuple(ours)), lr_wd, gs, 0.75, step, "cuda-ext")
    _run_rule(rule, ops.StepPlan(tuple(ref)), lr_wd, gs, 0.75, step, "reference")
    for k, (a, b) in enumerate(zip(ours, ref)):
        for name, x, y in zip(["master", "s0", "s1"], [a.master, *a.state], [b.master, *b.state]):
            _close(x, y, f"shard {k} {name}")
        if a.param_out is not None:
            assert torch.equal(a.param_out, a.master.to(a.param_out.dtype)), "param_out = rounded master"
    stats, want = (torch.zeros(3, dtype=torch.float64, device=DEV) for _ in range(2))
    ops.grad_stats(ops.StepPlan(tuple(shards), update=False), gs, stats, backend="cuda-ext")
    ops.grad_stats(ops.StepPlan(tuple(shards), update=False), gs, want, backend="reference")
    assert stats[0] == want[0] and stats[2] == want[2]
    assert math.isclose(stats[1].item(), want[1].item(), rel_tol=1e-12)


@cuda
@needs_cuda
def test_cuda_20k_tiny_pieces_equal_one_piece():
    """20k pieces of 7 elements back to back (no gaps) against one piece over the same elements."""
    n = 20000 * 7
    tiny = PieceTable(tuple(range(0, n, 7)), tuple(range(7, n + 1, 7)), (True,) * 20000, (0,) * 20000, n)
    one = full_table(n)
    base = shard(one, torch.bfloat16, torch.bfloat16, 11, DEV)
    a, b = clone_shards([base])[0], clone_shards([base])[0]
    a = ops.ShardOperands(tiny, a.grad, a.master, a.state, a.param_out)
    lr_wd = ops.lr_wd_table([1e-3], [0.1], torch.device(DEV))
    gs, step = torch.ones(1, device=DEV), torch.tensor([2], device=DEV)
    for s in (a, b):
        _run_rule("adamw", ops.StepPlan((s,)), lr_wd, gs, 1.0, step, "cuda-ext")
    for x, y in zip([a.master, *a.state, a.param_out], [b.master, *b.state, b.param_out]):
        assert torch.equal(x, y), "element-wise math must not depend on how pieces are cut"
    s1, s2 = (torch.zeros(3, dtype=torch.float64, device=DEV) for _ in range(2))
    ops.grad_stats(ops.StepPlan((a,), update=False), gs, s1)
    ops.grad_stats(ops.StepPlan((b,), update=False), gs, s2)
    assert s1[0] == s2[0] == 0 and s1[2] == s2[2]
    assert math.isclose(s1[1].item(), s2[1].item(), rel_tol=1e-13)


@cuda
@needs_cuda
def test_cuda_norm_squares_in_fp64_no_overflow_no_underflow():
    big = torch.full((4,), 3e19, dtype=torch.bfloat16, device=DEV)
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(big, full_table(4), torch.ones(1, device=DEV), stats)
    want = 4 * float(big[0].double()) ** 2
    assert math.isfinite(stats[1].item()) and math.isclose(stats[1].item(), want, rel_tol=1e-12)
    assert stats[0].item() == 0
    tiny = torch.full((1000,), 1e-23, dtype=torch.float32, device=DEV)
    stats.zero_()
    front.grad_stats(tiny, full_table(1000), torch.ones(1, device=DEV), stats)
    want = 1000 * float(tiny[0].double()) ** 2
    assert stats[1].item() > 0 and math.isclose(stats[1].item(), want, rel_tol=1e-12)
    ref = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(tiny, full_table(1000), torch.ones(1, device=DEV), ref, backend="reference")
    assert math.isclose(stats[1].item(), ref[1].item(), rel_tol=1e-12)


@cuda
@needs_cuda
def test_cuda_nonfinite_counted_exactly_on_the_slow_path():
    t = pieces_table([40000, 5000, 70000], [64, 0])
    s = shard(t, torch.bfloat16, None, 13, DEV)
    g = s.grad
    g[[3, 100, 39999]] = float("nan")
    g[40064 + 7] = float("inf")
    g[40064 + 5000 + 60000] = -float("inf")  # in the third piece, second chunk
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(g, t, torch.ones(1, device=DEV), stats)
    assert stats[0].item() == 5 and math.isnan(stats[1].item())


@cuda
@needs_cuda
def test_cuda_stats_bitwise_repeatable():
    shards = many_shards(DEV, torch.float32, None, 0, seed=17)
    plan = ops.StepPlan(tuple(shards), update=False)
    inv = torch.tensor([0.37], device=DEV)
    runs = []
    for _ in range(3):
        st = torch.zeros(3, dtype=torch.float64, device=DEV)
        ops.grad_stats(plan, inv, st)
        runs.append(st.cpu())
    assert all(torch.equal(r.view(torch.int64), runs[0].view(torch.int64)) for r in runs)


@cuda
@needs_cuda
def test_cuda_graph_replay_reads_the_current_lr():
    """Pass 2 captured once; the lr changes between replays through the in-place device table."""
    t = pieces_table([3000, 70000, 5], [64, 3])
    base = shard(t, torch.bfloat16, torch.bfloat16, 19, DEV)
    graphed, eager = clone_shards([base])[0], clone_shards([base])[0]
    hp_g, hp_e = ops.DeviceHyperparams(3, torch.device(DEV)), ops.DeviceHyperparams(3, torch.device(DEV))
    gs = torch.ones(1, device=DEV)
    step_g, step_e = torch.ones(1, dtype=torch.int64, device=DEV), torch.ones(1, dtype=torch.int64, device=DEV)
    plan_g, plan_e = ops.StepPlan((graphed,)), ops.StepPlan((eager,))
    table_g = hp_g.update([1e-3] * 3, [0.1] * 3)
    plan_g.device_tensors()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, on a scratch copy
        scratch = clone_shards([graphed])[0]
        _run_rule("adamw", ops.StepPlan((scratch,)), table_g, gs, 1.0, step_g, "cuda-ext")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_rule("adamw", plan_g, table_g, gs, 1.0, step_g, "cuda-ext")
    for i, lr in enumerate([1e-3, 5e-4, 2e-4]):
        hp_g.update([lr, lr / 2, lr], [0.1, 0.0, 0.1])
        step_g.fill_(i + 1)
        graph.replay()
        step_e.fill_(i + 1)
        _run_rule("adamw", plan_e, hp_e.update([lr, lr / 2, lr], [0.1, 0.0, 0.1]), gs, 1.0, step_e, "cuda-ext")
    torch.cuda.synchronize()
    for x, y in zip([graphed.master, *graphed.state, graphed.param_out], [eager.master, *eager.state, eager.param_out]):
        assert torch.equal(x, y), "graph replay must be bitwise equal to eager with the current lr"


@cuda
@needs_cuda
def test_cuda_found_inf_skips_the_planned_update():
    shards = many_shards(DEV, torch.bfloat16, torch.bfloat16, 2, seed=23)
    before = clone_shards(shards)
    lr_wd = ops.lr_wd_table([1e-3] * 3, [0.1] * 3, torch.device(DEV))
    for flag in (1.0, math.nan):
        _run_rule("adamw", ops.StepPlan(tuple(shards)), lr_wd, torch.ones(1, device=DEV), 1.0,
                  torch.ones(1, dtype=torch.int64, device=DEV), "cuda-ext", found=torch.tensor([flag], device=DEV))
    for a, b in zip(shards, before):
        for x, y in zip([a.master, *a.state, a.param_out], [b.master, *b.state, b.param_out]):
            assert torch.equal(x, y)


@cuda
@pytest.mark.skipif(not (HAS_GPU_EXT and torch.cuda.device_count() >= 2), reason="needs two GPUs")
def test_cuda_second_device_while_first_is_current():
    torch.cuda.set_device(0)
    s = shard(full_table(100003), torch.bfloat16, torch.bfloat16, 29, "cuda:1")
    ref = clone_shards([s])[0]
    lr_wd = ops.lr_wd_table([1e-3], [0.1], torch.device("cuda:1"))
    gs, step = torch.ones(1, device="cuda:1"), torch.ones(1, dtype=torch.int64, device="cuda:1")
    _run_rule("adamw", ops.StepPlan((s,)), lr_wd, gs, 1.0, step, "cuda-ext")
    _run_rule("adamw", ops.StepPlan((ref,)), lr_wd, gs, 1.0, step, "reference")
    _close(s.master, ref.master, "master on cuda:1")
