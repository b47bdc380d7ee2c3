"""The step's fused operations against a float64 oracle.

CPU part (always runs): megatron_opt.ops.reference vs the oracle below; garbage in the gaps
(reference and cpu backends: pass 2 never writes a gap element, pass 1 never counts one).
CUDA part (``@pytest.mark.cuda``; skipped without a GPU or without the compiled extension): the
kernels of megatron_opt.ops.cuda vs the same oracle and vs the reference run on the same CUDA
tensors, plus determinism, CUDA-graph capture/replay, misaligned views and large shards.

Tolerances (docs/kernels.md, "Testing"): fp32 outputs within rtol=2e-6 and atol=1e-7*max|ref| of
the oracle; the norm within rtol=1e-5; counts and found_inf exact; model-dtype params exactly the
rounding of the fp32 master the op itself produced, and within 1 ulp of the rounded oracle.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_opt.ops as ops
from tests.kernels import front
from megatron_opt.ops.piece_table import PieceTable, full_table
from tests.support.gap_helpers import (as_bits, assert_gap_run, assert_gaps_unchanged, gapped_bounds, many_groups_case,
                                       piece_mask, with_gap_garbage)
from tests.support.common import assert_within as _assert_within

SIZES = [0, 1, 7, 8, 9, 65535, 65536, 65537]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["full", "gapped"]
LR = [1e-3, 3e-4, 2e-2]
WD = [0.1, 0.0, 0.01]
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8

HAS_GPU_EXT = torch.cuda.is_available() and ops.HAS_CUDA_EXT
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(
    not HAS_GPU_EXT,
    reason=f"needs a CUDA device and the compiled extension (cuda available: {torch.cuda.is_available()}, "
    f"extension: {ops.HAS_CUDA_EXT}, {ops.CUDA_EXT_ERROR})",
)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """These tensors are small: one intra-op thread is faster, and far faster on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# =================================================================================================
# Inputs
# =================================================================================================
def gapped_table(n: int) -> PieceTable:
    """Pieces with gaps (including touching pieces), a misaligned first start, odd lengths,
    every third piece out of the norm and three param groups."""
    if n == 0:
        return PieceTable((), (), (), (), 0)
    starts, ends = gapped_bounds(n)
    nseg = len(starts)
    in_norm = tuple(i % 3 != 2 for i in range(nseg))
    group = tuple((0, 1, 0, 2)[i % 4] for i in range(nseg))
    return PieceTable(tuple(starts), tuple(ends), in_norm, group, n)


def make_table(n: int, layout: str) -> PieceTable:
    return full_table(n) if layout == "full" else gapped_table(n)


def subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal / 4


def make_grad(
    table: PieceTable, dtype: torch.dtype, seed: int, specials: bool = False, finite_specials: bool = False,
    scale: float = 3.0, device="cpu",
) -> torch.Tensor:
    """Random grads inside the pieces, exact zeros in the gaps; some planted zeros; optionally
    inf/NaN/-0.0/subnormals at piece heads and tails (finite_specials: only -0.0/0/subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    n = table.numel
    g = torch.randn(n, generator=gen, dtype=torch.float32) * scale
    if n:
        g[torch.arange(0, n, 13)] = 0.0
    if specials or finite_specials:
        vals = [-0.0, subnormal(dtype), 0.0, -subnormal(dtype)]
        if specials:
            vals = [math.inf, math.nan, -0.0, -math.inf, subnormal(dtype), 0.0] + vals
        k = 0
        for s, e in zip(table.starts, table.ends):
            for idx in sorted({s, e - 1, min(s + 8, e - 1)}):
                g[idx] = vals[k % len(vals)]
                k += 1
    if n:
        g = torch.where(piece_mask(table), g, torch.zeros_like(g))  # gaps are exactly zero
    return g.to(dtype).to(device)


def make_state(table: PieceTable, seed: int, device="cpu", gap_value: float = 0.0):
    gen = torch.Generator().manual_seed(seed + 1000)
    n = table.numel
    mask = piece_mask(table)
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    out = []
    for t in (master, m, v):
        out.append(torch.where(mask, t, torch.full_like(t, gap_value)).to(device))
    return out


# =================================================================================================
# float64 oracle
# =================================================================================================
def oracle_stats(grad: torch.Tensor, table: PieceTable, inv_scale: float, count_zeros: bool = True):
    g = grad.double()
    nonfinite, sumsq, zeros = 0, 0.0, 0
    for s, e, norm in zip(table.starts, table.ends, table.in_norm):
        x = g[s:e]
        nonfinite += int((~torch.isfinite(x)).sum())
        if norm:  # the zero count follows the norm's counting rule
            zeros += int((x == 0).sum())
            sumsq += float(((x * inv_scale) ** 2).sum())
    return nonfinite, sumsq, (zeros if count_zeros else 0)


def oracle_adamw(grad, master, m, v, table, lr, wd, grad_scale, step, beta1=BETA1, beta2=BETA2, eps=EPS):
    g = grad.double() * grad_scale
    W, M, V = master.double().clone(), m.double().clone(), v.double().clone()
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    for s, e, gid in zip(table.starts, table.ends, table.group):
        gg = g[s:e]
        M[s:e] = beta1 * M[s:e] + (1 - beta1) * gg
        V[s:e] = beta2 * V[s:e] + (1 - beta2) * gg * gg
        update = (M[s:e] / bc1) / (V[s:e].sqrt() / math.sqrt(bc2) + eps)
        W[s:e] = W[s:e] * (1 - lr[gid] * wd[gid]) - lr[gid] * update
    return W, M, V


def oracle_sgd(grad, master, buf, table, lr, wd, grad_scale, momentum, nesterov):
    g = grad.double() * grad_scale
    W = master.double().clone()
    B = buf.double().clone() if buf is not None else None
    for s, e, gid in zip(table.starts, table.ends, table.group):
        gg = g[s:e] + wd[gid] * W[s:e]
        if momentum != 0:
            B[s:e] = momentum * B[s:e] + gg
            d = gg + momentum * B[s:e] if nesterov else B[s:e]
        else:
            d = gg
        W[s:e] = W[s:e] - lr[gid] * d
    return W, B


# =================================================================================================
# Comparisons
# =================================================================================================
def assert_fp32_close(out: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert out.dtype == torch.float32
    finite = want[torch.isfinite(want)]
    atol = 1e-7 * float(finite.abs().max()) if finite.numel() else 0.0
    _assert_within(out, want, rtol=2e-6, atol=atol, what=what)


def assert_exact(out: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    _assert_within(out, want, rtol=0.0, atol=0.0, what=what)


def _ulp16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant_bits, min_exp = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    _, e = torch.frexp(x)
    e = torch.where(x == 0, torch.full_like(e, min_exp + 1), e)
    return torch.ldexp(torch.ones_like(x), (e - 1).clamp(min=min_exp) - mant_bits)


def _ordered16(t: torch.Tensor) -> torch.Tensor:
    b = t.view(torch.int16).to(torch.int32)
    mag = b & 0x7FFF
    return torch.where(b < 0, -mag, mag)


def assert_param_out(param_out: torch.Tensor, master: torch.Tensor, oracle_w: torch.Tensor) -> None:
    # (a) exactly the rounding of the op's own fp32 master
    assert torch.equal(param_out, master.to(param_out.dtype)), "param_out is not the rounded master"
    # (b) within 1 ulp of the rounded float64 oracle, or (where the fp32 master itself carries a
    # cancellation error, allowed by the fp32 tolerance) within that error plus 1 ulp
    oracle_w = oracle_w.to(param_out.device)
    if param_out.dtype == torch.float32:
        assert_fp32_close(param_out, oracle_w, "param_out")
    elif param_out.numel():
        want = oracle_w.to(param_out.dtype)
        ulps = (_ordered16(param_out) - _ordered16(want)).abs()
        slack = 1e-7 * float(oracle_w.abs().max()) + _ulp16(oracle_w, param_out.dtype)
        ok = (ulps <= 1) | ((param_out.double() - oracle_w).abs() <= slack)
        assert bool(ok.all()), f"param_out: {int((~ok).sum())} elements off by up to {int(ulps.max())} ulps"


def assert_stats(stats: torch.Tensor, want, what: str = "") -> None:
    nonfinite, sumsq, zeros = want
    got = stats.cpu().tolist()
    assert got[0] == nonfinite, f"{what}: non-finite count {got[0]} != {nonfinite}"
    assert got[2] == zeros, f"{what}: zero count {got[2]} != {zeros}"
    if math.isfinite(sumsq) and nonfinite == 0:
        assert math.isclose(math.sqrt(got[1]), math.sqrt(sumsq), rel_tol=1e-5, abs_tol=1e-30), (
            f"{what}: norm {math.sqrt(got[1])} != {math.sqrt(sumsq)}"
        )
    else:
        assert not math.isfinite(got[1]) or not math.isfinite(sumsq) or nonfinite > 0
        if math.isnan(sumsq):
            assert math.isnan(got[1]), f"{what}: sumsq {got[1]}, oracle NaN"
        elif math.isinf(sumsq):
            assert math.isinf(got[1]) or math.isnan(got[1]), f"{what}: sumsq {got[1]}, oracle inf"


def snapshot(*ts):
    return [None if t is None else t.clone() for t in ts]


def assert_bitwise_unchanged(before, after, names) -> None:
    for b, a, n in zip(before, after, names):
        if b is None:
            continue
        assert torch.equal(b.view(torch.uint8) if b.dtype != torch.bool else b, a.view(torch.uint8)), (
            f"{n} changed on a skipped step"
        )


# =================================================================================================
# CPU: reference vs oracle
# =================================================================================================
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("specials", [False, True])
def test_reference_grad_stats(n, layout, dtype, specials):
    table = make_table(n, layout)
    grad = make_grad(table, dtype, seed=n, specials=specials)
    inv = torch.tensor([0.25])
    stats = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # accumulates
    front.grad_stats(grad, table, inv, stats, backend="reference")
    nf, ss, z = oracle_stats(grad, table, 0.25)
    assert_stats(stats - torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), (nf, ss, z), "reference")


@pytest.mark.parametrize("count_zeros", [True, False])
def test_reference_grad_stats_count_zeros_flag(count_zeros):
    table = gapped_table(1000)
    grad = make_grad(table, torch.float32, seed=1)
    stats = torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([1.0]), stats, count_zeros=count_zeros, backend="reference")
    assert_stats(stats, oracle_stats(grad, table, 1.0, count_zeros))
    assert (stats[2] > 0) == count_zeros


def test_reference_excluded_pieces_not_in_norm():
    table = PieceTable((0, 10, 30), (8, 20, 33), (True, False, True), (0, 0, 0), 40)
    grad = torch.zeros(40)
    grad[0:8] = 1.0
    grad[10:20] = 1e6  # excluded: must not reach the norm
    grad[30:33] = 2.0
    stats = torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([0.5]), stats, backend="reference")
    assert stats[1].item() == pytest.approx(0.25 * (8 * 1.0 + 3 * 4.0))
    assert stats[0].item() == 0 and stats[2].item() == 0


# (grad dtype, param_out dtype) pairs for the CPU reference; the CUDA test runs the full product.
CPU_DTYPE_PAIRS = [
    (torch.float32, None), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gdtype,pdtype", CPU_DTYPE_PAIRS)
def test_reference_adamw(n, layout, gdtype, pdtype):
    table = make_table(n, layout)
    grad = make_grad(table, gdtype, seed=n + 3, finite_specials=True)
    master, m, v = make_state(table, seed=n)
    param_out = None if pdtype is None else torch.zeros(n, dtype=pdtype)
    gs, step = 0.5, 3
    W, M, V = oracle_adamw(grad, master, m, v, table, LR, WD, gs, step)
    front.adamw_step(grad, master, m, v, param_out, table, lr=LR, weight_decay=WD, grad_scale=torch.tensor([gs]),
                   step=torch.tensor([step]), beta1=BETA1, beta2=BETA2, eps=EPS, backend="reference")
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(v, V, "exp_avg_sq")
    assert_fp32_close(master, W, "master")
    if param_out is not None:
        assert_param_out(param_out, master, W)


@pytest.mark.parametrize("n", [1, 9, 65537])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_reference_sgd(n, layout, gdtype, momentum, nesterov):
    table = make_table(n, layout)
    grad = make_grad(table, gdtype, seed=n + 5, finite_specials=True)
    master, buf, _ = make_state(table, seed=n)
    buf = buf if momentum else None
    param_out = torch.zeros(n, dtype=torch.bfloat16)
    W, B = oracle_sgd(grad, master, buf, table, LR, WD, 2.0, momentum, nesterov)
    front.sgd_step(grad, master, buf, param_out, table, lr=LR, weight_decay=WD, grad_scale=torch.tensor([2.0]),
                 momentum=momentum, nesterov=nesterov, backend="reference")
    assert_fp32_close(master, W, "master")
    if buf is not None:
        assert_fp32_close(buf, B, "momentum_buffer")
    assert_param_out(param_out, master, W)


@pytest.mark.parametrize("found,advances",
                         [(None, True), (0.0, True), (1.0, False), (math.nan, False), (math.inf, False)])
def test_reference_advance_step(found, advances):
    step = torch.tensor([5])
    ops.advance_step(step, None if found is None else torch.tensor([found]), backend="reference")
    assert step.item() == (6 if advances else 5)


@pytest.mark.parametrize("found", [1.0, math.nan])
def test_reference_found_inf_skips_everything(found):
    table = gapped_table(5000)
    grad = make_grad(table, torch.bfloat16, seed=2)
    master, m, v = make_state(table, seed=2)
    param_out = master.to(torch.bfloat16)
    flag = torch.tensor([found])
    before = snapshot(master, m, v, param_out)
    front.adamw_step(grad, master, m, v, param_out, table, lr=LR, weight_decay=WD, grad_scale=torch.tensor([1.0]),
                   step=torch.tensor([1]), beta1=BETA1, beta2=BETA2, eps=EPS, found_inf=flag, backend="reference")
    assert_bitwise_unchanged(before, [master, m, v, param_out], ["master", "exp_avg", "exp_avg_sq", "param_out"])
    buf = torch.randn(5000)
    before = snapshot(master, buf, param_out)
    front.sgd_step(grad, master, buf, param_out, table, lr=LR, weight_decay=WD, grad_scale=torch.tensor([1.0]),
                 momentum=0.9, found_inf=flag, backend="reference")
    assert_bitwise_unchanged(before, [master, buf, param_out], ["master", "momentum_buffer", "param_out"])


def test_reference_adamw_matches_torch_adamw_trajectory():
    """Same semantics as torch.optim.AdamW over several steps (fp32 master, one group)."""
    n = 1000
    table = full_table(n)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.1, foreach=False)
    master, m, v = p.detach().clone(), torch.zeros(n), torch.zeros(n)
    step = torch.zeros(1, dtype=torch.int64)
    for _ in range(10):
        g = torch.randn(n, generator=gen)
        p.grad = g.clone()
        opt.step()
        ops.advance_step(step, backend="reference")
        front.adamw_step(g, master, m, v, None, table, lr=[1e-2], weight_decay=[0.1], grad_scale=torch.ones(1),
                       step=step, beta1=BETA1, beta2=BETA2, eps=EPS, backend="reference")
    _assert_within(master, p.detach(), rtol=1e-5, atol=1e-6, what="master vs torch")
    _assert_within(m, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7, what="exp_avg vs torch")


def test_reference_sgd_matches_torch_sgd_trajectory():
    n = 1000
    table = full_table(n)
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.SGD([p], lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)
    master, buf = p.detach().clone(), torch.zeros(n)
    for _ in range(5):
        g = torch.randn(n, generator=gen)
        p.grad = g.clone()
        opt.step()
        front.sgd_step(g, master, buf, None, table, lr=[1e-2], weight_decay=[0.01], grad_scale=torch.ones(1),
                     momentum=0.9, nesterov=True, backend="reference")
    _assert_within(master, p.detach(), rtol=1e-5, atol=1e-6, what="master vs torch")


@st.composite
def random_tables(draw):
    n = draw(st.integers(0, 600))
    starts, ends, pos = [], [], draw(st.integers(0, 9))
    while pos < n and len(starts) < 12:
        e = min(n, pos + draw(st.integers(1, 150)))
        starts.append(pos)
        ends.append(e)
        pos = e + draw(st.integers(0, 20))
    k = len(starts)
    in_norm = tuple(draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    group = tuple(draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
    return PieceTable(tuple(starts), tuple(ends), in_norm, group, n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=random_tables(), dtype=st.sampled_from(GRAD_DTYPES), seed=st.integers(0, 2**16))
def test_reference_random_tables(table, dtype, seed):
    grad = make_grad(table, dtype, seed=seed, finite_specials=True)
    stats = torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([0.5]), stats, backend="reference")
    assert_stats(stats, oracle_stats(grad, table, 0.5))
    master, m, v = make_state(table, seed=seed)
    W, M, V = oracle_adamw(grad, master, m, v, table, LR, WD, 1.0, 2)
    front.adamw_step(grad, master, m, v, None, table, lr=LR, weight_decay=WD, grad_scale=torch.ones(1),
                   step=torch.tensor([2]), beta1=BETA1, beta2=BETA2, eps=EPS, backend="reference")
    assert_fp32_close(master, W, "master")
    assert_fp32_close(v, V, "exp_avg_sq")


def test_cpu_tensors_use_the_cpu_implementation():
    assert ops.backend_for(torch.zeros(1)) == "cpu"


# =================================================================================================
# CPU: garbage in the gaps (reference and cpu backends). Pass 2 writes piece elements only: every
# gap element of master, state and param_out stays bitwise as it was, whatever it held, and the
# pieces come out bitwise as with zero gaps. Pass 1 counts and sums piece elements only.
# =================================================================================================
TORCH_BACKENDS = ("reference", "cpu")


def gap_table(name: str) -> PieceTable:
    """gapped_table's pieces with other group patterns: "alternating" (gapped_table's own: runs of
    one piece), "pairs" (runs of two pieces with a gap inside), "one-run" (one group: a single run
    over the whole span, every gap inside it), "one-run-large" (the same, 16x longer gaps)."""
    t = gapped_table(65537 if name == "one-run-large" else 4099)
    k = t.num_pieces
    group = {
        "alternating": t.group,
        "pairs": tuple((i // 2) % 3 for i in range(k)),
        "one-run": (0,) * k,
        "one-run-large": (0,) * k,
    }[name]
    return PieceTable(t.starts, t.ends, t.in_norm, group, t.numel)


GAP_TABLES = ["alternating", "pairs", "one-run", "one-run-large"]
PASS2_RULES = ["adamw", "sgd", "sgd-momentum", "sgd-nesterov"]


def _pass2(backend, rule: str, grad, state, param_out, table, step: int) -> None:
    master, a, b = state
    if rule == "adamw":
        front.adamw_step(grad, master, a, b, param_out, table, lr=LR, weight_decay=WD, grad_scale=torch.tensor([0.5]),
                       step=torch.tensor([step]), beta1=BETA1, beta2=BETA2, eps=EPS, backend=backend)
    else:
        momentum = 0.0 if rule == "sgd" else 0.9
        front.sgd_step(grad, master, a if momentum else None, param_out, table, lr=LR, weight_decay=WD,
                     grad_scale=torch.tensor([0.5]), momentum=momentum, nesterov=rule == "sgd-nesterov",
                     backend=backend)


def check_pass2_gap_garbage(backend, rule, table, gdtype, pdtype, seed, steps=2) -> None:
    """Two steps on zero-gap tensors and on the same tensors with garbage in every gap (grads
    included: NaN/inf there must not reach a piece)."""
    n = table.numel
    gap = ~piece_mask(table)
    clean = make_state(table, seed=seed)
    clean_po = None if pdtype is None else torch.zeros(n, dtype=pdtype)
    dirty = [with_gap_garbage(t, table, seed=seed + i) for i, t in enumerate(clean)]
    dirty_po = None if pdtype is None else with_gap_garbage(clean_po, table, seed=seed + 3)
    names = ["master", "state 1", "state 2", "param_out"]
    for step in range(1, steps + 1):
        grad = make_grad(table, gdtype, seed=seed + 10 * step, finite_specials=True)
        dirty_grad = with_gap_garbage(grad, table, seed=seed + 10 * step + 1)
        grad_before = dirty_grad.clone()
        before = snapshot(*dirty, dirty_po)
        _pass2(backend, rule, grad, clean, clean_po, table, step)
        _pass2(backend, rule, dirty_grad, dirty, dirty_po, table, step)
        assert_gaps_unchanged(before, [*dirty, dirty_po], gap, names, f"step {step}")
        assert torch.equal(as_bits(dirty_grad), as_bits(grad_before)), "grad written"
        for c, d, name in zip([*clean, clean_po], [*dirty, dirty_po], names):
            if c is not None:
                assert torch.equal(as_bits(d)[~gap], as_bits(c)[~gap]), (
                    f"step {step}: {name} pieces differ from the zero-gap run"
                )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("rule", PASS2_RULES)
@pytest.mark.parametrize("tname", GAP_TABLES)
@pytest.mark.parametrize("gdtype,pdtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float32)])
def test_pass2_gap_garbage_untouched(backend, rule, tname, gdtype, pdtype):
    check_pass2_gap_garbage(backend, rule, gap_table(tname), gdtype, pdtype, seed=7)


def test_pass2_gap_garbage_param_out_aliasing_fp32_master():
    """param_out may be the fp32 master itself: its gaps still come back unchanged."""
    table = gap_table("one-run")
    gap = ~piece_mask(table)
    for backend in TORCH_BACKENDS:
        master, m, v = (with_gap_garbage(t, table, seed=i) for i, t in enumerate(make_state(table, seed=3)))
        clean = make_state(table, seed=3)
        before = snapshot(master, m, v)
        grad = with_gap_garbage(make_grad(table, torch.bfloat16, seed=4), table, seed=5)
        _pass2(backend, "adamw", grad, [master, m, v], master, table, 1)
        _pass2(backend, "adamw", make_grad(table, torch.bfloat16, seed=4), clean, None, table, 1)
        assert_gaps_unchanged(before, [master, m, v], gap, ["master", "exp_avg", "exp_avg_sq"], backend)
        assert torch.equal(as_bits(master)[~gap], as_bits(clean[0])[~gap])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("tname", GAP_TABLES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("kind", ["bits", "zeros"])
def test_grad_stats_ignore_gap_garbage(backend, tname, dtype, specials, kind):
    """Garbage (or signed zeros) in the grad's gaps: the same stats, bitwise, as with +0 gaps."""
    table = gap_table(tname)
    grad = make_grad(table, dtype, seed=11, specials=specials)
    dirty = with_gap_garbage(grad, table, seed=12, kind=kind)
    before = dirty.clone()
    for count_zeros in (True, False):
        s_clean, s_dirty = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        front.grad_stats(grad, table, torch.tensor([0.25]), s_clean, count_zeros, backend=backend)
        front.grad_stats(dirty, table, torch.tensor([0.25]), s_dirty, count_zeros, backend=backend)
        assert torch.equal(as_bits(s_dirty), as_bits(s_clean)), f"{s_dirty.tolist()} != {s_clean.tolist()}"
        assert_stats(s_dirty, oracle_stats(grad, table, 0.25, count_zeros), backend)
    assert torch.equal(as_bits(dirty), as_bits(before)), "grad written"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=random_tables(), dtype=st.sampled_from(GRAD_DTYPES), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["reference", "cpu"]), rule=st.sampled_from(PASS2_RULES))
def test_random_tables_gap_garbage(table, dtype, seed, backend, rule):
    grad = make_grad(table, dtype, seed=seed, finite_specials=True)
    dirty = with_gap_garbage(grad, table, seed=seed + 1)
    s_clean, s_dirty = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([0.5]), s_clean, backend=backend)
    front.grad_stats(dirty, table, torch.tensor([0.5]), s_dirty, backend=backend)
    assert torch.equal(as_bits(s_dirty), as_bits(s_clean))
    check_pass2_gap_garbage(backend, rule, table, dtype, torch.bfloat16, seed=seed, steps=1)


# =================================================================================================
# CUDA: kernels vs oracle and vs reference
# =================================================================================================
CUDA_EXT = "cuda-ext"  # the backend of the CUDA tests: the compiled extension, through the public fronts


DEV = "cuda"


def _scalar(x, dtype=torch.float32):
    return torch.tensor([x], dtype=dtype, device=DEV)


def _offset_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t living at element `offset` of a larger buffer (a misaligned view)."""
    buf = torch.zeros(t.numel() + offset + 8, dtype=t.dtype, device=t.device)
    view = buf[offset : offset + t.numel()]
    view.copy_(t)
    return view


@cuda
@needs_cuda
def test_cuda_dispatch_uses_extension():
    assert ops.backend_for(torch.zeros(1, device=DEV)) == "cuda-ext"


@cuda
@needs_cuda
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("specials", [False, True])
def test_cuda_grad_stats(n, layout, dtype, specials):
    table = make_table(n, layout)
    grad = make_grad(table, dtype, seed=n, specials=specials, device=DEV)
    inv = _scalar(0.25)
    base = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=DEV)
    stats = base.clone()
    front.grad_stats(grad, table, inv, stats, backend=CUDA_EXT)
    want = oracle_stats(grad, table, 0.25)
    assert_stats(stats - base, want, "kernel vs oracle")
    stats_ref = base.clone()
    front.grad_stats(grad, table, inv, stats_ref, backend="reference")
    assert torch.equal(stats[0], stats_ref[0]) and torch.equal(stats[2], stats_ref[2])
    if want[0] == 0:
        _assert_within(stats[1:2], stats_ref[1:2], rtol=2e-5, atol=0.0, what="sumsq vs reference")
    stats2 = base.clone()
    front.grad_stats(grad, table, inv, stats2, backend=CUDA_EXT)
    assert torch.equal(stats.view(torch.int64), stats2.view(torch.int64)), "two runs differ"


@cuda
@needs_cuda
@pytest.mark.parametrize("count_zeros", [True, False])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cuda_grad_stats_flags_and_views(count_zeros, offset):
    table = gapped_table(70001)
    grad = _offset_view(make_grad(table, torch.bfloat16, seed=4, specials=True, device=DEV), offset)
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(grad, table, _scalar(2.0), stats, count_zeros=count_zeros, backend=CUDA_EXT)
    assert_stats(stats, oracle_stats(grad, table, 2.0, count_zeros))


@cuda
@needs_cuda
def test_cuda_grad_stats_excluded_pieces_not_in_norm():
    table = PieceTable((0, 10, 30), (8, 20, 33), (True, False, True), (0, 0, 0), 40)
    grad = torch.zeros(40, device=DEV)
    grad[0:8], grad[10:20], grad[30:33] = 1.0, 1e6, 2.0
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(grad, table, _scalar(0.5), stats, backend=CUDA_EXT)
    assert stats[0].item() == 0.0 and stats[2].item() == 0.0
    assert stats[1].item() == pytest.approx(0.25 * (8 * 1.0 + 3 * 4.0), rel=1e-6)
    grad[12] = math.inf  # excluded from the norm, still counted as non-finite
    front.grad_stats(grad, table, _scalar(0.5), stats, backend=CUDA_EXT)
    assert stats[0].item() == 1.0 and math.isfinite(stats[1].item())


def _run_adamw(backend, grad, master, m, v, param_out, table, gs, step, lr=LR, wd=WD, found=None):
    front.adamw_step(grad, master, m, v, param_out, table, lr=lr, weight_decay=wd, grad_scale=_scalar(gs),
                   step=_scalar(step, torch.int64), beta1=BETA1, beta2=BETA2, eps=EPS, found_inf=found, backend=backend)


@cuda
@needs_cuda
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("pdtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_cuda_adamw(n, layout, gdtype, pdtype):
    table = make_table(n, layout)
    grad = make_grad(table, gdtype, seed=n + 3, finite_specials=True, device=DEV)
    master, m, v = make_state(table, seed=n, device=DEV)
    param_out = None if pdtype is None else torch.zeros(n, dtype=pdtype, device=DEV)
    W, M, V = oracle_adamw(grad, master, m, v, table, LR, WD, 0.5, 3)
    r_master, r_m, r_v, r_po = snapshot(master, m, v, param_out)
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 0.5, 3)
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(v, V, "exp_avg_sq")
    assert_fp32_close(master, W, "master")
    if param_out is not None:
        assert_param_out(param_out, master, W)
    # vs the reference on the same CUDA tensors (a few ulps apart at most)
    _run_adamw("reference", grad, r_master, r_m, r_v, r_po, table, 0.5, 3)
    for got, want, name in [(master, r_master, "master"), (m, r_m, "exp_avg"), (v, r_v, "exp_avg_sq")]:
        atol = 1e-7 * float(want.abs().max()) if n else 0.0
        _assert_within(got, want, rtol=1e-6, atol=atol, what=f"{name} vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("tname", GAP_TABLES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float32])
def test_cuda_adamw_gaps_untouched(tname, gdtype, pdtype):
    """Garbage in every gap (random bit patterns; NaN/inf in the grad's gaps): the kernel and the
    reference leave every gap element of master, moments and param_out bitwise unchanged; on the
    pieces the kernel matches its own zero-gap run bitwise, the oracle and the reference."""
    table = gap_table(tname)
    piece = piece_mask(table, DEV)
    gap = ~piece
    grad = make_grad(table, gdtype, seed=5, device=DEV)
    clean = make_state(table, seed=5, device=DEV)
    clean_po = torch.zeros(table.numel, dtype=pdtype, device=DEV)
    W, M, V = oracle_adamw(grad, *clean, table, LR, WD, 1.0, 1)
    dirty_grad = with_gap_garbage(grad, table, seed=50)
    dirty = [with_gap_garbage(t, table, seed=51 + i) for i, t in enumerate(clean)]
    dirty_po = with_gap_garbage(clean_po, table, seed=54)
    r = snapshot(*dirty, dirty_po)  # the reference's copies
    before = snapshot(dirty_grad, *dirty, dirty_po)
    _run_adamw(CUDA_EXT, grad, *clean, clean_po, table, 1.0, 1)
    _run_adamw(CUDA_EXT, dirty_grad, *dirty, dirty_po, table, 1.0, 1)
    _run_adamw("reference", dirty_grad, *r, table, 1.0, 1)
    names = ["master", "exp_avg", "exp_avg_sq", "param_out"]
    assert_gap_run(names, before, dirty_grad, [*clean, clean_po], [*dirty, dirty_po], r, gap, piece)
    master, m, v = dirty
    assert_fp32_close(master[piece], W[piece], "master")
    assert_fp32_close(m[piece], M[piece], "exp_avg")
    assert_fp32_close(v[piece], V[piece], "exp_avg_sq")
    assert_param_out(dirty_po[piece], master[piece], W[piece])
    for got, want, name in zip(dirty, r[:3], names):
        got, want = got[piece], want[piece]
        _assert_within(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()), what=f"{name} vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("tname", GAP_TABLES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("rule", ["sgd", "sgd-momentum", "sgd-nesterov"])
@pytest.mark.parametrize("pdtype", [None, torch.bfloat16])
def test_cuda_sgd_gaps_untouched(tname, gdtype, rule, pdtype):
    """As test_cuda_adamw_gaps_untouched, for SGD with and without (Nesterov) momentum."""
    table = gap_table(tname)
    piece = piece_mask(table, DEV)
    gap = ~piece
    momentum, nesterov = (0.0 if rule == "sgd" else 0.9), rule == "sgd-nesterov"
    grad = make_grad(table, gdtype, seed=6, finite_specials=True, device=DEV)
    master, buf, _ = make_state(table, seed=6, device=DEV)
    clean = [master, buf if momentum else None]
    clean_po = None if pdtype is None else torch.zeros(table.numel, dtype=pdtype, device=DEV)
    W, B = oracle_sgd(grad, clean[0], clean[1], table, LR, WD, 2.0, momentum, nesterov)
    dirty_grad = with_gap_garbage(grad, table, seed=60)
    dirty = [None if t is None else with_gap_garbage(t, table, seed=61 + i) for i, t in enumerate(clean)]
    dirty_po = None if pdtype is None else with_gap_garbage(clean_po, table, seed=63)
    r = snapshot(*dirty, dirty_po)  # the reference's copies
    before = snapshot(dirty_grad, *dirty, dirty_po)

    def run(backend, g, w, b, po):
        front.sgd_step(g, w, b, po, table, lr=LR, weight_decay=WD, grad_scale=_scalar(2.0), momentum=momentum,
                     nesterov=nesterov, backend=backend)

    run(CUDA_EXT, grad, *clean, clean_po)
    run(CUDA_EXT, dirty_grad, *dirty, dirty_po)
    run("reference", dirty_grad, *r)
    names = ["master", "momentum_buffer", "param_out"]
    assert_gap_run(names, before, dirty_grad, [*clean, clean_po], [*dirty, dirty_po], r, gap, piece)
    assert_fp32_close(dirty[0][piece], W[piece], "master")
    if momentum:
        assert_fp32_close(dirty[1][piece], B[piece], "momentum_buffer")
    if pdtype is not None:
        assert_param_out(dirty_po[piece], dirty[0][piece], W[piece])
    for got, want, name in zip(dirty, r[:2], names):
        if got is not None:
            got, want = got[piece], want[piece]
            _assert_within(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()), what=f"{name} vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("tname", GAP_TABLES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("specials", [False, True])
def test_cuda_grad_stats_ignore_gap_garbage(tname, dtype, specials):
    """Garbage in the grad's gaps: the kernel's stats are bitwise those of the zero-gap grad, the
    oracle's over the pieces, and the reference's counts."""
    table = gap_table(tname)
    grad = make_grad(table, dtype, seed=11, specials=specials, device=DEV)
    dirty = with_gap_garbage(grad, table, seed=12)
    before = dirty.clone()
    for count_zeros in (True, False):
        s_clean, s_dirty, s_ref = (torch.zeros(3, dtype=torch.float64, device=DEV) for _ in range(3))
        front.grad_stats(grad, table, _scalar(0.25), s_clean, count_zeros, backend=CUDA_EXT)
        front.grad_stats(dirty, table, _scalar(0.25), s_dirty, count_zeros, backend=CUDA_EXT)
        front.grad_stats(dirty, table, _scalar(0.25), s_ref, count_zeros, backend="reference")
        assert torch.equal(as_bits(s_dirty), as_bits(s_clean)), f"{s_dirty.tolist()} != {s_clean.tolist()}"
        assert_stats(s_dirty, oracle_stats(grad, table, 0.25, count_zeros), "kernel")
        assert torch.equal(s_dirty[0], s_ref[0]) and torch.equal(s_dirty[2], s_ref[2])
    assert torch.equal(as_bits(dirty), as_bits(before)), "grad written"


@cuda
@needs_cuda
@pytest.mark.parametrize("offsets",
                         [(1, 1, 1, 1, 1), (3, 3, 3, 3, 3), (1, 0, 0, 0, 0), (0, 0, 2, 0, 0), (0, 0, 0, 0, 5)])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_cuda_adamw_misaligned_views(offsets, gdtype):
    """Same phase everywhere -> vector path with a scalar head; different phases -> scalar path."""
    table = gapped_table(50021)
    go, wo, mo, vo, po = offsets
    grad = _offset_view(make_grad(table, gdtype, seed=9, device=DEV), go)
    master, m, v = make_state(table, seed=9, device=DEV)
    master, m, v = _offset_view(master, wo), _offset_view(m, mo), _offset_view(v, vo)
    param_out = _offset_view(torch.zeros(table.numel, dtype=torch.bfloat16, device=DEV), po)
    W, M, V = oracle_adamw(grad, master, m, v, table, LR, WD, 0.5, 2)
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 0.5, 2)
    assert_fp32_close(master, W, "master")
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(v, V, "exp_avg_sq")
    assert_param_out(param_out, master, W)


@cuda
@needs_cuda
def test_cuda_adamw_param_out_aliasing_fp32_master():
    table = gapped_table(9999)
    grad = make_grad(table, torch.bfloat16, seed=6, device=DEV)
    master, m, v = make_state(table, seed=6, device=DEV)
    W, _, _ = oracle_adamw(grad, master, m, v, table, LR, WD, 1.0, 4)
    _run_adamw(CUDA_EXT, grad, master, m, v, master, table, 1.0, 4)
    assert_fp32_close(master, W, "master")


@cuda
@needs_cuda
def test_cuda_adamw_many_groups_uploaded():
    """More groups than fit in the kernel arguments: the table is uploaded to the device."""
    table, lr, wd = many_groups_case()
    grad = make_grad(table, torch.float32, seed=8, device=DEV)
    master, m, v = make_state(table, seed=8, device=DEV)
    W, M, V = oracle_adamw(grad, master, m, v, table, lr, wd, 1.0, 5)
    _run_adamw(CUDA_EXT, grad, master, m, v, None, table, 1.0, 5, lr=lr, wd=wd)
    assert_fp32_close(master, W, "master")
    assert_fp32_close(m, M, "exp_avg")


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 9, 65537])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("pdtype", [None, torch.bfloat16, torch.float16])
def test_cuda_sgd(n, layout, gdtype, momentum, nesterov, pdtype):
    table = make_table(n, layout)
    grad = make_grad(table, gdtype, seed=n + 5, finite_specials=True, device=DEV)
    master, buf, _ = make_state(table, seed=n, device=DEV)
    buf = buf if momentum else None
    param_out = None if pdtype is None else torch.zeros(n, dtype=pdtype, device=DEV)
    W, B = oracle_sgd(grad, master, buf, table, LR, WD, 2.0, momentum, nesterov)
    r = snapshot(master, buf, param_out)
    front.sgd_step(grad, master, buf, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(2.0),
                 momentum=momentum, nesterov=nesterov, backend=CUDA_EXT)
    assert_fp32_close(master, W, "master")
    if buf is not None:
        assert_fp32_close(buf, B, "momentum_buffer")
    if param_out is not None:
        assert_param_out(param_out, master, W)
    front.sgd_step(grad, r[0], r[1], r[2], table, lr=LR, weight_decay=WD, grad_scale=_scalar(2.0),
                 momentum=momentum, nesterov=nesterov, backend="reference")
    atol = 1e-7 * float(r[0].abs().max())
    _assert_within(master, r[0], rtol=1e-6, atol=atol, what="master vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("found", [None, 0.0, 1.0, math.nan, math.inf])
def test_cuda_advance_step(found):
    step = _scalar(5, torch.int64)
    ops.advance_step(step, None if found is None else _scalar(found), backend=CUDA_EXT)
    assert step.item() == (6 if found in (None, 0.0) else 5)


@cuda
@needs_cuda
@pytest.mark.parametrize("found", [1.0, math.nan, -2.0])
def test_cuda_found_inf_skips_everything(found):
    table = gapped_table(300007)
    grad = make_grad(table, torch.bfloat16, seed=2, device=DEV)
    master, m, v = make_state(table, seed=2, device=DEV, gap_value=3.0)
    param_out = master.to(torch.bfloat16)
    flag = _scalar(found)
    before = snapshot(master, m, v, param_out, grad)
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 1.0, 1, found=flag)
    torch.cuda.synchronize()
    assert_bitwise_unchanged(before, [master, m, v, param_out, grad],
                             ["master", "exp_avg", "exp_avg_sq", "param_out", "grad"])
    buf = torch.randn(table.numel, device=DEV)
    before = snapshot(master, buf, param_out)
    front.sgd_step(grad, master, buf, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(1.0),
                 momentum=0.9, found_inf=flag, backend=CUDA_EXT)
    assert_bitwise_unchanged(before, [master, buf, param_out], ["master", "momentum_buffer", "param_out"])
    # a zero flag runs the step
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 1.0, 1, found=_scalar(0.0))
    assert not torch.equal(master, before[0])


@cuda
@needs_cuda
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_cuda_large_shard(gdtype):
    """A few million elements, many blocks per piece, against the oracle; two runs bitwise equal."""
    table = gapped_table(3_000_017)
    grad = make_grad(table, gdtype, seed=21, device=DEV)
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(grad, table, _scalar(0.5), stats, backend=CUDA_EXT)
    assert_stats(stats, oracle_stats(grad, table, 0.5))
    master, m, v = make_state(table, seed=21, device=DEV)
    param_out = torch.zeros(table.numel, dtype=torch.bfloat16, device=DEV)
    init = snapshot(master, m, v)
    W, M, V = oracle_adamw(grad, master, m, v, table, LR, WD, 0.5, 7)
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 0.5, 7)
    assert_fp32_close(master, W, "master")
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(v, V, "exp_avg_sq")
    assert_param_out(param_out, master, W)
    first = snapshot(master, m, v, param_out)
    master.copy_(init[0]), m.copy_(init[1]), v.copy_(init[2])
    _run_adamw(CUDA_EXT, grad, master, m, v, param_out, table, 0.5, 7)
    for a, b in zip(first, [master, m, v, param_out]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "two runs differ"


@cuda
@needs_cuda
def test_cuda_grad_stats_beyond_int32():
    """More than 2^31 elements in one shard (int64 indexing); skipped when memory is short."""
    n = 2**31 + 1000
    free, _ = torch.cuda.mem_get_info()
    if free < n * 2 * 2.5:
        pytest.skip("not enough free GPU memory for a 2^31-element bf16 shard")
    table = PieceTable((5, 2**31 - 7), (2**31 - 9, n - 3), (True, True), (0, 0), n)
    grad = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    grad[n - 4] = math.inf
    grad[n - 10] = 0.0
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    front.grad_stats(grad, table, _scalar(0.5), stats, backend=CUDA_EXT)
    assert stats[0].item() == 1.0 and stats[2].item() == 1.0
    grad[n - 4] = 1.0
    stats.zero_()
    front.grad_stats(grad, table, _scalar(0.5), stats, backend=CUDA_EXT)
    covered = table.covered
    assert stats[1].item() == pytest.approx(0.25 * (covered - 1), rel=1e-6)


@cuda
@needs_cuda
def test_cuda_graph_capture_and_replay():
    table = gapped_table(1 << 20)
    n = table.numel
    grads = [make_grad(table, torch.bfloat16, seed=s, device=DEV) for s in (31, 32)]
    grad = grads[0].clone()
    master, m, v = make_state(table, seed=31, device=DEV)
    param_out = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    stats = torch.zeros(3, dtype=torch.float64, device=DEV)
    inv, gs, step = _scalar(0.5), _scalar(0.5), _scalar(1, torch.int64)
    init = snapshot(master, m, v, param_out, step)

    def one_step():
        stats.zero_()
        front.grad_stats(grad, table, inv, stats, backend=CUDA_EXT)
        ops.advance_step(step, backend=CUDA_EXT)
        front.adamw_step(grad, master, m, v, param_out, table, lr=LR, weight_decay=WD, grad_scale=gs, step=step,
                       beta1=BETA1, beta2=BETA2, eps=EPS, backend=CUDA_EXT)

    def restore():
        for t, i in zip([master, m, v, param_out, step], init):
            t.copy_(i)

    eager = []
    for g in grads:  # two eager steps
        grad.copy_(g)
        one_step()
        eager.append(snapshot(stats, master, m, v, param_out, step))
    restore()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one_step()  # warm-up on a side stream, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_step()
    restore()
    for g, want in zip(grads, eager):
        grad.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(want, [stats, master, m, v, param_out, step]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "replay differs from eager"


# =================================================================================================
# The Python wrapper (ops/cuda.py): validation, and argument passing into the compiled module.
# On CPU this runs whenever the extension is built: the wrapper's device check is bypassed, so the
# call reaches megatron_opt._C, whose first TORCH_CHECK rejects CPU tensors. A pybind signature
# mismatch would raise TypeError instead.
# =================================================================================================
needs_ext = pytest.mark.skipif(not ops.HAS_CUDA_EXT, reason=f"extension not built: {ops.CUDA_EXT_ERROR}")


@needs_ext
def test_wrapper_arguments_reach_the_extension(monkeypatch):
    from megatron_opt.ops import cuda as cuda_wrapper

    monkeypatch.setattr(cuda_wrapper, "cuda_device", lambda op, grad: grad.device)
    table = gapped_table(100)
    n = table.numel
    f32 = lambda: torch.zeros(n)  # noqa: E731
    one = torch.ones(1)
    step = torch.ones(1, dtype=torch.int64)
    stats = torch.zeros(3, dtype=torch.float64)
    cuda_only = pytest.raises(RuntimeError, match="must be a CUDA tensor")
    with cuda_only:
        front.grad_stats(torch.zeros(n, dtype=torch.bfloat16), table, one, stats, count_zeros=False, backend=CUDA_EXT)
    for po in (None, torch.zeros(n, dtype=torch.bfloat16)):
        with cuda_only:
            front.adamw_step(f32(), f32(), f32(), f32(), po, table, lr=LR, weight_decay=WD, grad_scale=one,
                           step=step, beta1=BETA1, beta2=BETA2, eps=EPS, found_inf=None, backend=CUDA_EXT)
        with cuda_only:
            front.adamw_step(f32(), f32(), f32(), f32(), po, table, lr=LR, weight_decay=WD, grad_scale=one,
                           step=step, beta1=BETA1, beta2=BETA2, eps=EPS, found_inf=torch.zeros(1), backend=CUDA_EXT)
        with cuda_only:
            front.sgd_step(f32(), f32(), f32(), po, table, lr=LR, weight_decay=WD, grad_scale=one, momentum=0.9,
                         nesterov=True, found_inf=torch.zeros(1), backend=CUDA_EXT)
        with cuda_only:
            front.sgd_step(f32(), f32(), None, po, table, lr=LR, weight_decay=WD, grad_scale=one, momentum=0.0,
                         backend=CUDA_EXT)
    with cuda_only:
        cuda_wrapper.kernels.advance_step(step, None)
    with cuda_only:
        cuda_wrapper.kernels.advance_step(step, torch.zeros(1))


def test_wrapper_validation(wrapper):
    backend, dev = wrapper
    table = full_table(16)
    grad = torch.zeros(16, device=dev)
    one = torch.ones(1, device=dev)
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    with pytest.raises(TypeError, match="dtype"):
        front.grad_stats(grad.double(), table, one, stats, backend=backend)
    with pytest.raises(ValueError, match="elements"):
        front.grad_stats(grad[:8], table, one, stats, backend=backend)
    with pytest.raises(ValueError, match="contiguous"):
        front.grad_stats(torch.zeros(32, device=dev)[::2], table, one, stats, backend=backend)
    with pytest.raises(ValueError, match="1-D"):
        front.grad_stats(torch.zeros(4, 4, device=dev), table, one, stats, backend=backend)
    with pytest.raises(ValueError, match="one element"):
        front.grad_stats(grad, table, torch.ones(2, device=dev), stats, backend=backend)
    with pytest.raises(TypeError, match="float64"):
        front.grad_stats(grad, table, one, stats.float(), backend=backend)
    master, m, v = (torch.zeros(16, device=dev) for _ in range(3))
    step = torch.ones(1, dtype=torch.int64, device=dev)
    kw = dict(grad_scale=one, step=step, beta1=BETA1, beta2=BETA2, eps=EPS)
    with pytest.raises(ValueError, match="group"):
        front.adamw_step(grad, master, m, v, None, table, lr=[], weight_decay=[], **kw, backend=backend)
    with pytest.raises(ValueError, match="entries"):
        front.adamw_step(grad, master, m, v, None, table, lr=[1.0], weight_decay=[0.0, 1.0], **kw, backend=backend)
    with pytest.raises(TypeError, match="int64"):
        front.adamw_step(grad, master, m, v, None, table, lr=[1.0], weight_decay=[0.0],
                       **{**kw, "step": torch.ones(1, device=dev)}, backend=backend)
    with pytest.raises(ValueError, match="overlap"):
        front.adamw_step(grad, master, master, v, None, table, lr=[1.0], weight_decay=[0.0], **kw, backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        front.adamw_step(grad, master, m, v, torch.zeros(16, dtype=torch.float64, device=dev), table, lr=[1.0],
                       weight_decay=[0.0], **kw, backend=backend)
    with pytest.raises(ValueError, match="momentum buffer"):
        front.sgd_step(grad, master, None, None, table, lr=[1.0], weight_decay=[0.0], grad_scale=one, momentum=0.9,
                     backend=backend)
    with pytest.raises(ValueError, match="CUDA"):
        ops.advance_step(torch.ones(1, dtype=torch.int64), backend=backend)
    if dev.type == "cuda":
        with pytest.raises(TypeError, match="int64"):
            ops.advance_step(torch.ones(1, device=dev), backend=backend)
