"""The "cpu" backend (torch fused CPU kernels, host-side checks) must match "reference", the spec."""
import pytest
import torch

from tests.kernels import front
from megatron_opt.ops.piece_table import PieceTable

torch.set_num_threads(1)


def _table(numel: int, seed: int) -> PieceTable:
    """Pieces with gaps, two param groups and one piece left out of the norm."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, numel, (8,), generator=g).tolist()))
    bounds = [0] + cuts + [numel]
    segs = [(bounds[i] + (i % 2), bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i] + (i % 2) < bounds[i + 1]]
    return PieceTable(tuple(s for s, _ in segs), tuple(e for _, e in segs), tuple(i != 1 for i in range(len(segs))),
                        tuple(i % 2 for i in range(len(segs))), numel)


def _grad(numel, dtype, table, seed, poison=None):
    g = torch.zeros(numel, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for s, e in zip(table.starts, table.ends):
        g[s:e] = (torch.randn(e - s, generator=gen) * 3).to(dtype)
        g[s] = 0.0  # some exact zeros
    if poison is not None:
        g[table.starts[-1]] = poison
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_grad_stats_matches_reference(dtype, poison):
    table = _table(5000, 1)
    grad = _grad(5000, dtype, table, 2, poison)
    inv = torch.tensor([0.25])
    ours, ref = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, inv, ours, backend="cpu")
    front.grad_stats(grad, table, inv, ref, backend="reference")
    assert ours[0] == ref[0] and ours[2] == ref[2]
    if poison is None:
        # fp32 blocks added in float64 against the reference's float64 per element (common.NORM_BLOCK)
        assert ours[0] == 0 and ours[1].item() == pytest.approx(ref[1].item(), rel=BLOCKED_SUMSQ_RTOL)
    else:
        assert ours[0] == 1


# The CPU pass sums squares in fp32 blocks of NORM_BLOCK elements, added in float64: its relative error
# against the float64 reference is ~1e-7 at 50M elements (measured); an fp32 sum of the whole run is 5e-3.
BLOCKED_SUMSQ_RTOL = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_stats_blocked_sum_stays_near_float64_on_a_long_shard(dtype):
    """4M elements spanning six orders of magnitude, in one run: a plain fp32 sum would be off by ~1e-4."""
    numel = 1 << 22
    gen = torch.Generator().manual_seed(11)
    grad = (torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)).to(dtype)
    table = PieceTable((0,), (numel,), (True,), (0,), numel)
    ours, ref = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([1.0]), ours, backend="cpu")
    front.grad_stats(grad, table, torch.tensor([1.0]), ref, backend="reference")
    assert ours[1].item() == pytest.approx(ref[1].item(), rel=BLOCKED_SUMSQ_RTOL)


def test_grad_stats_finite_values_whose_squares_overflow_fp32():
    """1e20 is finite in fp32, its square is not: no non-finite count, and the float64 sum of squares."""
    table = _table(3000, 3)
    grad = _grad(3000, torch.float32, table, 4)
    grad[table.starts[0] + 1] = 1e20
    ours, ref = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([1.0]), ours, backend="cpu")
    front.grad_stats(grad, table, torch.tensor([1.0]), ref, backend="reference")
    assert ours[0] == 0 and ref[0] == 0
    assert ours[1].item() == pytest.approx(1e40, rel=1e-6) and ours[1].item() == pytest.approx(ref[1].item(), rel=1e-12)


def test_excluded_piece_inf_is_still_found():
    table = _table(3000, 3)
    grad = _grad(3000, torch.float32, table, 4)
    grad[table.starts[1]] = float("inf")  # piece 1 is not counted in the norm
    stats = torch.zeros(3, dtype=torch.float64)
    front.grad_stats(grad, table, torch.tensor([1.0]), stats, backend="cpu")
    assert stats[0] == 1 and torch.isfinite(stats[1])


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_matches_reference(param_dtype, grad_dtype):
    numel = 4096
    table = _table(numel, 5)
    states = []
    for backend in ("cpu", "reference"):
        master = torch.randn(numel, generator=torch.Generator().manual_seed(7))
        m, v = torch.zeros(numel), torch.zeros(numel)
        out = master.to(param_dtype) if param_dtype else None
        step = torch.zeros(1, dtype=torch.int64)
        for t in range(3):
            grad = _grad(numel, grad_dtype, table, 10 + t)
            step.add_(1)
            front.adamw_step(grad, master, m, v, out, table, lr=[1e-2, 3e-3], weight_decay=[0.1, 0.0],
                           grad_scale=torch.tensor([0.5]), step=step, beta1=0.9, beta2=0.95, eps=1e-8, backend=backend)
        states.append((master, m, v, out))
    (w1, m1, v1, o1), (w2, m2, v2, o2) = states
    torch.testing.assert_close(m1, m2, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)
    gaps = torch.ones(numel, dtype=torch.bool)
    for s, e in zip(table.starts, table.ends):
        gaps[s:e] = False
    assert torch.equal(w1[gaps], torch.randn(numel, generator=torch.Generator().manual_seed(7))[gaps]), \
        "padding written"
    if param_dtype is not None:
        assert torch.equal(o1[~gaps], w1[~gaps].to(param_dtype))


def test_adamw_found_inf_writes_nothing():
    table = _table(1000, 8)
    master, m, v = torch.randn(1000), torch.rand(1000), torch.rand(1000)
    before = [t.clone() for t in (master, m, v)]
    front.adamw_step(_grad(1000, torch.float32, table, 9), master, m, v, None, table, lr=[1e-2, 1e-2],
                   weight_decay=[0.1, 0.1], grad_scale=torch.tensor([1.0]), step=torch.ones(1, dtype=torch.int64),
                   beta1=0.9, beta2=0.999, eps=1e-8, found_inf=torch.ones(1), backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, (master, m, v)))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master_kind", ["fp32", "fp16", "remainder"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_adamw_16_bit_state_matches_reference(state_dtype, master_kind, stochastic):
    """Precision-aware state on the fused CPU loop (widened copies, rounded back) equals the
    reference up to fp32 noise, rounds the same way, and leaves every gap element untouched."""
    from megatron_opt.ops import precision

    numel = 4096
    table = _table(numel, 5)
    gaps = torch.ones(numel, dtype=torch.bool)
    for s, e in zip(table.starts, table.ends):
        gaps[s:e] = False
    results = []
    for backend in ("cpu", "reference"):
        start = torch.randn(numel, generator=torch.Generator().manual_seed(7))
        out = start.to(torch.bfloat16)
        if master_kind == "fp32":
            master = start.clone()
        elif master_kind == "fp16":
            master = start.to(torch.float16)
        else:
            master = torch.empty(numel, dtype=torch.int16)
            precision.split_remainder(start, out, master)
        m = torch.full((numel,), 0.25).to(state_dtype)
        v = torch.full((numel,), 0.5).to(state_dtype)
        before = [t.clone() for t in (master, m, v, out)]
        step = torch.zeros(1, dtype=torch.int64)
        for t in range(3):
            step.add_(1)
            front.adamw_step(_grad(numel, torch.float32, table, 10 + t), master, m, v, out, table, lr=[1e-2, 3e-3],
                           weight_decay=[0.1, 0.0], grad_scale=torch.tensor([0.5]), step=step, beta1=0.9, beta2=0.95,
                           eps=1e-8, stochastic_rounding=stochastic, backend=backend)
        for a, b in zip(before, (master, m, v, out)):
            assert torch.equal(a[gaps], b[gaps]), "padding written"
        results.append((precision.load_master(master, out), m.float(), v.float(), out.float()))
    for ours, ref in zip(*results):
        # fp32 noise of the fused loop vs the op sequence may move a 16-bit rounding by one ulp
        ulp = 2**-7 if state_dtype == torch.bfloat16 or master_kind == "remainder" else 2**-10
        torch.testing.assert_close(ours[~gaps], ref[~gaps], rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_adamw_cpu_pass_in_chunks_equals_one_chunk(monkeypatch, state_dtype):
    """The CPU pass runs CPU_CHUNK elements at a time (adamw.CPU_CHUNK); chunk edges that cut pieces, gaps
    and param groups anywhere give the same bits as one chunk over the whole span."""
    from megatron_opt.optimizer.rules import adamw

    numel = 4096
    table = _table(numel, 5)
    results = []
    for chunk in (1 << 20, 64):
        monkeypatch.setattr(adamw, "CPU_CHUNK", chunk)
        master = torch.randn(numel, generator=torch.Generator().manual_seed(7))
        m, v = torch.zeros(numel, dtype=state_dtype), torch.zeros(numel, dtype=state_dtype)
        out = master.to(torch.bfloat16)
        step = torch.zeros(1, dtype=torch.int64)
        for t in range(3):
            step.add_(1)
            front.adamw_step(_grad(numel, torch.float32, table, 10 + t), master, m, v, out, table, lr=[1e-2, 3e-3],
                             weight_decay=[0.1, 0.0], grad_scale=torch.tensor([0.5]), step=step, beta1=0.9,
                             beta2=0.95, eps=1e-8, backend="cpu")
        results.append((master, m, v, out))
    for a, b in zip(*results):
        assert torch.equal(a, b)
