"""Muon on megatron_opt's element-range layout: bytes communicated per step and Newton-Schulz balance.

A layout computation, no processes and no tensors (issue #30's "Done when": bytes per step <= 1.25x AdamW's
ZeRO-1 on the same model; Newton-Schulz work per rank max/mean <= 1.25 on a 24-layer GPT, hidden 2048, DP 8).

For a GPT's params (``gpt_params``, megatron-core's order) it builds the buffer layout with megatron_opt's own
functions, as ``DistributedDataParallel`` does: ``bucket_size_of`` (Megatron-LM's default bucket size under
``overlap_grad_reduce``: max(40M, 1M * DP) elements) and ``build_buffer_layout`` (reverse order, 64-element
param alignment, buckets padded to split into DP equal shards). Every param of these models has one dtype, so
DDP makes one buffer. From the layout's ``shard_pieces`` it takes how many elements of each Muon matrix every
rank owns (``MatrixPlacement``), chooses the homes with ``megatron_opt.optimizer.whole_tensor.homes.assign_homes``, and
counts per step, what each rank sends (ring collectives: a reduce-scatter or all-gather of a B-element bucket
sends (DP-1)/DP * B elements from every rank, padding included):

  AdamW ZeRO-1   reduce-scatter of the grads (grad dtype) + all-gather of the params (param dtype)
  Muon           the same + every non-home owner's piece of the update to the home and the orthogonalised
                 slice back, fp32 (``traffic_elements``)

Per-rank optimizer memory (``state_bytes_per_rank``): AdamW ZeRO-1 keeps, per bucket shard a rank owns
pieces of, a master over the whole shard (fp32 for 16-bit params; none for fp32 params, whose master is the
param) and exp_avg + exp_avg_sq (fp32); Muon keeps the same master per owned element, the momentum_buffer
(fp32, or bf16 with the precision-aware optimizer) on the Muon matrices' elements and AdamW's two moments on
the rest, nothing for padding (optimizer/state/shard_store.py). The rows give the rank with most of each.

``ratio`` is Muon / AdamW summed over the ranks; ``busiest`` is the same for the rank that sends most (AdamW
sends the same from every rank). ``NS max/mean`` is the summed Newton-Schulz cost (``placement_cost``) of the
busiest home over the mean. ``--homes largest-owner`` is the alternative the table compares with: each matrix
at the rank owning most of it (fewest bytes, no balancing).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from megatron_opt import DistributedDataParallelConfig
from megatron_opt.distributed.grad_sync import bucket_size_of
from megatron_opt.distributed.layout import BufferLayout, build_buffer_layout
from megatron_opt.optimizer.whole_tensor.homes import MatrixPlacement, assign_homes, rank_costs, traffic_elements

from .gpt_params import GptParam, GptShape, gpt_params, is_muon_matrix
from .markdown import table

# name: (param bytes, grad bytes); "bf16" reduces its grads in fp32 (grad_reduce_in_fp32), as Megatron-LM's recipes do
DTYPES = {"bf16": (2, 4), "fp32": (4, 4), "bf16-grads": (2, 2)}
MUON_BYTES = 4  # the update goes to the home and back in fp32
HOME_POLICIES = ("balanced", "largest-owner")
PRESETS = {
    # Megatron-LM's GPT-2 style 1.3B recipe: GELU, biases, LayerNorm, learned positions, tied output.
    "gpt": GptShape(num_layers=24, hidden=2048, heads=16, vocab=50304, seq=2048),
    # The same size Llama-style: SwiGLU, no biases, RMSNorm, RoPE, untied output.
    "swiglu": GptShape(num_layers=24, hidden=2048, heads=16, vocab=50304, seq=2048, bias=False, learned_position=False,
                       swiglu=True, tied=False, norm_bias=False),
}


@dataclass(frozen=True)
class LayoutRow:
    """One configuration's counts."""

    model: str
    params: int
    dtype: str
    dp: int
    bucket_size: Optional[int]
    buckets: int
    split_qkv: bool
    homes: str
    muon_matrices: int
    straddling: int
    ns_max_over_mean: float
    adamw_bytes: int  # summed over the ranks
    muon_extra_bytes: int  # summed over the ranks
    ratio: float
    busiest_rank_ratio: float
    adamw_state_bytes: int = 0  # per-rank optimizer memory (masters + rule state), the rank with most
    muon_state_bytes: int = 0  # the same for Muon + AdamW, fp32 momentum
    muon_bf16_momentum_state_bytes: int = 0  # the same with a bf16 momentum_buffer (precision-aware)


def buffer_layout(params: Sequence[GptParam], dp: int, grad_reduce_in_fp32: bool) -> tuple[BufferLayout, Optional[int]]:
    """The layout megatron_opt's DDP builds for these params with the distributed optimizer and overlapped reduce."""
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                        overlap_param_gather=True, grad_reduce_in_fp32=grad_reduce_in_fp32)
    bucket_size = bucket_size_of(cfg, dp, one_bucket=False)
    layout = build_buffer_layout([p.numel for p in params], dp, bucket_size=bucket_size,
                                 pad_for_high_nccl_busbw=cfg.pad_buckets_for_high_nccl_busbw)
    return layout, bucket_size


def owned_elements(layout: BufferLayout) -> list[list[int]]:
    """Elements of each param every rank owns, from the layout's shard pieces: [param][rank]."""
    owned = [[0] * layout.shard_count for _ in layout.numels]
    for bucket in layout.buckets:
        for rank in range(layout.shard_count):
            for piece in layout.shard_pieces(bucket.index, rank):
                owned[piece.param_index][rank] += piece.param_range.size
    return owned


def muon_placements(params: Sequence[GptParam], layout: BufferLayout, split_qkv: bool) -> list[MatrixPlacement]:
    """One placement per Muon matrix, in param order (split QKV: Q, K and V are three problems)."""
    owned = owned_elements(layout)
    return [
        MatrixPlacement((p.shape[0], p.shape[1]), tuple(owned[i]),
                        pieces=3 if split_qkv and p.name.endswith("linear_qkv.weight") else 1)
        for i, p in enumerate(params) if is_muon_matrix(p)
    ]


def largest_owner_homes(placements: Sequence[MatrixPlacement]) -> list[int]:
    """Each matrix at the rank owning most of it (lowest rank on a tie): fewest bytes, no balancing."""
    return [max(range(len(p.owned)), key=lambda r: (p.owned[r], -r)) for p in placements]


def zero1_sends_per_rank(layout: BufferLayout, param_bytes: int, grad_bytes: int) -> int:
    """Bytes one rank sends per step in AdamW's ZeRO-1: ring reduce-scatter and all-gather of every bucket."""
    dp = layout.shard_count
    return sum((dp - 1) * (b.range.size // dp) * (grad_bytes + param_bytes) for b in layout.buckets)


def muon_sends_per_rank(placements: Sequence[MatrixPlacement], homes: Sequence[int], dp: int) -> list[int]:
    """Elements each rank sends for the homes: its piece to the home, or (at the home) every other owner's slice."""
    sent = [0] * dp
    for placement, home in zip(placements, homes):
        for rank, n in enumerate(placement.owned):
            if rank == home:
                sent[rank] += placement.numel - n
            elif n:
                sent[rank] += n
    return sent


def state_bytes_per_rank(params: Sequence[GptParam], layout: BufferLayout, param_bytes: int,
                         momentum_bytes: int = 4) -> tuple[list[int], list[int]]:
    """(AdamW ZeRO-1, Muon) optimizer bytes per rank: masters and rule state (module docstring)."""
    master = 0 if param_bytes == 4 else 4  # fp32 params are their own masters
    dp = layout.shard_count
    adamw, muon = [0] * dp, [0] * dp
    for bucket in layout.buckets:
        for rank in range(dp):
            pieces = layout.shard_pieces(bucket.index, rank)
            if pieces:
                adamw[rank] += (bucket.range.size // dp) * (master + 8)
            for piece in pieces:
                rule = momentum_bytes if is_muon_matrix(params[piece.param_index]) else 8
                muon[rank] += piece.param_range.size * (master + rule)
    return adamw, muon


def layout_row(model: str, shape: GptShape, dtype: str, dp: int, split_qkv: bool, homes_policy: str = "balanced",
               steps: int = 5) -> LayoutRow:
    param_bytes, grad_bytes = DTYPES[dtype]
    params = gpt_params(shape)
    layout, bucket_size = buffer_layout(params, dp, grad_reduce_in_fp32=grad_bytes == 4)
    placements = muon_placements(params, layout, split_qkv)
    if homes_policy == "balanced":
        homes = assign_homes(placements, dp, steps)
    elif homes_policy == "largest-owner":
        homes = largest_owner_homes(placements)
    else:
        raise ValueError(f"unknown home policy {homes_policy!r}: one of {', '.join(HOME_POLICIES)}")
    costs = rank_costs(placements, homes, dp, steps)
    sends = muon_sends_per_rank(placements, homes, dp)
    assert sum(sends) == traffic_elements(placements, homes)
    per_rank = zero1_sends_per_rank(layout, param_bytes, grad_bytes)
    adamw = per_rank * dp
    extra = sum(sends) * MUON_BYTES
    mean_cost = sum(costs) / dp
    adamw_state, muon_state = state_bytes_per_rank(params, layout, param_bytes)
    _, muon_bf16_state = state_bytes_per_rank(params, layout, param_bytes, momentum_bytes=2)
    return LayoutRow(
        model=model, params=sum(p.numel for p in params), dtype=dtype, dp=dp, bucket_size=bucket_size,
        buckets=len(layout.buckets), split_qkv=split_qkv, homes=homes_policy, muon_matrices=len(placements),
        straddling=sum(1 for p in placements if len(p.owners()) > 1),
        ns_max_over_mean=max(costs) / mean_cost if mean_cost else 1.0,
        adamw_bytes=adamw, muon_extra_bytes=extra,
        ratio=(adamw + extra) / adamw if adamw else float("inf"),
        busiest_rank_ratio=(per_rank + max(sends) * MUON_BYTES) / per_rank if per_rank else float("inf"),
        adamw_state_bytes=max(adamw_state), muon_state_bytes=max(muon_state),
        muon_bf16_momentum_state_bytes=max(muon_bf16_state),
    )


def markdown_table(rows: Sequence[LayoutRow]) -> str:
    head = ("| model | params | dtype | DP | buckets | QKV split | homes | Muon matrices | straddling | NS max/mean "
            "| AdamW MB/step | Muon extra MB/step | ratio | busiest rank |")
    return table(head, (
        f"| {r.model} | {r.params / 1e9:.3f}B | {r.dtype} | {r.dp} | {r.buckets} "
        f"| {'yes' if r.split_qkv else 'no'} "
        f"| {r.homes} | {r.muon_matrices} | {r.straddling} | {r.ns_max_over_mean:.3f} | {r.adamw_bytes / 1e6:,.1f} "
        f"| {r.muon_extra_bytes / 1e6:,.1f} | {r.ratio:.3f} | {r.busiest_rank_ratio:.3f} |" for r in rows))


def memory_table(rows: Sequence[LayoutRow]) -> str:
    """Per-rank optimizer memory (masters + rule state, the rank with most) of the rows."""
    head = ("| model | dtype | DP | AdamW ZeRO-1 MB/rank | Muon MB/rank | Muon / AdamW "
            "| Muon, bf16 momentum MB/rank | Muon bf16 / AdamW |")
    lines, seen = [], set()
    for r in rows:
        if (r.model, r.dtype, r.dp) in seen:  # the QKV split and the homes change no memory
            continue
        seen.add((r.model, r.dtype, r.dp))
        lines.append(
            f"| {r.model} | {r.dtype} | {r.dp} | {r.adamw_state_bytes / 1e6:,.1f} | {r.muon_state_bytes / 1e6:,.1f} "
            f"| {r.muon_state_bytes / r.adamw_state_bytes:.3f} | {r.muon_bf16_momentum_state_bytes / 1e6:,.1f} "
            f"| {r.muon_bf16_momentum_state_bytes / r.adamw_state_bytes:.3f} |")
    return table(head, lines)


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv(str), default=list(PRESETS),
                   help=f"presets, comma-separated ({', '.join(PRESETS)}), or 'custom' for the --layers ... flags")
    p.add_argument("--dp", type=_csv(int), default=[2, 4, 8, 16], help="data-parallel sizes (default 2,4,8,16)")
    p.add_argument("--dtypes", type=_csv(str), default=["bf16", "fp32"],
                   help="bf16 (bf16 params, fp32 grads), fp32, bf16-grads (bf16 params and grads)")
    p.add_argument("--split-qkv", type=_csv(str), default=["yes", "no"], help="yes, no or both (default)")
    p.add_argument("--homes", type=_csv(str), default=list(HOME_POLICIES), help="balanced, largest-owner")
    p.add_argument("--ns-steps", type=int, default=5)
    custom = p.add_argument_group("custom model (--models custom)")
    custom.add_argument("--layers", type=int, default=2)
    custom.add_argument("--hidden", type=int, default=64)
    custom.add_argument("--heads", type=int, default=2)
    custom.add_argument("--vocab", type=int, default=128)
    custom.add_argument("--seq", type=int, default=16)
    custom.add_argument("--ffn", type=int, default=0)
    custom.add_argument("--no-bias", action="store_true")
    custom.add_argument("--rope", action="store_true", help="no position embedding param")
    custom.add_argument("--swiglu", action="store_true")
    custom.add_argument("--untied", action="store_true")
    custom.add_argument("--rmsnorm", action="store_true", help="norms without bias")
    p.add_argument("--json", help="also write the rows (and the command) as JSON here")
    args = p.parse_args(argv)
    for name in args.models:
        if name != "custom" and name not in PRESETS:
            p.error(f"unknown model {name!r}: one of {', '.join(PRESETS)}, custom")
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}: one of {', '.join(DTYPES)}")
    for h in args.homes:
        if h not in HOME_POLICIES:
            p.error(f"unknown home policy {h!r}: one of {', '.join(HOME_POLICIES)}")
    if any(s not in ("yes", "no") for s in args.split_qkv):
        p.error("--split-qkv takes yes and/or no")
    if any(d < 2 for d in args.dp):
        p.error("--dp sizes must be >= 2 (DP 1 communicates nothing)")
    return args


def _shape(name: str, args: argparse.Namespace) -> GptShape:
    if name != "custom":
        return PRESETS[name]
    return GptShape(num_layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq,
                    ffn=args.ffn, bias=not args.no_bias, learned_position=not args.rope, swiglu=args.swiglu,
                    tied=not args.untied, norm_bias=not args.rmsnorm)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [layout_row(model, _shape(model, args), dtype, dp, split == "yes", homes, args.ns_steps)
            for model in args.models for dtype in args.dtypes for split in args.split_qkv
            for homes in args.homes for dp in args.dp]
    print(markdown_table(rows))
    print()
    print(memory_table(rows))
    if args.json:
        write_report(args.json, "scripts/bench_muon_layout.py", argv, rows)
    return 0


def write_report(path: str, script: str, argv: Optional[Sequence[str]], rows: Sequence) -> None:
    """The rows (dataclasses) as JSON at ``path``, with the date and the command that made them."""
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([script, *(sys.argv[1:] if argv is None else argv)]),
              "rows": [asdict(r) for r in rows]}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


__all__ = ["LayoutRow", "buffer_layout", "layout_row", "main", "markdown_table", "memory_table", "muon_placements",
           "owned_elements", "state_bytes_per_rank", "write_report"]
