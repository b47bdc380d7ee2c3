"""The optimizer state as code outside the optimizer sees it: per parameter, in model space.

A rank owns one contiguous range of each flattened param it has a piece of (or nothing). The view
lists those pieces with their state tensors (the fp32 master and the update rule's state), names
every param by its model-space key, and says which rule keeps which param. Checkpoints
(``megatron_opt.checkpoint``) and the in-memory ``state_dict()`` both read and write optimizer state
through this view only, so the two cannot disagree, and neither depends on the data-parallel layout.

    OptimizerStateView   what DistributedOptimizer and ChainedOptimizer implement
    StateLeaf            what one leaf (an OptimizerLeaf) offers the view
    LeafView             one leaf, seen from outside: rule, pieces (with their chunk), groups, counter
    ParamEntry           one trainable param of the model chunks, with its key
    StateSlice           one state tensor of one owned piece, with its place in the param
    MatrixStateTensor    one per-matrix state tensor (SOAP's L, Q_L, ...) of a matrix homed on this rank
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

from ...distributed.shard_view import GradSource
from ..rules.base import UpdateRule

MASTER = "master"


class PieceView(Protocol):
    """One owned param piece and views of its optimizer state (an OptimizerLeaf's PieceState)."""

    source: GradSource  # the model chunk
    name: str  # the param's name inside its model chunk
    param: torch.nn.Parameter
    param_start: int  # the piece's first element in the flattened param
    tensors: dict[str, torch.Tensor]  # 'master' and the rule's state, 1-D views over the piece

    def value_dtype(self, name: str) -> torch.dtype: ...

    def values(self, name: str) -> torch.Tensor: ...

    def write(self, name: str, values: torch.Tensor) -> None: ...


class StateLeaf(Protocol):
    """What a leaf of the optimizer (an OptimizerLeaf) offers the view."""

    rule: UpdateRule
    is_expert_parallel: bool
    sources: list[GradSource]  # the model chunks whose shards it keeps
    param_groups: list[dict]
    step: torch.Tensor  # updates applied so far (a device scalar)

    def piece_states(self) -> Sequence[PieceView]: ...


@dataclass(frozen=True)
class OwnedPiece:
    chunk: int  # index into the optimizer's model_chunks
    piece: PieceView


@dataclass(frozen=True)
class LeafView:
    """One leaf seen from outside the optimizer. ``param_groups`` and ``step`` are the live objects."""

    rule: UpdateRule
    expert_parallel: bool
    model_parallel: bool  # built with a model_parallel_group (tensor/pipeline parallelism)
    chunks: tuple[int, ...]  # the model chunks (indices into model_chunks) whose params it keeps
    pieces: tuple[OwnedPiece, ...]
    param_groups: list[dict]
    step: torch.Tensor
    # Which params of its chunks it keeps (None: all of its kind); Muon's split of one set of buffers
    # into two leaves (ShardStore's ``selects``).
    keeps: Optional[Callable[[torch.nn.Parameter], bool]] = None
    # Per-matrix state of the matrices homed on this rank (a whole-tensor rule's, e.g. SOAP's): (chunk, param
    # name, param, state name, live tensor, (offset, shape) of its block of the TP-local param).
    matrix_state: tuple[tuple[int, str, torch.nn.Parameter, str, torch.Tensor, tuple], ...] = ()

    @property
    def state_names(self) -> tuple[str, ...]:
        return (MASTER, *self.rule.state_dtypes())


def leaf_view(leaf: StateLeaf, model_chunks: Sequence[GradSource], model_parallel: bool = False) -> LeafView:
    """The view of one leaf; pieces are tagged with their chunk's index in ``model_chunks``."""
    def index_of(source: GradSource) -> int:
        for i, chunk in enumerate(model_chunks):
            if chunk is source:
                return i
        raise ValueError("an optimizer leaf keeps a model chunk that is not among the optimizer's model_chunks")

    pieces = tuple(OwnedPiece(index_of(ps.source), ps) for ps in leaf.piece_states())
    matrix_state = tuple((index_of(src), name, param, state, tensor, block)
                         for src, name, param, state, tensor, block in getattr(leaf, "matrix_state_tensors", list)())
    return LeafView(leaf.rule, leaf.is_expert_parallel, model_parallel, tuple(index_of(s) for s in leaf.sources),
                    pieces, leaf.param_groups, leaf.step, getattr(leaf, "selects", None), matrix_state)


@runtime_checkable
class OptimizerStateView(Protocol):
    """What checkpoint code may read and write of an optimizer (DistributedOptimizer, ChainedOptimizer)."""

    @property
    def model_chunks(self) -> list: ...

    def state_leaves(self) -> list[LeafView]: ...

    def scalar_state(self) -> dict[str, Any]: ...

    def load_scalar_state(self, state: dict[str, Any]) -> None: ...

    def sync_params_from_masters(self) -> None: ...

    def reload_model_params(self) -> None: ...


# ----------------------------------------------------------------------------- model-space names
@dataclass(frozen=True)
class ParamEntry:
    chunk: int
    name: str
    key: str  # the param's name in model space: ``name``, or ``chunk<c>.name`` with several chunks
    param: torch.nn.Parameter
    expert_parallel: bool


def param_key(chunk: int, name: str, num_chunks: int) -> str:
    return name if num_chunks == 1 else f"chunk{chunk}.{name}"


def param_entries(chunks: Sequence[GradSource]) -> list[ParamEntry]:
    """Every trainable param of every chunk, in buffer order (the same on every rank)."""
    out = []
    for c, chunk in enumerate(chunks):
        for shard in chunk.local_shards():
            for i in sorted(shard.params):
                out.append(ParamEntry(c, shard.names[i], param_key(c, shard.names[i], len(chunks)), shard.params[i],
                                      shard.is_expert_parallel))
    return out


def state_names(view: OptimizerStateView) -> list[str]:
    """'master' and every rule's state tensors, in a fixed order (one entry per rule class)."""
    names = [MASTER]
    for rule in {type(leaf.rule).__name__: leaf.rule for leaf in view.state_leaves()}.values():
        names += [n for n in rule.state_dtypes() if n not in names]
    return names


def state_names_of(leaves: Sequence[LeafView], entry: ParamEntry) -> tuple[str, ...]:
    """The state kept for ``entry``: that of the leaf holding its chunk's dense or expert params."""
    for leaf in leaves:
        if (entry.chunk in leaf.chunks and leaf.expert_parallel == entry.expert_parallel
                and (leaf.keeps is None or leaf.keeps(entry.param))):
            return leaf.state_names
    return ()  # a param no leaf keeps (its kind has no optimizer here)


def model_fingerprint(chunks: Sequence[GradSource]) -> list[list]:
    """[key, shape, dtype] of every trainable param: what must match for a load."""
    return [[e.key, list(e.param.shape), str(e.param.dtype)] for e in param_entries(chunks)]


def optimizer_fingerprint(view: OptimizerStateView) -> dict[str, Any]:
    return {"rules": [leaf.rule.name for leaf in view.state_leaves()], "state": state_names(view)}


def compatibility_problem(saved: dict[str, Any], mine: dict[str, Any], what: str) -> Optional[str]:
    """Why ``what`` (e.g. "the checkpoint"), saved with fingerprint ``saved`` ({"params": ...,
    "optimizer": ...}), cannot be loaded where the fingerprint is ``mine`` (None when it can).
    Without ``mine['optimizer']`` only the model is compared."""
    saved_params = {k: (shape, dtype) for k, shape, dtype in saved["params"]}
    my_params = {k: (shape, dtype) for k, shape, dtype in mine["params"]}
    missing, extra = sorted(set(my_params) - set(saved_params)), sorted(set(saved_params) - set(my_params))
    if missing or extra:
        return f"{what} is of a different model: params missing from it {missing[:5]}, params only in it {extra[:5]}"
    for key, (shape, dtype) in my_params.items():
        if saved_params[key] != (shape, dtype):
            return (f"param {key} is {saved_params[key][0]} {saved_params[key][1]} in {what} "
                    f"but {shape} {dtype} in this model")
    if "optimizer" in mine:
        if "optimizer" not in saved:
            return f"{what} has no optimizer state"
        saved_rules, my_rules = saved["optimizer"]["rules"], mine["optimizer"]["rules"]
        # How many leaves (a ChainedOptimizer's children) depends on the layout: at expert parallelism the
        # experts get their own. One rule everywhere is enough to match; mixed rules must match leaf by leaf.
        if set(saved_rules) != set(my_rules) or (len(set(my_rules)) > 1 and saved_rules != my_rules):
            return f"{what}'s optimizer is {saved_rules}, this one is {my_rules}"
    return None


# ----------------------------------------------------------------------------- owned state
@dataclass(frozen=True)
class StateSlice:
    """State ``state`` of one owned piece: elements [start, start + numel) of the flattened param ``key``.
    Masters read and write as fp32 values whatever their storage; the rule's state in its own dtype."""

    state: str
    key: str
    shape: torch.Size  # the param's
    start: int
    piece: PieceView

    @property
    def numel(self) -> int:
        return self.piece.tensors[self.state].numel()

    @property
    def device(self) -> torch.device:
        return self.piece.tensors[self.state].device

    @property
    def dtype(self) -> torch.dtype:
        return self.piece.value_dtype(self.state)

    def values(self) -> torch.Tensor:
        return self.piece.values(self.state)

    def write(self, values: torch.Tensor) -> None:
        self.piece.write(self.state, values)


def owned_slices(view: OptimizerStateView) -> list[StateSlice]:
    """Every state tensor of every piece this rank owns, keyed in model space."""
    num_chunks = len(view.model_chunks)
    return [StateSlice(name, param_key(op.chunk, op.piece.name, num_chunks), op.piece.param.shape,
                       op.piece.param_start, op.piece)
            for leaf in view.state_leaves() for op in leaf.pieces for name in op.piece.tensors]


@dataclass(frozen=True)
class MatrixStateTensor:
    """State ``state`` of one block of the (TP-local) matrix ``key`` (the whole matrix unless ``matrix_state_tp_size``
    cuts it: whole_tensor/state_blocks.py), kept on this rank, its home: written in place."""

    state: str
    key: str
    param: torch.nn.Parameter
    tensor: torch.Tensor
    block_offset: tuple[int, ...] = ()  # in the TP-local param (): at its origin
    block_shape: tuple[int, ...] = ()  # (): the whole TP-local param

    @property
    def offset(self) -> tuple[int, ...]:
        return tuple(self.block_offset) or (0,) * self.param.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.block_shape) or tuple(self.param.shape)

    @property
    def block_key(self) -> str:
        """``key``, with the block's offset where the block is not the whole param (the state_dict's key)."""
        if self.shape == tuple(self.param.shape):
            return self.key
        return f"{self.key}@{','.join(str(o) for o in self.offset)}"

    def write(self, values: torch.Tensor) -> None:
        self.tensor.copy_(values)


# Why a checkpoint of another tensor-parallel split cannot give a rank its per-matrix state (both checkpoint
# formats' refusals say it).
MATRIX_STATE_SPLIT = ("the per-matrix state of a whole-tensor rule (SOAP's, NorMuon's) belongs to the blocks of the "
                      "tensor-parallel split that saved it, so it loads at that split (any data-parallel size) with "
                      "the same optimizer; at another split set matrix_state_tp_size to the saved run's "
                      "tensor-parallel size (OptimizerConfig.rule_constants, the main job's --matrix-state-tp-size), "
                      "which keeps those blocks")


def homed_matrix_state(view: OptimizerStateView) -> list[MatrixStateTensor]:
    """Every per-matrix state tensor of the matrices homed on this rank, keyed in model space (none for
    rules whose state is elementwise)."""
    num_chunks = len(view.model_chunks)
    return [MatrixStateTensor(state, param_key(chunk, name, num_chunks), param, tensor, *block)
            for leaf in view.state_leaves() for chunk, name, param, state, tensor, block in leaf.matrix_state]


# isfinite() makes about 7 bytes of temporaries per element (abs, ==, !=, *): check in small slices,
# so the temporaries reuse the same few hundred KiB instead of raising a load's peak.
FINITE_CHECK_SLICE = 1 << 16


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """The name of the first floating tensor holding a NaN or an infinity (None if all are finite)."""
    for name, t in named:
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        for lo in range(0, flat.numel(), FINITE_CHECK_SLICE):
            if not torch.isfinite(flat[lo : lo + FINITE_CHECK_SLICE]).all():
                return name
    return None


__all__ = ["MASTER", "PieceView", "StateLeaf", "OwnedPiece", "LeafView", "leaf_view", "OptimizerStateView",
           "ParamEntry", "param_key", "param_entries", "state_names", "state_names_of", "model_fingerprint",
           "optimizer_fingerprint", "compatibility_problem", "StateSlice", "owned_slices", "MatrixStateTensor",
           "MATRIX_STATE_SPLIT", "homed_matrix_state", "first_nonfinite"]
