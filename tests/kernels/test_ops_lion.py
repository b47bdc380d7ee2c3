"""Lion pass 2 (``ops.lion_step``): the reference against a float64 closed form, and the CUDA kernel
against the reference and the closed form.

CPU part (always runs): ops.reference.lion_step vs the oracle below over several steps (pieces, gaps,
two param groups, a param straddling two ranks' shards), the found_inf skip, the 'cpu' and
'reference' backends of ops.lion_step agreeing bitwise, and garbage in the gaps left bitwise unchanged.
CUDA part (``@pytest.mark.cuda``; skipped without a GPU or without the compiled extension): the kernel of
megatron_opt.ops.cuda vs the oracle and vs the reference run on the same CUDA tensors, for fp32/bf16/fp16
grads and param_out dtypes, garbage in the padding gaps left bitwise untouched, the found_inf skip, misaligned
views and more param groups than travel in the kernel arguments. The wrapper tests also run on CPU whenever
the extension is built (its device check is bypassed so the call reaches the compiled module).

Lion: c = beta1*m + (1-beta1)*g;  w = w*(1 - lr*wd) - lr*sign(c);  m = beta2*m + (1-beta2)*g,
with g = grad * grad_scale and sign(0) = sign(NaN) = 0 (torch.sign).
"""
from __future__ import annotations

import math

import pytest
import torch

import megatron_opt.ops as ops
from tests.kernels import front
from megatron_opt.ops.piece_table import PieceTable, full_table
from tests.support.gap_helpers import (as_bits, assert_gap_run, assert_gaps_unchanged, gapped_bounds, many_groups_case,
                                       piece_mask, with_gap_garbage)
from tests.support.common import assert_within as _assert_within

LR = [1e-2, 3e-3]
WD = [0.1, 0.0]  # group 1 has no decay: the kernel's `decay != 0` branch is taken both ways
BETA1, BETA2 = 0.9, 0.99
# (1 - beta) < 0.5 takes torch lerp's `start + w*(end - start)` form, >= 0.5 its `end - (1-w)*(end - start)` form
BETAS = [(BETA1, BETA2), (0.3, 0.45)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

HAS_GPU_EXT = torch.cuda.is_available() and ops.HAS_CUDA_EXT
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(
    not HAS_GPU_EXT,
    reason=f"needs a CUDA device and the compiled extension (cuda available: {torch.cuda.is_available()}, "
    f"extension: {ops.HAS_CUDA_EXT}, {ops.CUDA_EXT_ERROR})",
)
needs_ext = pytest.mark.skipif(not ops.HAS_CUDA_EXT, reason=f"extension not built: {ops.CUDA_EXT_ERROR}")


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# =================================================================================================
# Inputs
# =================================================================================================
def gapped_table(n: int, ngroups: int = 2) -> PieceTable:
    """Pieces with gaps (and touching pieces), a misaligned first start, odd lengths, the groups
    alternating so that runs of equal group span gaps and touching pieces change group."""
    if n == 0:
        return PieceTable((), (), (), (), 0)
    starts, ends = gapped_bounds(n)
    group = tuple((0, 1, 1, 0)[i % 4] % ngroups for i in range(len(starts)))
    return PieceTable(tuple(starts), tuple(ends), (True,) * len(starts), group, n)


def make_table(n: int, layout: str) -> PieceTable:
    return full_table(n) if layout == "full" else gapped_table(n)


def make_grad(table: PieceTable, dtype: torch.dtype, seed: int, specials: bool = False, device="cpu") -> torch.Tensor:
    """Random grads in the pieces, exact zeros in the gaps and at every 13th element (where
    make_state also plants m = 0 on every other one, so c is exactly 0 there); with ``specials``,
    inf/-inf/NaN/-0.0/subnormals at piece heads and tails."""
    gen = torch.Generator().manual_seed(seed)
    n = table.numel
    g = torch.randn(n, generator=gen) * 3.0
    if n:
        g[torch.arange(0, n, 13)] = 0.0
    if specials:
        tiny = torch.finfo(dtype).smallest_normal / 4
        vals = [math.inf, math.nan, -0.0, -math.inf, tiny, 0.0, -tiny]
        k = 0
        for s, e in zip(table.starts, table.ends):
            for idx in sorted({s, e - 1, min(s + 8, e - 1)}):
                g[idx] = vals[k % len(vals)]
                k += 1
    if n:
        g = torch.where(piece_mask(table), g, torch.zeros_like(g))
    return g.to(dtype).to(device)


def make_state(table: PieceTable, seed: int, device="cpu", gap_value: float = 0.0):
    """master ~ N(0, 1), exp_avg ~ 0.5 * N(0, 1) with exact zeros at every 26th element; gaps = gap_value."""
    gen = torch.Generator().manual_seed(seed + 1000)
    n = table.numel
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.5
    if n:
        m[torch.arange(0, n, 26)] = 0.0
    mask = piece_mask(table)
    return [torch.where(mask, t, torch.full_like(t, gap_value)).to(device) for t in (master, m)]


def _scalar(x, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([x], dtype=dtype, device=device)


# =================================================================================================
# float64 oracle (closed form, not torch's lerp)
# =================================================================================================
def oracle_lion(grad, master, m, table, lr, wd, grad_scale, beta1=BETA1, beta2=BETA2, near_tie=None):
    """One Lion step in float64 over the pieces only; returns (W, M, near_tie) on the CPU.

    near_tie (accumulated over steps when passed back in) marks the elements whose c was so close to
    0, relative to the fp32 rounding error of the op under test, that its sign may legitimately
    differ from the float64 one; assert_fp32_close(skip=near_tie) leaves them out of the w check."""
    g = grad.detach().cpu().double() * grad_scale
    W, M = master.detach().cpu().double().clone(), m.detach().cpu().double().clone()
    tie = torch.zeros(table.numel, dtype=torch.bool) if near_tie is None else near_tie.clone()
    finite_m = M[torch.isfinite(M)]
    m_scale = float(finite_m.abs().max()) if finite_m.numel() else 0.0
    for s, e, gid in zip(table.starts, table.ends, table.group):
        c = beta1 * M[s:e] + (1 - beta1) * g[s:e]
        sign = (c > 0).double() - (c < 0).double()  # torch.sign: 0 for +-0 and NaN
        bound = 1e-5 * ((beta1 * M[s:e]).abs() + ((1 - beta1) * g[s:e]).abs()) + 1e-6 * m_scale
        tie[s:e] |= (c != 0) & (c.abs() <= bound) & torch.isfinite(bound)
        W[s:e] = W[s:e] * (1 - lr[gid] * wd[gid]) - lr[gid] * sign
        M[s:e] = beta2 * M[s:e] + (1 - beta2) * g[s:e]
    return W, M, tie


# =================================================================================================
# Comparisons
# =================================================================================================
def assert_fp32_close(out: torch.Tensor, want: torch.Tensor, what: str, skip: torch.Tensor | None = None) -> None:
    """A few fp32 roundings: rtol 2e-6 and atol 1e-7 * max|want| (what a single step allows, and
    still more than several steps need). ``skip``: near ties of sign(c) (see oracle_lion), at most
    a few per thousand elements, left out."""
    assert out.dtype == torch.float32
    out, want = out.detach().cpu(), want.detach().cpu()
    if skip is not None:
        assert int(skip.sum()) <= 2 + 2e-3 * skip.numel(), f"{what}: {int(skip.sum())} near ties of sign(c)"
        out, want = out[~skip], want[~skip]
    finite = want[torch.isfinite(want)]
    atol = 1e-7 * float(finite.abs().max()) if finite.numel() else 0.0
    _assert_within(out, want, rtol=2e-6, atol=atol, what=what)


def assert_param_out(param_out: torch.Tensor, master: torch.Tensor, W: torch.Tensor, mask: torch.Tensor,
                     skip: torch.Tensor | None = None) -> None:
    """param_out is exactly the rounding of the op's own fp32 master, and near the oracle."""
    assert torch.equal(param_out[mask], master[mask].to(param_out.dtype)), "param_out is not the rounded master"
    mask = mask.cpu() if skip is None else mask.cpu() & ~skip
    rtol = max(torch.finfo(param_out.dtype).eps, 1e-5)  # one rounding of a master within the fp32 tolerance
    _assert_within(param_out.cpu()[mask], W[mask], rtol=rtol, atol=1e-6, what="param_out vs oracle")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(bits(a), bits(b)), f"{what} differs bitwise"


# =================================================================================================
# CPU: reference vs the float64 closed form
# =================================================================================================
@pytest.mark.parametrize("n", [1, 9, 4099])
@pytest.mark.parametrize("layout", ["full", "gapped"])
@pytest.mark.parametrize("gdtype,pdtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float32), (torch.float32, torch.float16)])
@pytest.mark.parametrize("betas", BETAS)
def test_reference_lion_matches_closed_form_over_steps(n, layout, gdtype, pdtype, betas):
    beta1, beta2 = betas
    table = make_table(n, layout)
    lr, wd = (LR, WD) if layout == "gapped" else (LR[:1], WD[:1])
    master, m = make_state(table, seed=n)
    W, M = master.double(), m.double()
    param_out = None if pdtype is None else torch.full((n,), 5.0, dtype=pdtype)
    mask = piece_mask(table)
    tie = None
    for t in range(6):
        grad = make_grad(table, gdtype, seed=100 * n + t)
        gs = (0.5, 2.0, 1.0)[t % 3]
        W, M, tie = oracle_lion(grad, W, M, table, lr, wd, gs, beta1, beta2, tie)
        front.lion_step(grad, master, m, param_out, table, lr=lr, weight_decay=wd, grad_scale=_scalar(gs),
                      beta1=beta1, beta2=beta2, backend="reference")
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(master, W, "master", skip=tie)
    # gaps hold g = m = w = 0 and stay 0
    assert torch.all(master[~mask] == 0) and torch.all(m[~mask] == 0)
    if param_out is not None:
        assert_param_out(param_out, master, W, mask, skip=tie)
        span = table.span()
        assert torch.all(param_out[: span[0]] == 5.0) and torch.all(param_out[span[1]:] == 5.0)


def test_reference_lion_sign_of_zero_and_group_lr():
    """c == 0 exactly (m = g = 0) moves w by decay only; the step is lr per group, not per element."""
    table = PieceTable((0, 6), (4, 10), (True, True), (0, 1), 12)
    grad = torch.tensor([0.0, 1.0, -1.0, 0.0, 0, 0, 2.0, -3.0, 0.0, 0.0, 0, 0])
    master = torch.tensor([1.0, 1.0, 1.0, -1.0, 0, 0, 1.0, 1.0, 1.0, 2.0, 0, 0])
    m = torch.tensor([0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, 0.5, -0.5, 0, 0])
    lr, wd = [0.25, 0.125], [0.5, 0.0]
    front.lion_step(grad, master, m, None, table, lr=lr, weight_decay=wd, grad_scale=_scalar(1.0), beta1=BETA1,
                  beta2=BETA2, backend="reference")
    d = 1 - 0.25 * 0.5
    want_w = [d, d - 0.25, d + 0.25, -d, 0, 0, 1 - 0.125, 1 + 0.125, 1 - 0.125, 2 + 0.125, 0, 0]
    assert master.tolist() == pytest.approx(want_w, rel=1e-7, abs=0)
    want_m = [0.0, 0.01, -0.01, 0.0, 0, 0, 0.02, -0.03, 0.99 * 0.5, -0.99 * 0.5, 0, 0]
    assert m.tolist() == pytest.approx(want_m, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
def test_reference_lion_specials(gdtype):
    """inf grads push w by lr*sign(inf) and m to inf; NaN grads give sign 0 (w moves by decay only) and m NaN."""
    table = gapped_table(3000)
    grad = make_grad(table, gdtype, seed=3, specials=True)
    master, m = make_state(table, seed=3)
    param_out = torch.zeros(table.numel, dtype=torch.bfloat16)
    W, M, tie = oracle_lion(grad, master, m, table, LR, WD, 0.5)
    assert bool(torch.isnan(M).any()) and bool(torch.isinf(M).any())
    front.lion_step(grad, master, m, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(0.5), beta1=BETA1,
                  beta2=BETA2, backend="reference")
    assert torch.isfinite(master).all(), "a NaN moment must not reach the weights (torch.sign(NaN) == 0)"
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(master, W, "master", skip=tie)
    assert_param_out(param_out, master, W, piece_mask(table), skip=tie)


def test_reference_lion_param_straddling_two_shards():
    """ZeRO-1: a flat buffer of three params cut into two ranks' shards, the middle param straddling
    the boundary. Each rank steps its own shard (its own piece table, local coordinates) for several
    steps; together they must equal the closed form on the whole unsharded buffer."""
    # params (start, end, group) in the global buffer; 9 and 41..47 are padding
    params = [(0, 9, 0), (12, 41, 1), (47, 60, 0)]
    shard = 32  # rank 0 owns [0, 32), rank 1 owns [32, 64); param 1 straddles 32
    total = 2 * shard
    glob = PieceTable(tuple(p[0] for p in params), tuple(p[1] for p in params), (True,) * 3,
                      tuple(p[2] for p in params), total)
    tables = []
    for r in range(2):
        lo, hi = r * shard, (r + 1) * shard
        pieces = [(max(s, lo) - lo, min(e, hi) - lo, gid) for s, e, gid in params if s < hi and e > lo]
        tables.append(PieceTable(tuple(p[0] for p in pieces), tuple(p[1] for p in pieces), (True,) * len(pieces),
                                 tuple(p[2] for p in pieces), shard))
    assert tables[0].ends[-1] == shard and tables[1].starts[0] == 0  # the straddling param is cut
    master, m = make_state(glob, seed=11)
    W, M = master.double(), m.double()
    param_out = torch.zeros(total, dtype=torch.bfloat16)
    tie = None
    for t in range(5):
        grad = make_grad(glob, torch.bfloat16, seed=20 + t)
        W, M, tie = oracle_lion(grad, W, M, glob, LR, WD, 0.25, near_tie=tie)
        for r in range(2):
            sl = slice(r * shard, (r + 1) * shard)
            front.lion_step(grad[sl], master[sl], m[sl], param_out[sl], tables[r], lr=LR, weight_decay=WD,
                          grad_scale=_scalar(0.25), beta1=BETA1, beta2=BETA2, backend="reference")
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(master, W, "master", skip=tie)
    assert_param_out(param_out, master, W, piece_mask(glob), skip=tie)


# =================================================================================================
# CPU: the found_inf skip and the backends
# =================================================================================================
@pytest.mark.parametrize("found", [1.0, math.nan, math.inf, -2.0])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_lion_found_inf_skips_everything(found, backend):
    table = gapped_table(5000)
    grad = make_grad(table, torch.bfloat16, seed=2)
    master, m = make_state(table, seed=2, gap_value=3.0)
    param_out = master.to(torch.bfloat16)
    before = [t.clone() for t in (grad, master, m, param_out)]
    front.lion_step(grad, master, m, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(1.0),
                  beta1=BETA1, beta2=BETA2, found_inf=_scalar(found), backend=backend)
    for b, a, name in zip(before, (grad, master, m, param_out), ("grad", "master", "exp_avg", "param_out")):
        assert_bitwise_equal(a, b, f"{name} on a skipped step:")
    # a zero flag runs the step
    front.lion_step(grad, master, m, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(1.0),
                  beta1=BETA1, beta2=BETA2, found_inf=_scalar(0.0), backend=backend)
    assert not torch.equal(master, before[1]) and not torch.equal(m, before[2])


@pytest.mark.parametrize("gdtype,pdtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float16)])
@pytest.mark.parametrize("specials", [False, True])
def test_lion_cpu_and_reference_backends_agree_bitwise(gdtype, pdtype, specials, monkeypatch):
    monkeypatch.delenv("MEGATRON_OPT_OPS", raising=False)
    table = gapped_table(4099)
    results = []
    for backend in ("cpu", "reference", "auto"):
        master, m = make_state(table, seed=4)
        param_out = None if pdtype is None else torch.zeros(table.numel, dtype=pdtype)
        for t in range(3):
            grad = make_grad(table, gdtype, seed=40 + t, specials=specials and t == 0)
            front.lion_step(grad, master, m, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(0.5),
                          beta1=BETA1, beta2=BETA2, backend=backend)
        results.append((master, m, param_out))
    assert ops.resolve_backend(torch.zeros(1), "auto") == "cpu"
    for other, name in zip(results[1:], ("reference", "auto")):
        for a, b, what in zip(results[0], other, ("master", "exp_avg", "param_out")):
            if a is not None:
                assert_bitwise_equal(a, b, f"{what} (cpu vs {name})")


def _gap_table(name: str) -> PieceTable:
    """gapped_table (runs of two pieces with a gap inside) or, "one-run", its pieces in one group
    (a single run over the whole span), 4099 elements or, "-large", 65537 (16x longer gaps)."""
    t = gapped_table(65537 if name.endswith("-large") else 4099)
    group = (0,) * t.num_pieces if name.startswith("one-run") else t.group
    return PieceTable(t.starts, t.ends, t.in_norm, group, t.numel)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("tname", ["pairs", "one-run", "one-run-large"])
@pytest.mark.parametrize("gdtype,pdtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float32)])
@pytest.mark.parametrize("betas", BETAS)
def test_lion_gap_garbage_untouched(backend, tname, gdtype, pdtype, betas):
    """Pass 2 writes piece elements only: with garbage in every gap (NaN/inf grads included) each
    gap element of master, exp_avg and param_out stays bitwise as it was, over several steps, and
    the pieces come out bitwise as with zero gaps."""
    table = _gap_table(tname)
    gap = ~piece_mask(table)
    lr, wd = (LR[:1], WD[:1]) if tname.startswith("one-run") else (LR, WD)
    clean = make_state(table, seed=8)
    clean_po = None if pdtype is None else torch.zeros(table.numel, dtype=pdtype)
    dirty = [with_gap_garbage(t, table, seed=80 + i) for i, t in enumerate(clean)]
    dirty_po = None if pdtype is None else with_gap_garbage(clean_po, table, seed=82)
    names = ("master", "exp_avg", "param_out")
    for t in range(3):
        grad = make_grad(table, gdtype, seed=90 + t, specials=t == 1)
        dirty_grad = with_gap_garbage(grad, table, seed=95 + t)
        grad_before, before = dirty_grad.clone(), [x.clone() if x is not None else None for x in (*dirty, dirty_po)]
        for g, (master, m), po in ((grad, clean, clean_po), (dirty_grad, dirty, dirty_po)):
            front.lion_step(g, master, m, po, table, lr=lr, weight_decay=wd, grad_scale=_scalar(0.5),
                          beta1=betas[0], beta2=betas[1], backend=backend)
        assert_gaps_unchanged(before, (*dirty, dirty_po), gap, names, f"step {t}")
        assert_bitwise_equal(dirty_grad, grad_before, "grad")
        for c, d, name in zip((*clean, clean_po), (*dirty, dirty_po), names):
            if c is not None:
                assert torch.equal(as_bits(d)[~gap], as_bits(c)[~gap]), f"step {t}: {name} pieces differ"


def test_lion_empty_table_is_a_no_op():
    table = PieceTable((), (), (), (), 8)
    master, m = torch.randn(8), torch.randn(8)
    before = [master.clone(), m.clone()]
    for backend in ("cpu", "reference"):
        front.lion_step(torch.randn(8), master, m, None, table, lr=LR, weight_decay=WD, grad_scale=_scalar(1.0),
                      beta1=BETA1, beta2=BETA2, backend=backend)
    assert torch.equal(master, before[0]) and torch.equal(m, before[1])


# =================================================================================================
# CUDA: the kernel vs the oracle and vs the reference
# =================================================================================================
DEV = "cuda"


CUDA_EXT = "cuda-ext"  # the backend of the CUDA tests: the compiled extension, through the public fronts


def _run(backend, grad, master, m, param_out, table, gs, lr=LR, wd=WD, found=None, betas=(BETA1, BETA2)):
    front.lion_step(grad, master, m, param_out, table, lr=lr, weight_decay=wd, grad_scale=_scalar(gs, grad.device),
                  beta1=betas[0], beta2=betas[1], found_inf=found, backend=backend)


def _offset_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t living at element `offset` of a larger buffer (a misaligned view)."""
    buf = torch.zeros(t.numel() + offset + 8, dtype=t.dtype, device=t.device)
    view = buf[offset : offset + t.numel()]
    view.copy_(t)
    return view


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 65537])
@pytest.mark.parametrize("layout", ["full", "gapped"])
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("pdtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("betas", BETAS)
def test_cuda_lion(n, layout, gdtype, pdtype, betas):
    table = make_table(n, layout)
    lr, wd = (LR, WD) if layout == "gapped" else (LR[:1], WD[:1])
    master, m = make_state(table, seed=n, device=DEV)
    param_out = None if pdtype is None else torch.zeros(n, dtype=pdtype, device=DEV)
    r_master, r_m = master.clone(), m.clone()
    r_po = None if param_out is None else param_out.clone()
    W, M, tie = master.double().cpu(), m.double().cpu(), None
    for t in range(3):
        grad = make_grad(table, gdtype, seed=n + t, device=DEV)
        W, M, tie = oracle_lion(grad, W, M, table, lr, wd, 0.5, *betas, near_tie=tie)
        _run(CUDA_EXT, grad, master, m, param_out, table, 0.5, lr, wd, betas=betas)
        _run("reference", grad, r_master, r_m, r_po, table, 0.5, lr, wd, betas=betas)
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(master, W, "master", skip=tie)
    mask = piece_mask(table, DEV)
    if param_out is not None:
        assert_param_out(param_out, master, W, mask, skip=tie)
        assert torch.all(param_out[~mask] == 0), "param_out written in a padding gap"
    # vs the reference on the same CUDA tensors (the same op sequence: at most an ulp apart)
    for got, want, name, keep in [(master, r_master, "master", ~tie), (m, r_m, "exp_avg", None)]:
        got, want = got.cpu(), want.cpu()
        if keep is not None:
            got, want = got[keep], want[keep]
        atol = 1e-7 * float(want.abs().max()) if want.numel() else 0.0
        _assert_within(got, want, rtol=1e-6, atol=atol, what=f"{name} vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
def test_cuda_lion_specials(gdtype):
    table = gapped_table(20011)
    grad = make_grad(table, gdtype, seed=3, specials=True, device=DEV)
    master, m = make_state(table, seed=3, device=DEV)
    param_out = torch.zeros(table.numel, dtype=torch.bfloat16, device=DEV)
    W, M, tie = oracle_lion(grad, master, m, table, LR, WD, 0.5)
    _run(CUDA_EXT, grad, master, m, param_out, table, 0.5)
    assert torch.isfinite(master).all(), "a NaN moment must not reach the weights (torch.sign(NaN) == 0)"
    assert_fp32_close(m, M, "exp_avg")
    assert_fp32_close(master, W, "master", skip=tie)
    assert_param_out(param_out, master, W, piece_mask(table, DEV), skip=tie)


@cuda
@needs_cuda
@pytest.mark.parametrize("tname", ["pairs", "one-run", "one-run-large"])
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_lion_gaps_untouched(tname, gdtype, pdtype):
    """Garbage in every gap (random bit patterns; NaN/inf in the grad's gaps): the kernel and the
    reference leave every gap element of master, exp_avg and param_out bitwise unchanged; on the
    pieces the kernel matches its own zero-gap run bitwise, the oracle and the reference."""
    table = _gap_table(tname)
    lr, wd = (LR[:1], WD[:1]) if tname.startswith("one-run") else (LR, WD)
    piece_cpu = piece_mask(table)
    piece = piece_cpu.to(DEV)
    gap = ~piece
    grad = make_grad(table, gdtype, seed=5, device=DEV)
    clean = make_state(table, seed=5, device=DEV)
    clean_po = torch.zeros(table.numel, dtype=pdtype, device=DEV)
    W, M, tie = oracle_lion(grad, *clean, table, lr, wd, 1.0)
    dirty_grad = with_gap_garbage(grad, table, seed=50)
    dirty = [with_gap_garbage(t, table, seed=51 + i) for i, t in enumerate(clean)]
    dirty_po = with_gap_garbage(clean_po, table, seed=53)
    r = [t.clone() for t in (*dirty, dirty_po)]  # the reference's copies
    before = [t.clone() for t in (dirty_grad, *dirty, dirty_po)]
    _run(CUDA_EXT, grad, *clean, clean_po, table, 1.0, lr, wd)
    _run(CUDA_EXT, dirty_grad, *dirty, dirty_po, table, 1.0, lr, wd)
    _run("reference", dirty_grad, *r, table, 1.0, lr, wd)
    names = ("master", "exp_avg", "param_out")
    assert_gap_run(names, before, dirty_grad, (*clean, clean_po), (*dirty, dirty_po), r, gap, piece)
    master, m = dirty
    assert_fp32_close(master.cpu()[piece_cpu], W[piece_cpu], "master", skip=tie[piece_cpu])
    assert_fp32_close(m.cpu()[piece_cpu], M[piece_cpu], "exp_avg")
    assert_param_out(dirty_po, master, W, piece, skip=tie)
    # vs the reference on the same CUDA tensors, pieces only (near ties of sign(c) left out)
    for got, want, name, keep in [(master, r[0], "master", piece_cpu & ~tie), (m, r[1], "exp_avg", piece_cpu)]:
        got, want = got.cpu()[keep], want.cpu()[keep]
        atol = 1e-7 * float(want.abs().max()) if want.numel() else 0.0
        _assert_within(got, want, rtol=1e-6, atol=atol, what=f"{name} vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("found", [1.0, math.nan, math.inf, -2.0])
def test_cuda_lion_found_inf_skips_everything(found):
    table = gapped_table(300007)
    grad = make_grad(table, torch.bfloat16, seed=2, device=DEV)
    master, m = make_state(table, seed=2, device=DEV, gap_value=3.0)
    param_out = master.to(torch.bfloat16)
    flag = _scalar(found, DEV)
    before = [t.clone() for t in (grad, master, m, param_out, flag)]
    _run(CUDA_EXT, grad, master, m, param_out, table, 1.0, found=flag)
    torch.cuda.synchronize()
    for b, a, name in zip(before, (grad, master, m, param_out, flag),
                          ("grad", "master", "exp_avg", "param_out", "found_inf")):
        assert_bitwise_equal(a, b, f"{name} on a skipped step:")
    _run(CUDA_EXT, grad, master, m, param_out, table, 1.0, found=_scalar(0.0, DEV))  # a zero flag runs the step
    assert not torch.equal(master, before[1]) and not torch.equal(m, before[2])


@cuda
@needs_cuda
@pytest.mark.parametrize("offsets", [(1, 1, 1, 1), (3, 3, 3, 3), (1, 0, 0, 0), (0, 2, 0, 0), (0, 0, 0, 5)])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_cuda_lion_misaligned_views(offsets, gdtype):
    """Same phase everywhere -> vector path with a scalar head; different phases -> scalar path."""
    table = gapped_table(50021)
    go, wo, mo, po = offsets
    grad = _offset_view(make_grad(table, gdtype, seed=9, device=DEV), go)
    master, m = make_state(table, seed=9, device=DEV)
    master, m = _offset_view(master, wo), _offset_view(m, mo)
    param_out = _offset_view(torch.zeros(table.numel, dtype=torch.bfloat16, device=DEV), po)
    W, M, tie = oracle_lion(grad, master, m, table, LR, WD, 0.5)
    _run(CUDA_EXT, grad, master, m, param_out, table, 0.5)
    assert_fp32_close(master, W, "master", skip=tie)
    assert_fp32_close(m, M, "exp_avg")
    assert_param_out(param_out, master, W, piece_mask(table, DEV), skip=tie)


@cuda
@needs_cuda
def test_cuda_lion_param_out_aliasing_fp32_master():
    table = gapped_table(9999)
    grad = make_grad(table, torch.bfloat16, seed=6, device=DEV)
    master, m = make_state(table, seed=6, device=DEV)
    W, _, tie = oracle_lion(grad, master, m, table, LR, WD, 1.0)
    _run(CUDA_EXT, grad, master, m, master, table, 1.0)
    assert_fp32_close(master, W, "master", skip=tie)


@cuda
@needs_cuda
def test_cuda_lion_many_groups_uploaded():
    """More groups than fit in the kernel arguments: the lr/wd table is uploaded to the device."""
    table, lr, wd = many_groups_case()
    grad = make_grad(table, torch.float32, seed=8, device=DEV)
    master, m = make_state(table, seed=8, device=DEV)
    W, M, tie = oracle_lion(grad, master, m, table, lr, wd, 1.0)
    _run(CUDA_EXT, grad, master, m, None, table, 1.0, lr=lr, wd=wd)
    assert_fp32_close(master, W, "master", skip=tie)
    assert_fp32_close(m, M, "exp_avg")


@cuda
@needs_cuda
def test_cuda_lion_dispatch_and_deterministic():
    """ops.lion_step on CUDA tensors goes to the kernel; two runs are bitwise equal."""
    table = gapped_table(1_000_003)
    grad = make_grad(table, torch.bfloat16, seed=12, device=DEV)
    init = make_state(table, seed=12, device=DEV)
    outs = []
    for backend in ("auto", "cuda-ext"):
        master, m = (t.clone() for t in init)
        param_out = torch.zeros(table.numel, dtype=torch.bfloat16, device=DEV)
        front.lion_step(grad, master, m, param_out, table, lr=LR, weight_decay=WD, grad_scale=_scalar(0.5, DEV),
                      beta1=BETA1, beta2=BETA2, backend=backend)
        outs.append((master, m, param_out))
    assert ops.backend_for(grad) == "cuda-ext"
    for a, b, name in zip(outs[0], outs[1], ("master", "exp_avg", "param_out")):
        assert_bitwise_equal(a, b, f"{name} (two runs)")
    W, M, tie = oracle_lion(grad, init[0], init[1], table, LR, WD, 0.5)
    assert_fp32_close(outs[0][0], W, "master", skip=tie)
    assert_fp32_close(outs[0][1], M, "exp_avg")


# =================================================================================================
# The Python wrapper: validation and argument passing into the compiled module
# =================================================================================================
@needs_ext
def test_lion_wrapper_arguments_reach_the_extension(monkeypatch):
    """With the wrapper's device check bypassed, CPU tensors reach the compiled lion_step, whose
    first check rejects them; a pybind signature mismatch would raise TypeError instead."""
    from megatron_opt.ops import cuda as cuda_wrapper

    assert "lion_step" in cuda_wrapper.kernels.pass2_ops()  # csrc/rules/lion.cu registered itself
    monkeypatch.setattr(cuda_wrapper, "cuda_device", lambda op, grad: grad.device)
    table = gapped_table(100)
    n = table.numel
    f32 = lambda: torch.zeros(n)  # noqa: E731
    for po in (None, torch.zeros(n, dtype=torch.bfloat16)):
        for found in (None, torch.zeros(1)):
            with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
                front.lion_step(f32(), f32(), f32(), po, table, lr=LR, weight_decay=WD, grad_scale=torch.ones(1),
                              beta1=BETA1, beta2=BETA2, found_inf=found, backend=CUDA_EXT)


def test_lion_wrapper_validation(wrapper):
    backend, dev = wrapper
    table = PieceTable((0, 9), (8, 16), (True, True), (0, 1), 16)
    grad = torch.zeros(16, device=dev)
    master, m = torch.zeros(16, device=dev), torch.zeros(16, device=dev)
    one = torch.ones(1, device=dev)
    kw = dict(lr=LR, weight_decay=WD, grad_scale=one, beta1=BETA1, beta2=BETA2)
    with pytest.raises(TypeError, match="dtype"):
        front.lion_step(grad.double(), master, m, None, table, **kw, backend=backend)
    with pytest.raises(TypeError, match="exp_avg"):
        front.lion_step(grad, master, m.half(), None, table, **kw, backend=backend)
    with pytest.raises(TypeError, match="master"):
        front.lion_step(grad, master.bfloat16(), m, None, table, **kw, backend=backend)
    with pytest.raises(TypeError, match="param_out"):
        front.lion_step(grad, master, m, torch.zeros(16, dtype=torch.float64, device=dev), table, **kw, backend=backend)
    with pytest.raises(ValueError, match="elements"):
        front.lion_step(grad, master, m[:8], None, table, **kw, backend=backend)
    with pytest.raises(ValueError, match="contiguous"):
        front.lion_step(grad, master, torch.zeros(32, device=dev)[::2], None, table, **kw, backend=backend)
    with pytest.raises(ValueError, match="one element"):
        front.lion_step(grad, master, m, None, table, **{**kw, "grad_scale": torch.ones(2, device=dev)},
                        backend=backend)
    with pytest.raises(TypeError, match="found_inf"):
        front.lion_step(grad, master, m, None, table, **kw, found_inf=torch.zeros(1, dtype=torch.float64, device=dev),
                      backend=backend)
    with pytest.raises(ValueError, match="overlap"):
        front.lion_step(grad, master, master, None, table, **kw, backend=backend)
    with pytest.raises(ValueError, match="overlap"):
        buf = torch.zeros(40, device=dev)
        front.lion_step(grad, buf[:16], buf[8:24], None, table, **kw, backend=backend)
    with pytest.raises(ValueError, match="group"):
        front.lion_step(grad, master, m, None, table, **{**kw, "lr": [1.0], "weight_decay": [0.0]}, backend=backend)
    with pytest.raises(ValueError, match="entries"):
        front.lion_step(grad, master, m, None, table, **{**kw, "weight_decay": [0.0]}, backend=backend)
    if dev.type == "cuda":  # master may alias an fp32 param_out
        front.lion_step(grad, master, m, master, table, **kw, backend=backend)
