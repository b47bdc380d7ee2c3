"""SOAP's per-matrix state on megatron_opt's element-range layout: memory per rank, refresh balance and bytes per
step, against megatron-core's LayerWiseDistributedOptimizer and AdamW's ZeRO-1 (issue 39, item 3).

A layout computation, no processes and no tensors. For a GPT's params (``gpt_params``) it builds megatron_opt's
buffer layout (``muon_layout.buffer_layout``: DDP's buckets and shards) and takes SOAP's matrices (2-D params not
marked as embedding or output: the same split as Muon's), each whole, no QKV split.

Per matrix (m x n, fp32): L and Q_L (m x m each), R and Q_R (n x n each), exp_avg and exp_avg_sq (m x n each) =
4 * (2 m^2 + 2 n^2 + 2 m n) bytes, kept once per data-parallel group at the matrix's home.

  megatron_opt   homes from ``assign_homes`` with SOAP's cost model (``SOAP.home_cost``: the factor updates,
                 projections, power step and QR of one step) over every rank (``SOAP.homes_anywhere``; the
                 ``owners only`` columns: Muon's rule, homes among the matrix's owners); per rank its homes'
                 per-matrix state, plus the
                 masters on the elements it owns (fp32 params: none) and the AdamW companion's two moments on
                 its owned non-matrix elements.
  LayerWise      megatron-core 0.19.2's rule (``_compute_per_buffer_param_layout``): whole params to DP ranks by
                 greedy LPT on numel (largest first, to the least-loaded rank), applied here to all params as one
                 chunk; per rank the per-matrix state of its SOAP params, plus master and Adam moments of its other
                 params. It balances elements, not state, which grows with m^2 + n^2.
  replicated     without a distributed optimizer every rank keeps every matrix's state.

Refresh work: SOAP's ``steady_cost`` summed per home (emerging-optimizers 0.3.0 refreshes the eigenbases every step,
so the steady step is the refresh step). Bytes per step each rank sends: AdamW ZeRO-1's reduce-scatter and
all-gather (``zero1_sends_per_rank``) plus, for SOAP, every non-home owner's piece of the gradient to the home and
the update slice back, fp32 (``muon_sends_per_rank``, the same exchange as Muon's).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from megatron_opt.optimizer.rules.soap import SOAP
from megatron_opt.optimizer.whole_tensor.homes import MatrixPlacement, assign_homes

from .gpt_params import GptParam, gpt_params, is_muon_matrix
from .markdown import table
from .muon_layout import (DTYPES, MUON_BYTES, PRESETS, buffer_layout, muon_placements, muon_sends_per_rank,
                          owned_elements, write_report, zero1_sends_per_rank)


def matrix_state_bytes(shape: Sequence[int]) -> int:
    """SOAP's per-matrix state of one (m, n) matrix, fp32."""
    m, n = shape
    return 4 * (2 * m * m + 2 * n * n + 2 * m * n)


def layer_wise_ranks(params: Sequence[GptParam], dp: int) -> list[int]:
    """megatron-core's LayerWise rule: greedy LPT on numel, largest first, ties to the lowest rank."""
    load, rank_of = [0] * dp, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel, i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        rank_of[i], load[r] = r, load[r] + params[i].numel
    return rank_of


@dataclass(frozen=True)
class SoapLayoutRow:
    model: str
    dtype: str
    dp: int
    matrices: int
    straddling: int
    state_total_gb: float  # every matrix's per-matrix state, once
    mo_state_max_over_mean: float  # megatron_opt homes: per-matrix state bytes per rank
    mo_total_max_gb: float  # the rank with most optimizer bytes (per-matrix state + masters + AdamW moments)
    mo_total_max_over_mean: float
    lw_state_max_over_mean: float  # LayerWise: per-matrix state bytes per rank
    lw_total_max_gb: float
    lw_total_max_over_mean: float
    replicated_gb: float  # per rank without a distributed optimizer (state only)
    refresh_max_over_mean: float  # SOAP's step work per home
    adamw_mb_per_step: float  # ZeRO-1, summed over the ranks
    soap_extra_mb_per_step: float
    ratio: float  # (AdamW ZeRO-1 + exchange) / AdamW ZeRO-1


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def soap_layout_row(model: str, dtype: str, dp: int) -> SoapLayoutRow:
    param_bytes, grad_bytes = DTYPES[dtype]
    master = 0 if param_bytes == 4 else 4
    params = gpt_params(PRESETS[model])
    layout, _ = buffer_layout(params, dp, grad_reduce_in_fp32=grad_bytes == 4)
    placements: list[MatrixPlacement] = muon_placements(params, layout, split_qkv=False)
    rule = SOAP()
    homes = assign_homes(placements, dp, cost=lambda p: rule.home_cost(p.shape, 1), anywhere=rule.homes_anywhere)
    owned = owned_elements(layout)
    # megatron_opt: per-matrix state at the homes; masters on owned elements; AdamW's moments on owned non-matrices
    mo_state, mo_total = [0] * dp, [0] * dp
    for placement, home in zip(placements, homes):
        mo_state[home] += matrix_state_bytes(placement.shape)
    for i, p in enumerate(params):
        for r in range(dp):
            mo_total[r] += owned[i][r] * (master + (0 if is_muon_matrix(p) else 8))
    mo_total = [a + b for a, b in zip(mo_total, mo_state)]
    # LayerWise: whole params per rank
    lw_state, lw_total = [0] * dp, [0] * dp
    for p, r in zip(params, layer_wise_ranks(params, dp)):
        if is_muon_matrix(p):
            lw_state[r] += matrix_state_bytes(p.shape)
            lw_total[r] += p.numel * master
        else:
            lw_total[r] += p.numel * (master + 8)
    lw_total = [a + b for a, b in zip(lw_total, lw_state)]
    work = [0.0] * dp
    for placement, home in zip(placements, homes):
        work[home] += rule.steady_cost(placement.shape, 1)
    adamw = zero1_sends_per_rank(layout, param_bytes, grad_bytes) * dp
    extra = sum(muon_sends_per_rank(placements, homes, dp)) * MUON_BYTES
    total_state = sum(mo_state)
    return SoapLayoutRow(
        model=model, dtype=dtype, dp=dp, matrices=len(placements),
        straddling=sum(1 for p in placements if len(p.owners()) > 1), state_total_gb=total_state / 1e9,
        mo_state_max_over_mean=_max_over_mean(mo_state), mo_total_max_gb=max(mo_total) / 1e9,
        mo_total_max_over_mean=_max_over_mean(mo_total), lw_state_max_over_mean=_max_over_mean(lw_state),
        lw_total_max_gb=max(lw_total) / 1e9, lw_total_max_over_mean=_max_over_mean(lw_total),
        replicated_gb=total_state / 1e9, refresh_max_over_mean=_max_over_mean(work), adamw_mb_per_step=adamw / 1e6,
        soap_extra_mb_per_step=extra / 1e6, ratio=(adamw + extra) / adamw)


def markdown_table(rows: Sequence[SoapLayoutRow]) -> str:
    head = ("| model | dtype | DP | SOAP matrices | straddling | per-matrix state, all (GB) | megatron_opt: state "
            "max/mean | busiest rank GB (max/mean) | LayerWise: state max/mean | busiest rank GB (max/mean) "
            "| replicated GB/rank | refresh work max/mean | AdamW ZeRO-1 MB/step | SOAP extra MB/step | ratio |")
    return table(head, (
        f"| {r.model} | {r.dtype} | {r.dp} | {r.matrices} | {r.straddling} | {r.state_total_gb:.1f} "
        f"| {r.mo_state_max_over_mean:.3f} | {r.mo_total_max_gb:.2f} ({r.mo_total_max_over_mean:.3f}) "
        f"| {r.lw_state_max_over_mean:.3f} | {r.lw_total_max_gb:.2f} ({r.lw_total_max_over_mean:.3f}) "
        f"| {r.replicated_gb:.1f} | {r.refresh_max_over_mean:.3f} | {r.adamw_mb_per_step:,.0f} "
        f"| {r.soap_extra_mb_per_step:,.0f} | {r.ratio:.3f} |" for r in rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,swiglu", help=f"presets, comma-separated ({', '.join(PRESETS)})")
    p.add_argument("--dp", default="8", help="data-parallel sizes, comma-separated (default 8)")
    p.add_argument("--dtypes", default="bf16", help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--json", help="also write the rows (and the command) as JSON here")
    args = p.parse_args(argv)
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    for name in models:
        if name not in PRESETS:
            p.error(f"unknown model {name!r}: one of {', '.join(PRESETS)}")
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}: one of {', '.join(DTYPES)}")
    dps = [int(d) for d in args.dp.split(",")]
    if any(d < 2 for d in dps):
        p.error("--dp sizes must be >= 2")
    rows = [soap_layout_row(m, d, dp) for m in models for d in dtypes for dp in dps]
    print(markdown_table(rows))
    if args.json:
        write_report(args.json, "scripts/bench_soap_layout.py", argv, rows)
    return 0


__all__ = ["SoapLayoutRow", "soap_layout_row", "matrix_state_bytes", "layer_wise_ranks", "markdown_table", "main"]
