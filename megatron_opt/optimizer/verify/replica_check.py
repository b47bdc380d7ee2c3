"""Verify mode's ``replica`` check: are the model params bitwise identical on every data-parallel rank?

Per bucket, one int64 checksum of the bits of its params (a sum of the words and a sum weighted by
position, so that a changed element and two swapped ones both show); all buckets over one group go
into one small MAX all-reduce of [c, -c], which differs from [max, -min] exactly when some rank's
checksum differs. Only then is the difference localised: the ranks exchange per-param checksums and
then the differing params themselves (all_gather_object), and every element is compared with the
copy of its owner, the rank whose optimizer updated it (with several owners, unsharded buckets or
partial sharding: the value most of its owners hold, ties to the lowest rank). A rank whose copy
differs from that is the rank at fault.

With tensor parallelism the same is done a second time over each shard's tensor-parallel group for
the params replicated across it (those without ``tensor_model_parallel``: LayerNorms, row-parallel
biases), whose copies must stay bitwise equal too. Every TP rank owns the same ranges of its copy, so
there the reference is the copy most TP ranks hold (ties: the lowest TP rank).

A checksum is not a hash: differences that cancel in both sums pass unnoticed (no plausible fault
does that).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch

from ... import collectives
from ...distributed.shard_view import LocalShard

_CHUNK = 1 << 16  # elements per checksum chunk: bounds the int64 temporaries (512 KiB)
_PERIOD = 251  # position weights cycle through 1..251: every product and sum below stays inside int64
_MASK62, _MASK54 = (1 << 62) - 1, (1 << 54) - 1
GroupOf = Callable[[LocalShard], Optional[torch.distributed.ProcessGroup]]
_INT_OF_SIZE = MappingProxyType({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32})  # 8 bytes: two words


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as flat signed integers (no copy)."""
    return t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()])


class Checksums:
    """Bit checksums of params on their device, with the position weights kept for reuse."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, torch.Tensor] = {}

    def _position_weights(self, n: int, device: torch.device) -> torch.Tensor:
        if device not in self._weights:
            self._weights[device] = torch.arange(_CHUNK, dtype=torch.int64, device=device) % _PERIOD + 1
        return self._weights[device][:n]

    def of_param(self, param: torch.Tensor) -> torch.Tensor:
        """[sum of the words, position-weighted sum], each below 2^54 (int64 on the param's device).
        Words are below 2^31 and chunks at most 2^20 long, so no sum overflows before it is masked."""
        words = _words(param)
        total = torch.zeros(2, dtype=torch.int64, device=words.device)
        for k, start in enumerate(range(0, words.numel(), _CHUNK)):
            chunk = words[start : start + _CHUNK].to(torch.int64)
            plain = chunk.sum()
            weighted = (chunk * self._position_weights(chunk.numel(), chunk.device)).sum()
            total[0] = (total[0] + plain).bitwise_and(_MASK62)
            total[1] = (total[1] + weighted + plain * (k % _PERIOD + 1)).bitwise_and(_MASK62)
        return total.bitwise_and(_MASK54)

    def of_bucket(self, shard: LocalShard, keep: Optional[ParamFilter] = None) -> torch.Tensor:
        """Two int64 checksums of every param of the shard's bucket (weighted by param position), or
        of those ``keep`` selects."""
        out = torch.zeros(2, dtype=torch.int64, device=shard.param.device)
        for k, i in enumerate(_indices(shard, keep)):
            s = self.of_param(shard.params[i])
            out[0] = (out[0] + s[0]).bitwise_and(_MASK62)
            out[1] = (out[1] + s[1] + s[0] * (k % _PERIOD + 1)).bitwise_and(_MASK62)
        return out


ParamFilter = Callable[[torch.nn.Parameter], bool]


def _indices(shard: LocalShard, keep: Optional[ParamFilter]) -> list[int]:
    return [i for i in sorted(shard.params) if keep is None or keep(shard.params[i])]


def replicated_across_tensor_parallel(param: torch.nn.Parameter) -> bool:
    """A param every TP rank holds whole (a ``tensor_model_parallel`` one holds a different slice on each)."""
    return not getattr(param, "tensor_model_parallel", False)


def tensor_parallel_group(shard: LocalShard) -> Optional[torch.distributed.ProcessGroup]:
    """The TP ranks holding copies of the shard's replicated params (None: one TP rank)."""
    return shard.tensor_parallel_group


def replica_group(shard: LocalShard) -> Optional[torch.distributed.ProcessGroup]:
    """Every rank holding a replica of the shard's bucket: the whole data-parallel group (all
    optimizer instances); None is the default group."""
    return shard.data_parallel_group if shard.data_parallel_group is not None else shard.group


def _by_group(shards: Sequence[LocalShard], group_of: GroupOf) -> list[tuple[Any, list[LocalShard]]]:
    """The shards grouped by replica group, in first-seen order (the same on every rank of a group)."""
    groups: list[tuple[Any, list[LocalShard]]] = []
    for shard in shards:
        group = group_of(shard)
        for g, members in groups:
            if g is group:
                members.append(shard)
                break
        else:
            groups.append((group, [shard]))
    return groups


def mismatched_buckets(shards: Sequence[LocalShard], checksums: Checksums, group_of: GroupOf = replica_group,
                       keep: Optional[ParamFilter] = None) -> list[tuple[Any, list[LocalShard]]]:
    """Per replica group (``group_of``: the data-parallel replicas, or ``tensor_parallel_group``) with
    more than one rank, the shards whose bucket checksum (over the params ``keep`` selects) differs on
    some rank: one MAX all-reduce per group. Every rank of a group gets the same answer."""
    out = []
    for group, members in _by_group(shards, group_of):
        if group is None and group_of is not replica_group:
            continue  # no tensor-parallel peers
        if collectives.world_size(group) == 1:
            continue
        sums = torch.stack([checksums.of_bucket(s, keep) for s in members]).to(collectives.flag_device(group))
        both = torch.cat([sums, -sums])  # MAX of each value and of its negation: [max, -min]
        collectives.all_reduce(both, group, op=torch.distributed.ReduceOp.MAX)
        n = len(members)
        differs = (both[:n] != -both[n:]).any(1).tolist()
        bad = [s for s, d in zip(members, differs) if d]
        if bad:
            out.append((group, bad))
    return out


def _owned_ranges(shard: LocalShard) -> dict[int, list[tuple[int, int]]]:
    ranges: dict[int, list[tuple[int, int]]] = {}
    for pc in shard.pieces:
        ranges.setdefault(pc.param_index, []).append((pc.param_range.start, pc.param_range.end))
    return ranges


def localise(group: Any, shards: Sequence[LocalShard], checksums: Checksums,
             report: Callable[[str, int, float, float, str], None], keep: Optional[ParamFilter] = None) -> None:
    """For the mismatched ``shards`` of one group: which params (of those ``keep`` selects) differ,
    and on which ranks. ``report(param name, global rank, max abs diff, rel diff, detail)`` is called
    once per (param, rank at fault), identically on every rank of the group. Two all_gather_objects."""
    mine = [{i: tuple(checksums.of_param(s.params[i]).tolist()) for i in _indices(s, keep)} for s in shards]
    everyone = collectives.gather_objects(mine, group)
    differing = [[i for i in _indices(s, keep) if len({e[b][i] for e in everyone}) > 1] for b, s in enumerate(shards)]
    payload = [{"instance": s.instance_rank, "owned": _owned_ranges(s),
                "values": {i: s.params[i].detach().reshape(-1).cpu().clone() for i in differing[b]}}
               for b, s in enumerate(shards)]
    copies = collectives.gather_objects(payload, group)
    ranks = collectives.global_ranks(group)
    for b, s in enumerate(shards):
        for i in differing[b]:
            per_rank = [c[b] for c in copies]
            _report_param(s.names[i], per_rank, i, ranks, report)


def _report_param(name: str, per_rank: list[dict], index: int, ranks: list[int],
                  report: Callable[[str, int, float, float, str], None]) -> None:
    values = torch.stack([p["values"][index] for p in per_rank])  # [ranks, elements]
    bits = values.view(_INT_OF_SIZE[values.element_size()]) if values.element_size() < 8 else values.view(torch.int64)
    n_ranks, numel = bits.shape
    owner = torch.zeros(n_ranks, numel, dtype=torch.bool)
    for r, p in enumerate(per_rank):
        for start, end in p["owned"].get(index, []):
            owner[r, start:end] = True
    # Per element, how many owners hold each rank's value; the reference is the value most owners
    # hold (argmax takes the lowest rank on a tie). An element no rank owns has rank 0 as reference.
    agree = torch.stack([((bits == bits[r]) & owner).sum(0) for r in range(n_ranks)]) * owner
    reference = agree.argmax(0)
    ref_bits = bits.gather(0, reference.unsqueeze(0)).squeeze(0)
    ref_vals = values.gather(0, reference.unsqueeze(0)).squeeze(0).double()
    for r in range(n_ranks):
        wrong = bits[r] != ref_bits
        count = int(wrong.sum())
        if not count:
            continue
        first = int(wrong.nonzero()[0])
        diff = (values[r].double() - ref_vals).abs()[wrong]
        rel = diff / ref_vals.abs()[wrong].clamp_min(torch.finfo(torch.float64).tiny)
        owner_ranks = owner[:, first].nonzero().flatten().tolist()
        whose = (f"the owner rank {ranks[owner_ranks[0]]}" if len(owner_ranks) == 1
                 else f"most of its owners (ranks {[ranks[o] for o in owner_ranks]})")
        report(name, ranks[r], float(diff.max()), float(rel.max()),
               f"{count} of {numel} elements differ from the copy of {whose} (first at element {first}: "
               f"{values[r, first].item()!r} instead of {ref_vals[first].item()!r})")


__all__ = ["Checksums", "replica_group", "mismatched_buckets", "localise"]
