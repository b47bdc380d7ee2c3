"""Calibration of tests/support/reference_adaptive_muon.py (float64 AdaptiveMuon written from the formulas)
against emerging-optimizers 0.3.0's own AdaptiveMuon class (``prescale=False``: NS alone before the second
moment) and megatron-core's TensorParallelAdaptiveMuon (``prescale=True``: megatron-core's Muon orthogonalisation,
scaled per QKV piece, then the second moment, then the matrix's scale again), on three matrices, 4 steps, fp32
Newton-Schulz ('highest'). Each step's update is compared from the same point (the reference takes the
optimizer's params and state after every step).

Measured (torch 2.14 CPU): the update error relative to the step's change 1.2e-6 .. 4.9e-6 for both; bound 3e-5.
Both second moments: ``adamuon`` (elementwise) and ``normuon`` (NorMuon: per row of the tall matrices, per column
of the wide one).
megatron-core 0.19.2's TensorParallelAdaptiveMuon omits ``self.scale_mode`` / ``self.extra_scale_factor``
(AttributeError at its first step); Megatron-LM main's sets them from its arguments, which is what this test sets.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("emerging_optimizers")
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon  # noqa: E402
from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon  # noqa: E402

from tests.support import reference_adaptive_muon as ram  # noqa: E402
from tests.support import reference_muon as rm  # noqa: E402

UPDATE_ERROR = 3e-5
SPLIT = (8, 4, 4)


def _worst_update_error(kind: str, nesterov: bool, scale_mode: str, extra: float, split: bool, steps: int = 4,
                        method: str = "adamuon") -> float:
    g = torch.Generator().manual_seed(3)
    shapes = [(32, 16), (16, 24), (24, 16)]
    ws = [torch.randn(s, generator=g) * 0.3 for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    common = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov, fp32_matmul_prec="highest",
                  scale_mode=scale_mode, extra_scale_factor=extra, beta2=0.95, eps=1e-8, moment2_method=method)
    if kind == "emerging_optimizers":
        opt = AdaptiveMuon(ps, **common)
    else:
        ps[0].is_qkv = True
        opt = TensorParallelAdaptiveMuon(ps, split_qkv=split, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                                         qkv_split_shapes=list(SPLIT), tp_mode="blockwise", **common)
        opt.scale_mode, opt.extra_scale_factor = scale_mode, extra  # as Megatron-LM main's __init__ sets them
    rs = [torch.nn.Parameter(w.double().clone()) for w in ws]
    mats = {rs[0]: rm.MuonMatrix(qkv_split_shapes=SPLIT if kind == "megatron_core" else None),
            rs[1]: rm.MuonMatrix(), rs[2]: rm.MuonMatrix()}
    ref = ram.ReferenceAdaptiveMuon([dict(params=rs, muon=True)], mats, 0.02, 0.1, momentum=0.9, nesterov=nesterov,
                                    scale_mode=scale_mode, extra_scale_factor=extra, split_qkv=split, beta2=0.95,
                                    eps=1e-8, prescale=kind == "megatron_core", moment2_method=method)
    worst = 0.0
    for t in range(steps):
        for p, r, gr in zip(ps, rs, grads[t]):
            p.grad, r.grad = gr.clone(), gr.double()
        before = [r.detach().clone() for r in rs]
        opt.step()
        ref.step()
        for p, r, b in zip(ps, rs, before):
            worst = max(worst, float((p.detach().double() - r).norm() / (r - b).norm()))
            r.data.copy_(p.detach().double())
            ref.state[r]["momentum_buffer"].copy_(opt.state[p]["momentum_buffer"])
            if method == "normuon":
                ref.state[r]["moment2_blocks"][0] = opt.state[p]["moment2_buffer"].double().clone()
            else:
                ref.state[r]["moment2_buffer"].copy_(opt.state[p]["moment2_buffer"])
    return worst


@pytest.mark.parametrize("kind", ["emerging_optimizers", "megatron_core"])
@pytest.mark.parametrize("nesterov, scale_mode, extra, split", [(False, "spectral", 1.0, True),
                                                                (True, "unit_rms_norm", 2.0, False),
                                                                (True, "shape_scaling", 0.5, True)])
@pytest.mark.parametrize("method", ["adamuon", "normuon"])
def test_reference_adaptive_muon_matches_the_library(kind, nesterov, scale_mode, extra, split, method):
    assert _worst_update_error(kind, nesterov, scale_mode, extra, split, method=method) <= UPDATE_ERROR
