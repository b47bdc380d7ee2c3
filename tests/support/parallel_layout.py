"""(A test model, not part of the package: the property tests in tests/unit/test_model_parallel_layout.py
compose the package's real layout and counting rule through it.)

A pure model of a model-parallel world: rank coordinates, a synthetic model, shard ownership and
the gradient-statistics count. No tensors, no process groups.

Why: with tensor, pipeline, context and expert parallelism, the gradient norm is right only if every
element of the logical model is counted exactly once in the whole world, and that depends on three
things at once: megatron-core's rank order (which ranks share a DP group), the bucket layout of each
DP group (which DP rank owns which element) and the counting rule (``stats_role.element_counts``).
This module composes the real pieces (``layout.build_buffer_layout``, ``layout.PartialSharding``,
``stats_role.element_counts``) over a synthetic model, so a property test can check the composition
for every layout that fits in a few ranks before DDP wires it to process groups.

Rank order follows megatron-core's ``parallel_state.RankGenerator`` with the default order
"tp-cp-ep-dp-pp": the dense decomposition has ep = 1, the expert one has cp = 1, tp = expert TP and
dp = expert DP = world / (expert TP * EP * PP). The dense gradient group is ``dp-cp``, the expert
one ``dp`` of the expert decomposition; with ``instances`` > 1 an instance is a consecutive block of
each group's ranks (``create_hierarchical_groups``, ``layout.PartialSharding``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_opt.distributed.layout import BufferLayout, PartialSharding, build_buffer_layout, partial_sharding
from megatron_opt.distributed.stats_role import element_counts
from megatron_opt.errors import InvalidConfigError

RANK_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default; the first token varies fastest


def orthogonal_rank_groups(sizes: Sequence[int], mask: Sequence[bool]) -> list[list[int]]:
    """megatron-core's ``generate_masked_orthogonal_rank_groups``: the groups spanning the masked
    dimensions of a world laid out as ``sizes`` (first dimension fastest), each in rank order of its
    masked coordinates (first masked dimension fastest)."""
    strides = [1]
    for s in sizes:
        strides.append(strides[-1] * s)
    masked = [(s, d) for s, d, m in zip(sizes, strides, mask) if m]
    unmasked = [(s, d) for s, d, m in zip(sizes, strides, mask) if not m]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        out = [0]
        for size, stride in dims:  # first dimension fastest
            out = [o + i * stride for i in range(size) for o in out]
        return out

    return [[g + r for r in offsets(masked)] for g in offsets(unmasked)]


def _groups(sizes: dict[str, int], token: str) -> list[list[int]]:
    order = RANK_ORDER.split("-")
    wanted = token.split("-")
    return orthogonal_rank_groups([sizes[t] for t in order], [t in wanted for t in order])


@dataclass(frozen=True)
class ParallelSizes:
    """A world's parallel sizes, as megatron-core's ``initialize_model_parallel`` takes them."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: Optional[int] = None  # None: the dense TP size, as megatron-core's default
    vpp: int = 1  # model chunks per pipeline stage
    instances: int = 1  # num_distributed_optimizer_instances

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def validate(self) -> None:
        """InvalidConfigError for a world megatron-core would refuse to build."""
        if min(self.tp, self.pp, self.dp, self.cp, self.ep, self.etp, self.vpp, self.instances) < 1:
            raise InvalidConfigError(f"every parallel size must be >= 1: {self}")
        if self.world_size % (self.etp * self.ep * self.pp):
            raise InvalidConfigError(f"expert TP x EP x PP must divide the world size {self.world_size}: {self}")
        if self.vpp > 1 and self.pp == 1:
            raise InvalidConfigError(f"virtual pipeline stages need PP > 1: {self}")
        if (self.dp * self.cp) % self.instances or self.expert_dp % self.instances:
            raise InvalidConfigError(f"instances must divide the (expert) data-parallel size: {self}")

    def dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    def expert_sizes(self) -> dict[str, int]:
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}


@dataclass(frozen=True)
class RankCoords:
    """One global rank's coordinates in the dense and the expert decomposition, and its gradient groups."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    dp_cp_ranks: tuple[int, ...]  # the dense gradient group (intra_dp_cp with one instance), sorted
    expert_dp_ranks: tuple[int, ...]  # the expert gradient group (intra_expt_dp with one instance)

    @property
    def dp_cp_position(self) -> int:
        return self.dp_cp_ranks.index(self.rank)

    @property
    def expert_dp_position(self) -> int:
        return self.expert_dp_ranks.index(self.rank)


def rank_coordinates(sizes: ParallelSizes) -> tuple[RankCoords, ...]:
    """Every global rank's coordinates, in megatron-core's rank order."""
    sizes.validate()
    dense, expert = sizes.dense_sizes(), sizes.expert_sizes()
    order = RANK_ORDER.split("-")

    def decompose(rank: int, dims: dict[str, int]) -> dict[str, int]:
        out = {}
        for t in order:
            out[t] = rank % dims[t]
            rank //= dims[t]
        return out

    dp_cp = {r: tuple(g) for g in _groups(dense, "dp-cp") for r in g}
    edp = {r: tuple(g) for g in _groups(expert, "dp") for r in g}
    if _groups(dense, "pp") != _groups(expert, "pp"):  # megatron-core asserts the same
        raise InvalidConfigError(f"dense and expert pipeline groups differ: {sizes}")
    coords = []
    for r in range(sizes.world_size):
        d, e = decompose(r, dense), decompose(r, expert)
        coords.append(RankCoords(rank=r, tp=d["tp"], cp=d["cp"], dp=d["dp"], pp=d["pp"], ep=e["ep"], etp=e["tp"],
                                 edp=e["dp"], dp_cp_ranks=dp_cp[r], expert_dp_ranks=edp[r]))
    return tuple(coords)


# ------------------------------------------------------------------------------------------------ the synthetic model
@dataclass(frozen=True)
class ModelDims:
    """Local sizes of the synthetic model's params (per TP or expert-TP slice where split)."""

    hidden: int = 3  # LayerNorm weight, row-parallel bias, router rows: TP-replicated
    column: int = 5  # per TP rank of a column-parallel weight
    vocab: int = 7  # per TP rank of the (vocab-parallel) tied embedding
    expert: int = 4  # per expert-TP rank of one expert's weight
    experts_per_rank: int = 0  # local experts per EP rank; 0: a dense model


@dataclass(frozen=True)
class LocalParam:
    """One param as a rank holds it: which logical elements it covers and its Megatron attributes."""

    key: str  # the logical param (the tied output weight shares the embedding's key)
    numel: int
    logical_offset: int  # its first element in the logical param (a TP slice's offset)
    tensor_model_parallel: bool = False
    shared: bool = False  # the last stage's tied copy
    expert: bool = False  # allreduce=False
    own_bucket: bool = False  # the tied embedding, on the first and the last stage


def logical_numels(sizes: ParallelSizes, dims: ModelDims) -> dict[str, int]:
    """The logical model: every param once, unsplit."""
    out = {"embedding": dims.vocab * sizes.tp, "final_ln": dims.hidden}
    for g in range(sizes.pp * sizes.vpp):
        out.update({f"l{g}.ln": dims.hidden, f"l{g}.qkv": dims.column * sizes.tp, f"l{g}.proj_bias": dims.hidden})
        if dims.experts_per_rank:
            out[f"l{g}.router"] = dims.hidden
            for e in range(dims.experts_per_rank * sizes.ep):
                out.update({f"l{g}.expert{e}.fc": dims.expert * sizes.etp, f"l{g}.expert{e}.bias": dims.hidden})
    return out


def chunk_params(sizes: ParallelSizes, dims: ModelDims, coords: RankCoords, chunk: int) -> tuple[LocalParam, ...]:
    """Model chunk ``chunk`` of the rank at ``coords``, in registration order (forward order).

    Chunk v of stage s holds layer v * PP + s (megatron-core's interleaving). The first layer's chunk
    holds the embedding; the last one the final norm and, with PP > 1, the tied output weight tagged
    ``shared`` (with PP = 1 the output layer reuses the embedding param itself).
    """
    g = chunk * sizes.pp + coords.pp
    last = sizes.pp * sizes.vpp - 1
    out: list[LocalParam] = []
    if g == 0:
        out.append(LocalParam("embedding", dims.vocab, coords.tp * dims.vocab, tensor_model_parallel=True,
                              own_bucket=sizes.pp > 1))
    out += [LocalParam(f"l{g}.ln", dims.hidden, 0),
            LocalParam(f"l{g}.qkv", dims.column, coords.tp * dims.column, tensor_model_parallel=True),
            LocalParam(f"l{g}.proj_bias", dims.hidden, 0)]
    if dims.experts_per_rank:
        out.append(LocalParam(f"l{g}.router", dims.hidden, 0))
        for j in range(dims.experts_per_rank):
            e = coords.ep * dims.experts_per_rank + j
            out += [LocalParam(f"l{g}.expert{e}.fc", dims.expert, coords.etp * dims.expert,
                               tensor_model_parallel=True, expert=True),
                    LocalParam(f"l{g}.expert{e}.bias", dims.hidden, 0, expert=True)]
    if g == last:
        out.append(LocalParam("final_ln", dims.hidden, 0))
        if last > 0:
            out.append(LocalParam("embedding", dims.vocab, coords.tp * dims.vocab, tensor_model_parallel=True,
                                  shared=True, own_bucket=True))
    return tuple(out)


# ------------------------------------------------------------------------------------------------ ownership and count
@dataclass(frozen=True)
class OwnedElements:
    """A run of one param's elements that one rank owns in its (expert) DP group's layout."""

    rank: int
    chunk: int
    expert: bool
    key: str
    logical_start: int
    logical_end: int
    instance: int  # the rank's optimizer instance in its gradient group
    counts: bool  # whether this rank counts these elements in the world's gradient statistics


CountRule = Callable[..., bool]  # element_counts's keyword signature


def buffer_layout(params: Sequence[LocalParam], shard_count: int, bucket_size: Optional[int]) -> BufferLayout:
    """The real layout of one buffer (``layout.build_buffer_layout``), the tied embedding in its own bucket."""
    return build_buffer_layout([p.numel for p in params], shard_count, bucket_size=bucket_size,
                               own_bucket=[p.own_bucket for p in params])


def owned_elements(sizes: ParallelSizes, dims: ModelDims, *, bucket_size: Optional[int] = None,
                   distributed_optimizer: bool = True,
                   rule: CountRule = element_counts) -> list[OwnedElements]:
    """Every run of elements each rank owns, over every chunk and its dense and expert buffers.

    Buffers are laid out as DDP does: one per (chunk, dense or expert), sharded over one instance of
    the gradient group (``shard_count`` = group size / instances) under the distributed optimizer, or
    held whole (all-reduced) without it. Pipeline ranks > 0 and chunks after the first get no
    bucketing, as Megatron-LM's get_model sets. ``rule`` decides what counts (``element_counts``
    unless a test substitutes a broken one).
    """
    if sizes.instances > 1 and not distributed_optimizer:
        raise InvalidConfigError("partial sharding needs the distributed optimizer")
    out: list[OwnedElements] = []
    for c in rank_coordinates(sizes):
        for chunk in range(sizes.vpp):
            params = chunk_params(sizes, dims, c, chunk)
            size = bucket_size if c.pp == 0 and chunk == 0 else None
            for expert in (False, True):
                members = [p for p in params if p.expert == expert]
                if not members:
                    continue
                position = c.expert_dp_position if expert else c.dp_cp_position
                group_size = len(c.expert_dp_ranks if expert else c.dp_cp_ranks)
                split: PartialSharding = partial_sharding(group_size, sizes.instances)
                sharded = distributed_optimizer and split.shard_count > 1
                layout = buffer_layout(members, split.shard_count if sharded else 1, size)
                shard_rank = split.shard_rank_of(position) if sharded else 0
                instance = split.instance_of(position)
                # The unsharded group is the instance (the whole group when instances == 1).
                group_rank = split.shard_rank_of(position)
                for b in range(len(layout.buckets)):
                    for piece in layout.shard_pieces(b, shard_rank):
                        p = members[piece.param_index]
                        counts = rule(shared=p.shared, tensor_model_parallel=p.tensor_model_parallel,
                                      expert_parallel=p.expert, tensor_parallel_rank=c.tp,
                                      expert_tensor_parallel_rank=c.etp, sharded=sharded, group_rank=group_rank,
                                      instance_rank=instance)
                        out.append(OwnedElements(c.rank, chunk, expert, p.key,
                                                 p.logical_offset + piece.param_range.start,
                                                 p.logical_offset + piece.param_range.end, instance, counts))
    return out


def world_counts(sizes: ParallelSizes, dims: ModelDims, owned: Sequence[OwnedElements]) -> dict[str, list[int]]:
    """How many times each logical element is counted in the world's gradient statistics (should be 1)."""
    counts = {k: [0] * n for k, n in logical_numels(sizes, dims).items()}
    for o in owned:
        if o.counts:
            row = counts[o.key]
            for i in range(o.logical_start, o.logical_end):
                row[i] += 1
    return counts


__all__ = ["RANK_ORDER", "CountRule", "LocalParam", "ModelDims", "OwnedElements", "ParallelSizes", "RankCoords",
           "buffer_layout", "chunk_params", "logical_numels", "orthogonal_rank_groups", "owned_elements",
           "rank_coordinates", "world_counts"]
