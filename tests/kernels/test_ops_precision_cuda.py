"""AdamW pass 2 on CUDA with precision-aware state (ops/precision.py): fp32 / fp16 / int16-remainder
masters, fp32 / bf16 / fp16 moments, stochastic rounding of bf16 moments, in the one-pass kernel.

CUDA part (``@pytest.mark.cuda``, skipped without a GPU and the extension), against
``ops.reference.adamw_step`` on the same CUDA tensors, for every grad dtype, master storage and
kernel moment pair, stochastic rounding on and off:
  * bitwise, with beta1 = beta2 = 0: the reference then runs exactly the kernel's IEEE operation
    sequence (m = g, v = g*g, no bias correction; the update, decay and step are the same single
    roundings), so every stored bit (masters, remainders, params, rounded and stochastically
    rounded moments) must agree;
  * with the usual betas, where the reference's ``addcmul`` associates ``(1-b2)*(g*g)`` differently
    from the kernel's ``((1-b2)*g)*g``, one step at a time from the same state: fp32 values within the
    fp32 tolerance of tests/kernels/test_ops.py, 16-bit values within one ulp and at least 99.9% bitwise
    equal, the remainder master joined to fp32 within the fp32 tolerance;
  * garbage in the padding gaps is left bitwise untouched and the pieces equal the zero-gap run;
    a found_inf skip (1.0 and NaN) leaves everything bitwise unchanged; one launch over several
    shards (vector and scalar paths); a captured CUDA graph replays the device step into the hash;
    moment pairs without a kernel run the reference fallback.
CPU part (with the extension built): the compiled module's code checks, the arguments the wrapper
passes, the Python validation (16-bit state for SGD / Lion is a TypeError), and the reference
fallback of the wrapper on CPU tensors (``wrapper`` fixture, cpu-bypass mode).
"""
from __future__ import annotations

import math

import pytest
import torch

import megatron_opt.ops as ops
from tests.kernels import front
from tests.support.gap_helpers import as_bits, piece_mask, pieces_table
from megatron_opt.ops import precision
from megatron_opt.ops.piece_table import PieceTable, full_table

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
LR, WD = [1e-3, 3e-4, 2e-2], [0.1, 0.0, 0.01]
HAS_GPU_EXT = torch.cuda.is_available() and ops.HAS_CUDA_EXT
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_GPU_EXT, reason=f"needs a CUDA device and the compiled extension "
                                f"(cuda: {torch.cuda.is_available()}, extension: {ops.HAS_CUDA_EXT})")
needs_ext = pytest.mark.skipif(not ops.HAS_CUDA_EXT, reason=f"extension not built: {ops.CUDA_EXT_ERROR}")
DEV = "cuda"

GRAD_DTYPES = [FP32, BF16, FP16]
# master storage: (master dtype, param_out dtype or None)
MASTERS = {
    "fp32-alias": (FP32, None),   # an fp32 param is its own master
    "fp32+bf16": (FP32, BF16),
    "fp32+fp16": (FP32, FP16),
    "fp16": (FP16, None),
    "fp16+bf16": (FP16, BF16),
    "fp16+fp16": (FP16, FP16),
    "remainder": (torch.int16, BF16),  # bf16 param + int16 remainder
}
KERNEL_PAIRS = [(FP32, FP32), (BF16, BF16), (FP16, FP16), (BF16, FP32)]
FALLBACK_PAIRS = [(FP32, BF16), (FP16, FP32), (BF16, FP16)]


# ================================================================================================ helpers

def gapped() -> PieceTable:
    """Pieces with misaligned starts, gaps, touching pieces, a multi-chunk piece and three groups."""
    return pieces_table([5, 1, 70000, 3, 64, 1031, 17], [3, 0, 64, 1])


def make_shard(table: PieceTable, gdtype, master: str, pair, seed: int, device="cpu") -> ops.ShardOperands:
    """Random operands: the fp32 master stored as asked (split into bf16 param + remainder, or
    rounded to fp16), moments rounded to their dtypes."""
    g = torch.Generator().manual_seed(seed)
    n = table.numel
    grad = torch.randn(n, generator=g).to(gdtype)
    w32 = torch.randn(n, generator=g)
    m32 = torch.randn(n, generator=g) * 1e-2
    v32 = torch.rand(n, generator=g) * 1e-3
    mdtype, pdtype = MASTERS[master]
    if mdtype == torch.int16:
        param, w = torch.empty(n, dtype=BF16), torch.empty(n, dtype=torch.int16)
        precision.split_remainder(w32, param, w)
    else:
        w = w32.to(mdtype)
        param = None if pdtype is None else w.to(pdtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ops.ShardOperands(table, to(grad), to(w), (to(m32.to(pair[0])), to(v32.to(pair[1]))), to(param))


def clone(s: ops.ShardOperands) -> ops.ShardOperands:
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return ops.ShardOperands(s.table, c(s.grad), c(s.master), tuple(c(t) for t in s.state), c(s.param_out))


def outputs(s: ops.ShardOperands):
    return [("master", s.master), ("exp_avg", s.state[0]), ("exp_avg_sq", s.state[1]), ("param_out", s.param_out)]


def fp32_master(s: ops.ShardOperands) -> torch.Tensor:
    if s.master.dtype == torch.int16:
        return precision.join_remainder(s.param_out, s.master)
    return s.master.float()


def run(s: ops.ShardOperands, backend: str, *, step: int = 3, beta1=BETA1, beta2=BETA2, gs=0.7, stochastic=False,
        found=None, lr=LR, wd=WD) -> None:
    dev = s.grad.device
    front.adamw_step(s.grad, s.master, s.state[0], s.state[1], s.param_out, s.table, lr=lr, weight_decay=wd,
                   grad_scale=torch.tensor([gs], device=dev), step=torch.tensor([step], device=dev),
                   beta1=beta1, beta2=beta2, eps=EPS, found_inf=found, stochastic_rounding=stochastic,
                   backend=backend)


def assert_bitwise(a: ops.ShardOperands, b: ops.ShardOperands, what: str, mask=None) -> None:
    for (name, x), (_, y) in zip(outputs(a), outputs(b)):
        if x is None:
            continue
        bx, by = as_bits(x), as_bits(y)
        if mask is not None:
            bx, by = bx[mask], by[mask]
        if not torch.equal(bx, by):
            bad = (bx != by).nonzero().flatten()
            raise AssertionError(f"{what}: {name} differs bitwise at {bad.numel()} elements, first "
                                 f"{int(bad[0])}: {x.flatten()[int(bad[0])].item()!r} "
                                 f"vs {y.flatten()[int(bad[0])].item()!r}")


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The tolerance of tests/kernels/test_ops.py's kernel-vs-reference comparison."""
    g, w = got.double(), want.double()
    tol = 2e-6 * w.abs() + 1e-7 * w.abs().max().clamp_min(1e-30)
    bad = ((g - w).abs() > tol) | (g.isnan() != w.isnan())
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {float((g - w).abs().max())}"


def _ordered16(t: torch.Tensor) -> torch.Tensor:
    b = t.view(torch.int16).to(torch.int32)
    mag = b & 0x7FFF
    return torch.where(b < 0, -mag, mag)


def assert_16bit_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """16-bit floats: within one ulp (the fp32 values they round from may differ by an fp32 ulp or
    two), or, near zero, within the fp32 tolerance's absolute part (a master that cancels to almost
    zero carries an absolute error of a few fp32 ulps of its inputs, as in tests/kernels/test_ops.py's
    assert_param_out); and bitwise equal almost everywhere."""
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    keep = ~want.isnan()
    got, want = got[keep], want[keep]
    if not want.numel():
        return
    ulps = (_ordered16(got) - _ordered16(want)).abs()
    finite = want[torch.isfinite(want)].double()
    atol = 1e-7 * float(finite.abs().max()) if finite.numel() else 0.0
    ok = (ulps <= 1) | ((got.double() - want.double()).abs() <= atol)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} elements off by up to {int(ulps[~ok].max())} ulps"
    assert float((ulps == 0).double().mean()) >= 0.999, f"{what}: {int((ulps != 0).sum())} elements differ"


def assert_close_to_reference(a: ops.ShardOperands, b: ops.ShardOperands, what: str) -> None:
    """One step from the same state: fp32 values (the remainder master joined) within the fp32
    tolerance, 16-bit values (fp16 master, moments, params) within one ulp, almost all bitwise."""
    if a.master.dtype == torch.int16:
        assert_fp32_close(fp32_master(a), fp32_master(b), f"{what}: remainder master (joined fp32 value)")
    for (name, x), (_, y) in zip(outputs(a), outputs(b)):
        if x is None or x.dtype == torch.int16:
            continue
        if x.dtype == FP32:
            assert_fp32_close(x, y, f"{what}: {name}")
        else:
            assert_16bit_close(x, y, f"{what}: {name}")
    if a.param_out is not None and a.master.dtype != torch.int16:
        # param_out is exactly the rounding of the kernel's own stored master
        assert torch.equal(as_bits(a.param_out), as_bits(a.master.to(a.param_out.dtype))), f"{what}: param_out"


def config_id(gdtype, master, pair, stochastic) -> str:
    short = {FP32: "f32", BF16: "bf16", FP16: "f16"}
    return f"g{short[gdtype]}-{master}-m{short[pair[0]]}v{short[pair[1]]}-{'sr' if stochastic else 'rn'}"


CONFIGS = [pytest.param(g, m, p, sr, id=config_id(g, m, p, sr))
           for g in GRAD_DTYPES for m in MASTERS for p in KERNEL_PAIRS for sr in (False, True)]


# ================================================================================================ CUDA
@cuda
@needs_cuda
@pytest.mark.parametrize("gdtype,master,pair,stochastic", CONFIGS)
def test_cuda_bitwise_equal_to_reference_with_zero_betas(gdtype, master, pair, stochastic):
    """beta1 = beta2 = 0: both sides do the same IEEE operations, so every stored bit agrees."""
    base = make_shard(gapped(), gdtype, master, pair, seed=1, device=DEV)
    ours, theirs = clone(base), clone(base)
    for step in (3, 1_000_000_007):  # the hash takes the step modulo 2^32
        run(ours, "cuda-ext", step=step, beta1=0.0, beta2=0.0, stochastic=stochastic)
        run(theirs, "reference", step=step, beta1=0.0, beta2=0.0, stochastic=stochastic)
        assert_bitwise(ours, theirs, f"step {step}")
    assert not torch.equal(as_bits(ours.master), as_bits(base.master)), "the update must move the master"


@cuda
@needs_cuda
@pytest.mark.parametrize("gdtype,master,pair,stochastic", CONFIGS)
def test_cuda_matches_reference(gdtype, master, pair, stochastic):
    """Three steps, each compared from the same state: a one-ulp difference in a stored 16-bit moment
    would otherwise move the next update by up to 0.4% (beyond the fp32 tolerance)."""
    ours = make_shard(gapped(), gdtype, master, pair, seed=2, device=DEV)
    for step in (1, 2, 3):
        theirs = clone(ours)
        run(ours, "cuda-ext", step=step, stochastic=stochastic)
        run(theirs, "reference", step=step, stochastic=stochastic)
        assert_close_to_reference(ours, theirs, f"step {step}")


@cuda
@needs_cuda
def test_cuda_stochastic_rounding_is_unbiased_and_differs_from_nearest():
    """bf16 moments at 3/8 of a bf16 ulp: nearest rounding always rounds down, stochastic rounding
    averages to the fp32 value; replaying the same step gives the same bits."""
    n = 1 << 18
    table = full_table(n)
    grad = torch.full((n,), 1.0 + 3 * 2**-10, device=DEV)  # m = g exactly with beta1 = 0
    outs = {}
    for sr in (False, True, True):
        m = torch.zeros(n, dtype=BF16, device=DEV)
        v = torch.zeros(n, dtype=BF16, device=DEV)
        w = torch.zeros(n, device=DEV)
        front.adamw_step(grad, w, m, v, None, table, lr=[0.0], weight_decay=[0.0], grad_scale=torch.ones(1, device=DEV),
                       step=torch.tensor([9], device=DEV), beta1=0.0, beta2=0.0, eps=EPS, stochastic_rounding=sr)
        outs.setdefault(sr, []).append(m)
    assert torch.all(outs[False][0] == 1.0)
    assert torch.equal(outs[True][0], outs[True][1]), "stochastic rounding must be replayable"
    assert abs(outs[True][0].double().mean().item() - (1.0 + 3 * 2**-10)) < 1e-4


@cuda
@needs_cuda
@pytest.mark.parametrize("master", list(MASTERS))
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_cuda_gaps_untouched_and_pieces_as_with_zero_gaps(master, pair):
    table = gapped()
    piece = piece_mask(table, DEV)
    gap = ~piece
    clean = make_shard(table, BF16, master, pair, seed=3, device=DEV)
    dirty = clone(clean)
    gen = torch.Generator().manual_seed(30)
    for _, t in outputs(dirty) + [("grad", dirty.grad)]:
        if t is not None:
            bits = as_bits(t)
            k = int(gap.sum())
            half = 1 << (8 * t.element_size() - 1)
            bits[gap] = torch.randint(-half, half, (k,), generator=gen, dtype=torch.int64).to(bits.dtype).to(DEV)
    before, theirs = clone(dirty), clone(dirty)
    run(clean, "cuda-ext", beta1=0.0, beta2=0.0, stochastic=True)
    run(dirty, "cuda-ext", beta1=0.0, beta2=0.0, stochastic=True)
    run(theirs, "reference", beta1=0.0, beta2=0.0, stochastic=True)
    assert_bitwise(dirty, before, "gaps", mask=gap)
    assert torch.equal(as_bits(dirty.grad), as_bits(before.grad)), "grad written"
    assert_bitwise(dirty, clean, "pieces vs the zero-gap run", mask=piece)
    assert_bitwise(dirty, theirs, "vs reference")


@cuda
@needs_cuda
@pytest.mark.parametrize("master", list(MASTERS))
@pytest.mark.parametrize("pair", KERNEL_PAIRS + FALLBACK_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_cuda_found_inf_leaves_everything_bitwise_unchanged(master, pair):
    s = make_shard(gapped(), FP16, master, pair, seed=4, device=DEV)
    before = clone(s)
    for flag in (1.0, math.nan):
        run(s, "cuda-ext", stochastic=True, found=torch.tensor([flag], device=DEV))
    assert_bitwise(s, before, "skipped step")
    assert torch.equal(as_bits(s.grad), as_bits(before.grad))


@cuda
@needs_cuda
@pytest.mark.parametrize("pair", FALLBACK_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("master", ["fp32+bf16", "fp16+fp16", "remainder"])
def test_cuda_unsupported_moment_pair_runs_the_reference(monkeypatch, pair, master):
    calls = []
    monkeypatch.setattr(_kernels(), "adamw_step", lambda *a: calls.append(a), raising=True)
    shards = [make_shard(gapped(), BF16, master, pair, seed=5, device=DEV),
              make_shard(full_table(4099), BF16, master, pair, seed=6, device=DEV)]
    ours, theirs = [clone(s) for s in shards], [clone(s) for s in shards]
    lr_wd = ops.lr_wd_table(LR, WD, torch.device(DEV))
    kw = dict(lr_wd=lr_wd, grad_scale=torch.tensor([0.5], device=DEV) * 0.75,
              step=torch.tensor([2], device=DEV), beta1=BETA1, beta2=BETA2, eps=EPS, stochastic_rounding=True)
    front.adamw_step_planned(ops.StepPlan(tuple(ours)), backend="cuda-ext", **kw)
    front.adamw_step_planned(ops.StepPlan(tuple(theirs)), backend="reference", **kw)
    assert not calls, "no kernel exists for this pair: the wrapper must not launch one"
    for a, b in zip(ours, theirs):
        assert_bitwise(a, b, "fallback vs reference")
    assert not torch.equal(as_bits(ours[0].master), as_bits(shards[0].master))


@cuda
@needs_cuda
@pytest.mark.parametrize("master", ["fp32+bf16", "fp16+bf16", "remainder"])
@pytest.mark.parametrize("pair", [(BF16, BF16), (BF16, FP32)], ids=["bf16-bf16", "bf16-fp32"])
def test_cuda_one_launch_over_many_shards(master, pair):
    """Shards of different layouts in one plan, one of them at an odd offset (scalar path)."""
    tables = [gapped(), full_table(1), full_table(32768 + 7), pieces_table([17] * 300, [1, 0, 5], lead=3)]
    shards = [make_shard(t, BF16, master, pair, seed=10 + i, device=DEV) for i, t in enumerate(tables)]
    ours, theirs = [clone(s) for s in shards], [clone(s) for s in shards]
    odd = ours[-1]  # its grad one element into a buffer: the arrays disagree on the phase
    buf = torch.zeros(odd.grad.numel() + 1, dtype=odd.grad.dtype, device=DEV)
    buf[1:].copy_(odd.grad)
    ours[-1] = ops.ShardOperands(odd.table, buf[1:], odd.master, odd.state, odd.param_out)
    plan = ops.StepPlan(tuple(ours))
    phases = {r[0]: r[5] for r in plan.chunk_rows()}
    assert phases[len(ours) - 1] == -1 and phases[0] == 0
    lr_wd = ops.lr_wd_table(LR, WD, torch.device(DEV))
    for beta in ((0.0, 0.0), (BETA1, BETA2)):
        kw = dict(lr_wd=lr_wd, grad_scale=torch.tensor([0.5], device=DEV),
                  step=torch.tensor([5], device=DEV), beta1=beta[0], beta2=beta[1], eps=EPS, stochastic_rounding=True)
        front.adamw_step_planned(plan, backend="cuda-ext", **kw)
        front.adamw_step_planned(ops.StepPlan(tuple(theirs)), backend="reference", **kw)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            if beta == (0.0, 0.0):
                assert_bitwise(a, b, f"shard {k} (phase {phases.get(k)})")
            else:
                assert_close_to_reference(a, b, f"shard {k} (phase {phases.get(k)})")
        theirs = [clone(s) for s in ours]  # the second round starts from the same state


@cuda
@needs_cuda
def test_cuda_graph_replay_hashes_the_current_device_step():
    """Pass 2 captured once with stochastic rounding; each replay reads the device step, bitwise equal
    to eager launches."""
    base = make_shard(gapped(), BF16, "remainder", (BF16, BF16), seed=20, device=DEV)
    graphed, eager = clone(base), clone(base)
    hp = ops.DeviceHyperparams(3, torch.device(DEV))
    table = hp.update(LR, WD)
    gs = torch.ones(1, device=DEV)
    step_g, step_e = torch.ones(1, dtype=torch.int64, device=DEV), torch.ones(1, dtype=torch.int64, device=DEV)
    plan_g, plan_e = ops.StepPlan((graphed,)), ops.StepPlan((eager,))
    plan_g.device_tensors()
    kw = dict(lr_wd=table, grad_scale=gs, beta1=BETA1, beta2=BETA2, eps=EPS, stochastic_rounding=True,
              backend="cuda-ext")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, on a scratch copy
        front.adamw_step_planned(ops.StepPlan((clone(graphed),)), step=step_g, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        front.adamw_step_planned(plan_g, step=step_g, **kw)
    for i in range(3):
        step_g.fill_(i + 1)
        graph.replay()
        step_e.fill_(i + 1)
        front.adamw_step_planned(plan_e, step=step_e, **kw)
    torch.cuda.synchronize()
    assert_bitwise(graphed, eager, "graph replay vs eager")


# ================================================================================================ CPU
def _kernels():
    """The compiled module the CUDA backend launches through (``megatron_opt.ops.cuda.kernels``)."""
    from megatron_opt.ops import cuda as cuda_wrapper

    return cuda_wrapper.kernels


def _c_args(dev, codes: dict, stochastic=True):
    """Arguments of the compiled pass 2 of "adamw_step" with the given dtype codes (tables and scalars on
    ``dev``)."""
    base = dict(grad_code=1, param_code=1, master_code=0, state0_code=1, state1_code=1)
    base.update(codes)
    ptrs = torch.zeros(1, 5, dtype=torch.int64, device=dev)
    chunks = torch.zeros(0, 4, dtype=torch.int64, device=dev)
    return ("adamw_step", ptrs, chunks, base["grad_code"], base["param_code"], base["master_code"],
            base["state0_code"], base["state1_code"], torch.zeros(1, 2, dtype=torch.float64, device=dev),
            torch.ones(1, device=dev), None, torch.ones(1, dtype=torch.int64, device=dev), stochastic,
            [BETA1, BETA2, EPS])


BAD_CODES = [
    (dict(master_code=1), "unknown master storage code 1"),
    (dict(master_code=-1), "unknown master storage code -1"),
    (dict(master_code=3, param_code=2), "remainder master needs a bfloat16 param_out"),
    (dict(master_code=3, param_code=-1), "remainder master needs a bfloat16 param_out"),
    (dict(state0_code=-1), "unknown state dtype codes"),
    (dict(state1_code=7), "unknown state dtype codes"),
    (dict(state0_code=0, state1_code=1), r"no kernel for state dtype codes \(0, 1\)"),
    (dict(state0_code=2, state1_code=0), r"no kernel for state dtype codes \(2, 0\)"),
    (dict(grad_code=3), "unknown grad dtype code 3"),
    (dict(param_code=5), "unknown param_out dtype code 5"),
]


@pytest.mark.parametrize("codes,message", BAD_CODES, ids=[m for _, m in BAD_CODES])
def test_compiled_module_checks_the_codes(wrapper, codes, message):
    """The code checks come first, so they answer the same on CPU tensors and on a GPU."""
    _, dev = wrapper
    with pytest.raises(RuntimeError, match=message):
        _kernels().pass2(*_c_args(dev, codes))


@needs_ext
@pytest.mark.parametrize("codes", [dict(), dict(master_code=2, param_code=-1, state0_code=2, state1_code=2),
                                   dict(master_code=3, param_code=1, state0_code=1, state1_code=0),
                                   dict(master_code=0, param_code=-1, state0_code=0, state1_code=0, grad_code=0)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_compiled_module_accepts_the_valid_codes(codes, stochastic):
    """Valid codes pass the code checks and stop at the device check (CPU tensors): the signature
    (14 arguments, the rule's constants last) matches the binding."""
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        _kernels().pass2(*_c_args(torch.device("cpu"), codes, stochastic))


class _RecordingC:
    """Stands in for the compiled module (``ops.cuda.kernels``): records the pass-2 arguments."""

    def __init__(self):
        self.calls = []

    def pass2(self, *args):
        self.calls.append(args)


@needs_ext
@pytest.mark.parametrize("master", list(MASTERS))
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("stochastic", [False, True])
def test_wrapper_passes_master_state_codes_and_flag(monkeypatch, master, pair, stochastic):
    from megatron_opt.ops import cuda as cuda_wrapper

    rec = _RecordingC()
    monkeypatch.setattr(cuda_wrapper, "kernels", rec)
    monkeypatch.setattr(cuda_wrapper, "cuda_device", lambda op, grad: grad.device)
    s = make_shard(gapped(), FP16, master, pair, seed=7)
    before = clone(s)
    run(s, "cuda-ext", stochastic=stochastic)
    assert len(rec.calls) == 1
    a = rec.calls[0]
    mdtype, pdtype = MASTERS[master]
    codes = {FP32: 0, BF16: 1, FP16: 2}
    assert a[0] == "adamw_step"
    assert a[3:8] == (2, -1 if pdtype is None else codes[pdtype], {FP32: 0, FP16: 2, torch.int16: 3}[mdtype],
                      codes[pair[0]], codes[pair[1]])
    assert a[12] is stochastic and a[13] == [BETA1, BETA2, EPS]
    assert_bitwise(s, before, "the recorder writes nothing")


@pytest.mark.parametrize("pair", FALLBACK_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("master", ["fp32-alias", "fp16+bf16", "remainder"])
def test_wrapper_fallback_runs_the_reference(wrapper, pair, master):
    """Moment pairs without a kernel: the wrapper runs ops.reference on the same tensors (on the CPU
    in cpu-bypass mode), bitwise the reference's result, stochastic rounding and clip included."""
    backend, dev = wrapper
    shards = [make_shard(gapped(), BF16, master, pair, seed=8, device=dev),
              make_shard(full_table(100), BF16, master, pair, seed=9, device=dev)]
    ours, theirs = [clone(s) for s in shards], [clone(s) for s in shards]
    lr_wd = ops.lr_wd_table(LR, WD, dev)
    kw = dict(lr_wd=lr_wd, grad_scale=torch.tensor([0.5], device=dev) * 0.75,
              step=torch.tensor([4], device=dev), beta1=BETA1, beta2=BETA2, eps=EPS, stochastic_rounding=True)
    front.adamw_step_planned(ops.StepPlan(tuple(ours)), **kw, backend=backend)
    for s in theirs:
        front.adamw_step(s.grad, s.master, s.state[0], s.state[1], s.param_out, s.table, lr=LR, weight_decay=WD,
                       grad_scale=kw["grad_scale"], step=kw["step"], beta1=BETA1, beta2=BETA2, eps=EPS,
                       stochastic_rounding=True, backend="reference")
    for a, b in zip(ours, theirs):
        assert_bitwise(a, b, "fallback vs reference")
    assert not torch.equal(as_bits(ours[0].master), as_bits(shards[0].master))
    # the single-shard front takes the same route
    s = make_shard(gapped(), FP32, master, pair, seed=10, device=dev)
    t = clone(s)
    front.adamw_step(s.grad, s.master, *s.state, s.param_out, s.table, lr=LR, weight_decay=WD,
                   grad_scale=torch.ones(1, device=dev), step=torch.tensor([1], device=dev), beta1=BETA1,
                   beta2=BETA2, eps=EPS, stochastic_rounding=True, backend=backend)
    front.adamw_step(t.grad, t.master, *t.state, t.param_out, t.table, lr=LR, weight_decay=WD,
                   grad_scale=torch.ones(1, device=dev), step=torch.tensor([1], device=dev), beta1=BETA1,
                   beta2=BETA2, eps=EPS, stochastic_rounding=True, backend="reference")
    assert_bitwise(s, t, "single-shard fallback vs reference")


def test_wrapper_validates_precision_aware_dtypes(wrapper):
    backend, dev = wrapper
    table = full_table(16)
    n = 16
    z = lambda dt=FP32: torch.zeros(n, dtype=dt, device=dev)  # noqa: E731
    one = torch.ones(1, device=dev)
    step = torch.ones(1, dtype=torch.int64, device=dev)
    kw = dict(lr=[1e-3], weight_decay=[0.0], grad_scale=one, step=step, beta1=BETA1, beta2=BETA2, eps=EPS)
    with pytest.raises(TypeError, match="remainder of a bfloat16 param.*no param_out"):
        front.adamw_step(z(), z(torch.int16), z(BF16), z(BF16), None, table, **kw, backend=backend)
    with pytest.raises(TypeError, match="remainder of a bfloat16 param.*float16"):
        front.adamw_step(z(), z(torch.int16), z(BF16), z(BF16), z(FP16), table, **kw, backend=backend)
    with pytest.raises(TypeError, match="master has dtype torch.bfloat16"):
        front.adamw_step(z(), z(BF16), z(BF16), z(BF16), z(BF16), table, **kw, backend=backend)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype torch.float64"):
        front.adamw_step(z(), z(), z(BF16), z(torch.float64), None, table, **kw, backend=backend)
    with pytest.raises(TypeError, match="exp_avg has dtype torch.int16"):
        front.adamw_step(z(), z(), z(torch.int16), z(), None, table, **kw, backend=backend)
    sgd_kw = dict(lr=[1e-3], weight_decay=[0.0], grad_scale=one)
    with pytest.raises(TypeError, match="momentum_buffer has dtype torch.bfloat16.*AdamW only, SGD"):
        front.sgd_step(z(), z(), z(BF16), None, table, momentum=0.9, **sgd_kw, backend=backend)
    with pytest.raises(TypeError, match="master has dtype torch.float16.*AdamW only, SGD"):
        front.sgd_step(z(), z(FP16), z(), z(BF16), table, momentum=0.9, **sgd_kw, backend=backend)
    with pytest.raises(TypeError, match="momentum_buffer has dtype torch.float16.*AdamW only"):
        front.sgd_step(z(), z(), z(FP16), None, table, momentum=0.0, **sgd_kw, backend=backend)
    with pytest.raises(TypeError, match="exp_avg has dtype torch.bfloat16.*AdamW only, Lion"):
        front.lion_step(z(), z(), z(BF16), None, table, beta1=BETA1, beta2=BETA2, **sgd_kw, backend=backend)
    with pytest.raises(TypeError, match="master has dtype torch.int16.*AdamW only, Lion"):
        front.lion_step(z(), z(torch.int16), z(), z(BF16), table, beta1=BETA1, beta2=BETA2, **sgd_kw, backend=backend)
    # planned fronts: a plan with 16-bit state is refused before anything is launched
    lr_wd = ops.lr_wd_table([1e-3], [0.0], dev)
    plan16 = ops.StepPlan((ops.ShardOperands(table, z(), z(), (z(BF16),), z(BF16)),))
    with pytest.raises(TypeError, match="AdamW only, SGD takes float32"):
        front.sgd_step_planned(plan16, lr_wd=lr_wd, grad_scale=one, momentum=0.9, backend=backend)
    with pytest.raises(TypeError, match="AdamW only, Lion takes float32"):
        front.lion_step_planned(plan16, lr_wd=lr_wd, grad_scale=one, beta1=BETA1, beta2=BETA2, backend=backend)
    plan_rem = ops.StepPlan((ops.ShardOperands(table, z(), z(torch.int16), (z(),), z(BF16)),))
    with pytest.raises(TypeError, match="master (has )?dtype torch.int16"):
        front.sgd_step_planned(plan_rem, lr_wd=lr_wd, grad_scale=one, momentum=0.9, backend=backend)
    with pytest.raises(ValueError, match="two states"):
        front.adamw_step_planned(plan_rem, lr_wd=lr_wd, grad_scale=one, step=step, beta1=BETA1, beta2=BETA2, eps=EPS,
                               backend=backend)
    if dev.type == "cpu":  # accepted: the call reaches the compiled module, which wants CUDA tensors
        for master, po in ((z(torch.int16), z(BF16)), (z(FP16), None), (z(FP16), z(BF16)), (z(), z(FP16))):
            with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
                front.adamw_step(z(BF16), master, z(BF16), z(), po, table, stochastic_rounding=True, **kw,
                               backend=backend)
