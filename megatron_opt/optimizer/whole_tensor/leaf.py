"""WholeTensorLeaf: the leaf of a rule that needs whole matrices (Muon), over the same ShardStore.

Its pass 2 has three parts. ``apply_update`` (called with every other leaf's) runs the elementwise
first part on the owned ranges (the momentum, leaving the update direction U per piece);
``finish_update`` (called by the step driver once every rank has agreed that the first parts
succeeded) runs the whole-tensor stage (matrix_exchange.MatrixExchange: U to each matrix's home,
orthogonalised there, the slices back) and the elementwise last part (decoupled weight decay and
the step, rounded into the param buffer). The param all-gather then follows as for every leaf.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import ops
from ...errors import UnsupportedConfigError
from ..leaf import OptimizerLeaf
from ..verify.float64_update import Float64Update
from ..rules.muon import (Muon, ns_relative_error, o_norm_bound, qkv_split_of, recompute_master,
                         recompute_momentum)
from ..state.shard_store import ShardStore
from .tensor_parallel_newton_schulz import orthogonalize_split, tensor_split_of
from .matrix_exchange import Matrix, MatrixExchange, MatrixKey, piece_key


class WholeTensorLeaf(OptimizerLeaf):
    """One ShardStore whose params the rule updates as whole matrices."""

    has_whole_tensor_stage = True

    def __init__(self, store: ShardStore) -> None:
        super().__init__(store)
        rule = store.rule
        if not isinstance(rule, Muon):
            raise UnsupportedConfigError(f"the whole-tensor stage runs Muon only, not {type(rule).__name__}.")
        for s in store.shards:
            if s.master.dtype != torch.float32:
                raise UnsupportedConfigError(f"Muon keeps fp32 masters, not {s.master.dtype}: leave "
                                             f"main_params_dtype at torch.float32 (and param remainders off).")
        chunk_of = {id(src): i for i, src in enumerate(store.sources)}
        self._chunk_of = chunk_of
        managed = store.managed_params()
        self.exchange = MatrixExchange([(chunk_of[id(src)], s) for src, s in store.published],
                                       selects=lambda p: id(p) in managed,
                                       qkv_split_of=lambda name, p: qkv_split_of(name, p, rule.split_qkv),
                                       pieces_of=rule.pieces, ns_steps=rule.num_ns_steps,
                                       tensor_split_of=lambda p, shard: tensor_split_of(
                                           p, shard.tensor_parallel_group, rule.tp_mode))
        self._multiplier_of = {id(m.unscale_factor): m for m in self.multipliers}
        self._directions: Optional[dict[MatrixKey, torch.Tensor]] = None
        self._found_inf: Optional[torch.Tensor] = None

    def apply_update(self, clip_coef: Optional[torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None:
        """The first, elementwise part: B = beta*B + (1-beta)*g and U, per owned piece. ``found_inf``
        (the step decided on the device, optimizer_cuda_graph): a device flag; nonzero keeps the momentum
        as it was (and, in ``finish_update``, the masters), read by no host: the exchange and
        Newton-Schulz still run, on every rank alike, and their result is discarded."""
        ops.advance_step(self.step, found_inf, backend=self.backend)
        self._directions = None
        self._found_inf = found_inf
        for multiplier in self.multipliers:
            multiplier.fold_clip(clip_coef)
        rule: Muon = self.rule
        directions: dict[MatrixKey, torch.Tensor] = {}
        for src, s in self._owned_with_source():
            scale = self._multiplier_of[id(s.shard.unscale_factor)].update_scale
            buf = s.state["momentum_buffer"]
            for pc in s.shard.pieces:
                a, b = pc.shard_range.start, pc.shard_range.end
                # A 16-bit momentum (precision-aware) is widened, updated in fp32 and rounded once on
                # store; U comes from the fp32 value, as verify mode's float64 recomputation assumes.
                in_place = buf.dtype == torch.float32 and found_inf is None
                work = buf[a:b] if in_place else buf[a:b].to(torch.float32, copy=True)
                directions[piece_key(self._chunk_of[id(src)], s.shard, pc.param_index)] = \
                    rule.momentum_direction(s.shard.grad[a:b], scale, work)
                if not in_place:
                    buf[a:b].copy_(_unless_skipped(found_inf, buf[a:b], work))
        self._directions = directions

    def finish_update(self) -> None:
        """The whole-tensor stage and the last, elementwise part (every rank of the group calls it)."""
        directions, self._directions = self._directions, None
        if directions is None:
            raise RuntimeError("WholeTensorLeaf.finish_update() without apply_update() in this step.")
        rule: Muon = self.rule
        device = self.step.device
        updates = self.exchange.run(directions, self._orthogonalize, device)
        found_inf, self._found_inf = self._found_inf, None
        # The step decided on the device reads lr / wd from the staged device table (a CUDA graph
        # replays with the values staged before it); the host step from the param groups.
        table = self._hyperparams.table if found_inf is not None else None
        for src, s in self._owned_with_source():
            for pc, gid in zip(s.shard.pieces, s.table.group):
                a, b = pc.shard_range.start, pc.shard_range.end
                group = self.param_groups[gid]
                lr, wd = ((float(group["lr"]), float(group["weight_decay"])) if table is None
                          else (table[gid, 0], table[gid, 1]))
                master = s.master[a:b] if found_inf is None else s.master[a:b].clone()
                rule.apply_direction(master, updates[piece_key(self._chunk_of[id(src)], s.shard, pc.param_index)],
                                     lr, wd)
                if found_inf is not None:
                    s.master[a:b].copy_(_unless_skipped(found_inf, s.master[a:b], master))
                if s.param_out is not None:
                    s.param_out[a:b].copy_(s.master[a:b])

    def float64_expectation(self, masters: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor],
                            multipliers: Sequence[torch.Tensor]) -> list[Float64Update]:
        """Verify mode (a collective, like the step): this step recomputed in float64 from each owned
        shard's pre-step ``masters`` and ``momenta`` and float64 gradient ``multipliers``; per shard the
        expected master and momentum over its pieces (zero elsewhere) with their bounds (rules/muon.py:
        part 2's bound is relative to the whole matrix)."""
        rule: Muon = self.rule
        shards = self._owned_with_source()
        directions: dict[MatrixKey, torch.Tensor] = {}
        momentum_values = []
        for (src, s), b0, mult in zip(shards, momenta, multipliers):
            b, db, u = recompute_momentum(rule, s.shard.grad.double() * mult, b0.double())
            momentum_values.append((b, db))
            for pc in s.shard.pieces:
                directions[piece_key(self._chunk_of[id(src)], s.shard, pc.param_index)] = \
                    u[pc.shard_range.start:pc.shard_range.end]
        updates = self.exchange.run(directions, self._orthogonalize, self.step.device, dtype=torch.float64)
        matrices = {m.key: m for m in self.exchange.matrices}
        relative = ns_relative_error(rule.fp32_matmul_prec, self.step.device)
        out = []
        for (src, s), w0, (b, db) in zip(shards, masters, momentum_values):
            w, dw = torch.zeros_like(b), torch.zeros_like(b)
            for pc, gid in zip(s.shard.pieces, s.table.group):
                a, e = pc.shard_range.start, pc.shard_range.end
                key = piece_key(self._chunk_of[id(src)], s.shard, pc.param_index)
                group = self.param_groups[gid]
                m = matrices[key]
                o_tol = relative * o_norm_bound(rule, m.shape, m.qkv_split,
                                                m.tensor_split.multiple() if m.tensor_split else (1, 1))
                w[a:e], dw[a:e] = recompute_master(w0[a:e].double(), updates[key], float(group["lr"]),
                                                   float(group["weight_decay"]), o_tol)
            out.append(Float64Update({"master": w, "momentum_buffer": b}, {"master": dw, "momentum_buffer": db}))
        return out

    def _orthogonalize(self, items: Sequence[tuple[torch.Tensor, Matrix]]) -> list[torch.Tensor]:
        """O of every homed matrix (in matrix order): alone on its block, or across TP in the rule's
        tp_mode, one batch per TP group (a collective: the group's ranks home the same matrices)."""
        rule: Muon = self.rule
        out: list[Optional[torch.Tensor]] = [None] * len(items)
        batches: dict[int, list[int]] = {}
        for i, (u, m) in enumerate(items):
            if m.tensor_split is not None:
                batches.setdefault(id(m.tensor_split.group), []).append(i)
        for indices in batches.values():  # the collectives first: a local failure below leaves no peer waiting
            done = orthogonalize_split(rule, [(items[i][0], items[i][1].qkv_split, items[i][1].tensor_split)
                                              for i in indices])
            for i, o in zip(indices, done):
                out[i] = o
        for i, (u, m) in enumerate(items):
            if m.tensor_split is None:
                out[i] = rule.orthogonalize(u, m.qkv_split)
        return out

    def _owned_with_source(self):
        return [(s.source, s) for s in self.store.shards]


def _unless_skipped(found_inf: Optional[torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the device flag ``found_inf`` is nonzero (no host read: the
    CUDA-graph step must not synchronise)."""
    return new if found_inf is None else torch.where(found_inf != 0, old.to(new.dtype), new)


__all__ = ["WholeTensorLeaf"]
