"""Verify mode (``OptimizerConfig.verify_interval = N``): on calls N, 2N, ... of ``step()``, on every
rank, three checks of the step against what must hold:

  replica  before the step (before its param all-gather can overwrite a bad copy): the model params
           as this step's forward and backward used them are bitwise identical on every rank of the
           data-parallel group, and params replicated across tensor-parallel ranks on every TP peer
           (optimizer/verify/replica_check.py);
  cast     before the step: every owned element of a 16-bit param equals its master cast to the
           param dtype (nearest even; with param remainders the split of the joined master), i.e.
           nothing changed either since the last update;
  update   after pass 2: this rank's new masters and update-rule state equal a float64
           recomputation (the rule's ``float64_update``) from a snapshot of the shard taken before
           the step and the reduced, unscaled, clipped gradients, within the bound of the fp32
           arithmetic (optimizer/verify/float64_update.py) plus the rounding of 16-bit stores; a skipped
           step must have changed nothing at all.

The checks only read the optimizer's tensors, outside the step proper (never inside a CUDA graph),
so a verified step is bitwise the step it would have been. The findings of every rank are agreed on
in one small all-reduce (and gathered only when there are some): with ``verify_action="raise"``
every rank raises the same VerificationError, with ``"warn"`` every rank logs the same WARNING and
training goes on. ``StepVerifier.report`` (``optimizer.verify_report``) says what was verified last.
Memory: one transient copy of this rank's optimizer shard (masters, 16-bit params, rule state).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from ... import collectives
from ...distributed.shard_view import LocalShard
from ...errors import UnsupportedConfigError, VerificationError
from ...ops import precision
from .float64_update import Float64Inputs, Float64Update
from .replica_check import (Checksums, localise, mismatched_buckets, replicated_across_tensor_parallel,
                            tensor_parallel_group)
from ..state.shard_store import OwnedShard
from ..step.decision import clip_coefficient
from ..rules.base import UpdateRule

logger = logging.getLogger("megatron_opt")

# Elements recomputed at once: bounds the float64 temporaries. On the CPU 2^15 (256 KiB each) runs
# about twice as fast as 2^18 (cache, allocator); on a GPU larger chunks mean fewer launches.
_CPU_CHUNK, _DEVICE_CHUNK = 1 << 15, 1 << 22


@dataclass(frozen=True)
class Finding:
    """One failed check: which, on which param, the rank at fault and the size of the difference."""

    check: str  # "replica", "update" or "cast"
    param: str
    rank: int  # the global rank at fault
    abs_diff: float
    rel_diff: float
    detail: str

    def describe(self) -> str:
        return (f"{self.check}: param '{self.param}', rank {self.rank} at fault: {self.detail}; max abs diff "
                f"{self.abs_diff:.6g}, max rel diff {self.rel_diff:.6g}")


@dataclass(frozen=True)
class VerifyReport:
    """What verify mode has done in this process (``optimizer.verify_report``)."""

    interval: int
    action: str
    step_calls: int  # calls of step() so far, skipped steps included
    last_verified_step: Optional[int]  # the step() call (counted from 1) verified last; None before the first
    verified_steps: int
    last_findings: tuple[Finding, ...]  # of the last verified step: empty when every check passed


@dataclass
class _ShardCopy:
    master: torch.Tensor
    param: Optional[torch.Tensor]  # the 16-bit param shard (None when the master is the fp32 param)
    state: dict[str, torch.Tensor]


@dataclass
class _Pending:
    """What begin() found and kept for finish(): the snapshot of every leaf before the step."""

    call: int
    findings: list[Finding]
    loss_scale: torch.Tensor  # float64: the scale pass 1 divides by (the scaler may change it later)
    steps: list[torch.Tensor]  # per leaf, its update counter before the step
    shards: list[list[_ShardCopy]]  # per leaf, per owned shard
    matrix_states: list[Optional[dict]]  # per leaf, its per-matrix state (SOAP's) where it keeps any, else None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def recompute_of(rule: UpdateRule) -> Callable[[Float64Inputs], Optional[Float64Update]]:
    """The rule's float64_update, which must be defined by the class that defines its ``apply``
    (or by a subclass of it): an inherited recomputation of another formula would be wrong."""
    mro = type(rule).__mro__
    apply_owner = next(c for c in mro if "apply" in vars(c))
    recompute_owner = next(c for c in mro if "float64_update" in vars(c))
    if recompute_owner is UpdateRule or not issubclass(recompute_owner, apply_owner):
        raise UnsupportedConfigError(
            f"OptimizerConfig.verify_interval > 0 needs a float64 recomputation of the update rule "
            f"{type(rule).__name__} for its 'update' check, and {apply_owner.__name__} defines apply() without "
            f"float64_update(): define float64_update() beside apply() (docs/usage.md, 'Verify mode'), or set "
            f"verify_interval=0.")
    return rule.float64_update


# ---------------------------------------------------------------------------------------------- helpers
def _piece_mask(mask: torch.Tensor, s: OwnedShard, lo: int = 0) -> torch.Tensor:
    """``mask`` (over shard elements [lo, lo + len), changed in place) with every element outside the
    pieces cleared: the bucket padding before, between (few, short gaps) and after them."""
    hi = lo + mask.numel()
    span = s.table.span() or (lo, lo)
    mask[: max(0, span[0] - lo)] = False
    mask[max(0, span[1] - lo) :] = False
    gaps = s.table.gap_index(mask.device)
    if gaps.numel():
        mask.index_fill_(0, gaps[(gaps >= lo) & (gaps < hi)] - lo, False)
    return mask


def _pieces_in(s: OwnedShard, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """(param name, piece start, piece end, param element of the piece start) of the pieces overlapping [lo, hi)."""
    for pc in s.shard.pieces:
        a, b = max(pc.shard_range.start, lo), min(pc.shard_range.end, hi)
        if a < b:
            yield s.shard.names[pc.param_index], a, b, pc.param_range.start + (a - pc.shard_range.start)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _storage_bound(values: torch.Tensor, arithmetic: torch.Tensor, dtype: torch.dtype, stochastic: bool
                   ) -> torch.Tensor:
    """How far a store into 16-bit ``dtype`` may move a value computed in fp32 (within ``arithmetic``
    of ``values``): half an ulp to nearest, a whole ulp stochastically, and one subnormal step near
    zero. (fp32 stores round nothing beyond the arithmetic, which the rule's bound covers.)"""
    info = torch.finfo(dtype)
    return (values.abs() + arithmetic) * (info.eps if stochastic else info.eps / 2) + info.tiny * info.eps


def _diffs(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.double() - want.double()).abs()
    rel = diff / want.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max()), float(rel.max())


def _piece_finding(check: str, name: str, rank: int, got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor,
                   describe: Callable[[int, int], str]) -> Finding:
    """The finding of one piece whose elements ``bad`` (a mask over the piece's ``got`` / ``want``) failed
    ``check``; ``describe(count, first)`` words it from the bad count and the first bad index."""
    first = int(bad.nonzero()[0])
    abs_diff, rel_diff = _diffs(got[bad], want[bad])
    return Finding(check, name, rank, abs_diff, rel_diff, describe(int(bad.sum()), first))


# ---------------------------------------------------------------------------------------------- cast
def _cast_of_master(s: OwnedShard) -> torch.Tensor:
    """What the shard's 16-bit param must hold: its master cast to the param dtype, as pass 2 stores it."""
    values = precision.load_master(s.master, s.param_out)
    if precision.is_remainder(s.master):
        param, remainder = torch.empty_like(s.param_out), torch.empty_like(s.master)
        precision.split_remainder(values, param, remainder)
        return param
    return values.to(s.param_out.dtype)


def cast_findings(shards: Sequence[OwnedShard], rank: int) -> list[Finding]:
    checked = [(s, _cast_of_master(s)) for s in shards if s.param_out is not None]
    if not checked:
        return []
    counts = torch.stack([_piece_mask(_words(s.param_out) != _words(want), s).sum() for s, want in checked]).tolist()
    findings = []
    for (s, want), count in zip(checked, counts):
        if not count:
            continue
        for name, a, b, element in _pieces_in(s, 0, s.table.numel):
            got, cast = s.param_out[a:b], want[a:b]
            bad = _words(got) != _words(cast)
            if bool(bad.any()):
                findings.append(_piece_finding("cast", name, rank, got, cast, bad, lambda count, first: (
                    f"{count} of {b - a} owned elements no longer equal their master cast to "
                    f"{str(got.dtype).replace('torch.', '')} (first at element {element + first}: param "
                    f"{got[first].item()!r}, master cast {cast[first].item()!r})")))
    return findings


# ---------------------------------------------------------------------------------------------- update
def _snapshot(s: OwnedShard) -> _ShardCopy:
    return _ShardCopy(s.master.clone(), None if s.param_out is None else s.param_out.clone(),
                      {n: t.clone() for n, t in s.state.items()})


@dataclass(frozen=True)
class _UpdateContext:
    recompute: Callable[[Float64Inputs], Optional[Float64Update]]
    param_groups: list[dict]
    step: int  # the 1-based index of this update
    multiplier: torch.Tensor  # float64 device scalar of the shard: unscale factor / loss scale * clip
    stochastic: bool
    # A whole-tensor leaf's recomputation of the whole shard (WholeTensorLeaf.float64_expectation):
    # sliced per chunk instead of calling ``recompute``.
    expected: Optional[Float64Update] = None


def _chunk_check(s: OwnedShard, c: _ShardCopy, ctx: _UpdateContext, lo: int, hi: int, gid: int, refine: bool = False
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per stored tensor of [lo, hi): (bad mask over piece elements, got, expected, tolerance). Out of
    tolerance counts as bad, NaN included; ``refine`` then lets equal values (infinities) and NaN
    where NaN is expected pass (the first pass only counts: refining costs passes)."""
    group = ctx.param_groups[gid]
    before = precision.load_master(c.master[lo:hi], None if c.param is None else c.param[lo:hi]).double()
    inputs = Float64Inputs(master=before, grad=s.shard.grad[lo:hi].double().mul_(ctx.multiplier),
                           state={n: t[lo:hi].double() for n, t in c.state.items()}, lr=float(group["lr"]),
                           weight_decay=float(group["weight_decay"]), step=ctx.step)
    expected = ctx.recompute(inputs) if ctx.expected is None else Float64Update(
        {n: v[lo:hi] for n, v in ctx.expected.values.items()},
        {n: v[lo:hi] for n, v in ctx.expected.tolerance.items()})
    if expected is None:
        raise UnsupportedConfigError("verify mode: the update rule's float64_update() returned None.")
    stored = {"master": s.master, **s.state}
    got_values = {"master": precision.load_master(s.master[lo:hi], None if s.param_out is None
                                                  else s.param_out[lo:hi]).double(),
                  **{n: t[lo:hi].double() for n, t in s.state.items()}}
    out = {}
    for name, got in got_values.items():
        want, tol = expected.values[name], expected.tolerance[name]
        dtype = stored[name].dtype if name != "master" or not precision.is_remainder(s.master) else torch.float32
        if dtype not in (torch.float32, torch.float64):  # a 16-bit store also rounds
            tol = tol + _storage_bound(want, tol, dtype, ctx.stochastic and dtype == torch.bfloat16)
        bad = torch.le((got - want).abs_(), tol).logical_not_()
        if refine:
            bad &= ~((got == want) | (got.isnan() & want.isnan()))
        out[name] = (_piece_mask(bad, s, lo), got, want, tol)
    return out


def _chunks(s: OwnedShard) -> Iterator[tuple[int, int, int]]:
    size = _CPU_CHUNK if s.master.device.type == "cpu" else _DEVICE_CHUNK
    for start, end, gid in s.table.group_runs():
        for lo in range(start, end, size):
            yield lo, min(lo + size, end), gid


def _update_detail(s: OwnedShard, ctx: _UpdateContext, c: _ShardCopy, lo: int, hi: int, gid: int,
                   rank: int) -> list[Finding]:
    findings = []
    for tensor, (bad, got, want, tol) in _chunk_check(s, c, ctx, lo, hi, gid, refine=True).items():
        for name, a, b, element in _pieces_in(s, lo, hi):
            sel = slice(a - lo, b - lo)
            piece_bad = bad[sel]
            if not bool(piece_bad.any()):
                continue
            p_got, p_want, p_tol = got[sel], want[sel], tol[sel]
            findings.append(_piece_finding("update", name, rank, p_got, p_want, piece_bad, lambda count, first: (
                f"{count} of {b - a} owned elements of its {tensor} differ from the float64 recomputation by more "
                f"than the tolerance (first at element {element + first}: {p_got[first].item()!r} instead of "
                f"{p_want[first].item()!r} +- {p_tol[first].item():.3g})")))
    return findings


def update_findings(shards: Sequence[OwnedShard], copies: Sequence[_ShardCopy], contexts: Sequence[_UpdateContext],
                    rank: int) -> list[Finding]:
    """The applied update of every owned shard against its float64 recomputation (one host read)."""
    work = [(s, c, ctx, lo, hi, gid) for s, c, ctx in zip(shards, copies, contexts) for lo, hi, gid in _chunks(s)]
    if not work:
        return []
    counts = torch.stack([sum(bad.sum() for bad, *_ in _chunk_check(s, c, ctx, lo, hi, gid).values())
                          for s, c, ctx, lo, hi, gid in work]).tolist()
    findings = []
    for (s, c, ctx, lo, hi, gid), count in zip(work, counts):
        if count:  # recomputed once more, for the details: only on a failure
            findings += _update_detail(s, ctx, c, lo, hi, gid, rank)
    return findings


def unchanged_findings(shards: Sequence[OwnedShard], copies: Sequence[_ShardCopy], rank: int) -> list[Finding]:
    """A skipped step: every stored tensor of every owned piece must be bitwise what it was."""
    findings = []
    for s, c in zip(shards, copies):
        pairs = [("master", s.master, c.master), *((n, s.state[n], c.state[n]) for n in s.state)]
        if s.param_out is not None:
            pairs.append(("param", s.param_out, c.param))
        for tensor, now, before in pairs:
            changed = _piece_mask(_words(now) != _words(before), s)
            if not bool(changed.any()):
                continue
            for name, a, b, element in _pieces_in(s, 0, s.table.numel):
                piece = changed[a:b]
                if bool(piece.any()):
                    findings.append(_piece_finding(
                        "update", name, rank, now[a:b].float(), before[a:b].float(), piece, lambda count, first: (
                            f"the step was skipped but {count} of {b - a} owned elements of its {tensor} changed "
                            f"(first at element {element + first})")))
    return findings


# ---------------------------------------------------------------------------------------------- per-matrix state
def matrix_state_findings(checks: Sequence[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor]],
                          rank: int) -> list[Finding]:
    """The per-matrix state checks of a rule that keeps it (WholeTensorLeaf.matrix_state_checks: param, check name,
    stored, recomputed, bound), on the home rank: out of bound, NaN included, is a finding."""
    findings = []
    for param, check, got, want, tol in checks:
        got, want, tol = got.reshape(-1), want.reshape(-1), tol.reshape(-1)
        bad = torch.le((got - want).abs(), tol).logical_not_() & ~(got == want)
        if bool(bad.any()):
            findings.append(_piece_finding("update", param, rank, got, want, bad, lambda count, first: (
                f"{count} of {got.numel()} elements of its per-matrix {check} differ from the float64 recomputation "
                f"by more than the tolerance (first at element {first}: {got[first].item()!r} instead of "
                f"{want[first].item()!r} +- {tol[first].item():.3g})")))
    return findings


def matrix_unchanged_findings(now: dict, before: dict, rank: int) -> list[Finding]:
    """A skipped step: every per-matrix state tensor (of every block: leaf.matrix_state_snapshot()) bitwise what it
    was."""
    findings = []
    for key, blocks in now.items():
        for block, state in enumerate(blocks):
            for name, t in state.items():
                changed = (_words(t) != _words(before[key][block][name])).reshape(-1)
                if bool(changed.any()):
                    findings.append(Finding("update", str(key), rank, float("nan"), float("nan"),
                                            f"a skipped step changed {int(changed.sum())} elements of its per-matrix "
                                            f"{name} (block {block})"))
    return findings


# ---------------------------------------------------------------------------------------------- the verifier
class VerifiedLeaf(Protocol):
    """What verify mode reads of a leaf (OptimizerLeaf's declared views), and nothing else."""

    rule: UpdateRule
    step: torch.Tensor
    param_groups: list[dict]

    def owned_shards(self) -> list[OwnedShard]: ...

    def published_shards(self) -> list[LocalShard]: ...


def _whole(leaf: Any) -> bool:
    return bool(getattr(leaf, "has_whole_tensor_stage", False))


def _keeps_matrix_state(leaf: Any) -> bool:
    return _whole(leaf) and bool(getattr(leaf, "has_matrix_state", False))


class StepVerifier:
    """Verify mode for one StepDriver: begin() before the step, finish() after it."""

    def __init__(self, leaves: Sequence[VerifiedLeaf], interval: int, action: str,
                 groups: Sequence[Optional[torch.distributed.ProcessGroup]]) -> None:
        self.leaves = list(leaves)
        self.interval = interval
        self.action = action
        self.groups = [g for g in groups if collectives.world_size(g) > 1]
        # A whole-tensor leaf recomputes its step itself (collectively, in finish()).
        self._recompute = [None if _whole(leaf) else recompute_of(leaf.rule) for leaf in self.leaves]
        self._checksums = Checksums()
        self._calls = 0
        self._verified = 0
        self._last_verified: Optional[int] = None
        self._last_findings: tuple[Finding, ...] = ()

    @staticmethod
    def from_config(leaves: Sequence[VerifiedLeaf], config: Any,
                    groups: Sequence[Optional[torch.distributed.ProcessGroup]]) -> Optional["StepVerifier"]:
        interval = int(getattr(config, "verify_interval", 0) or 0)
        if interval <= 0:
            return None
        return StepVerifier(leaves, interval, getattr(config, "verify_action", "raise"), groups)

    @property
    def report(self) -> VerifyReport:
        return VerifyReport(self.interval, self.action, self._calls, self._last_verified, self._verified,
                            self._last_findings)

    def begin(self, sources: Sequence[Any], loss_scale: torch.Tensor) -> Optional[_Pending]:
        """Count this step() call; on a verified one, check replicas and casts and snapshot the shards."""
        self._calls += 1
        if self._calls % self.interval:
            return None
        for src in sources:  # the params as the forward used them: no all-gather still in flight
            if src.param_gather.overlap_param_gather:
                src.finish_param_sync()
        rank = _rank()
        findings: list[Finding] = []

        def replica(name: str, at: int, abs_diff: float, rel_diff: float, detail: str) -> None:
            findings.append(Finding("replica", name, at, abs_diff, rel_diff, detail))

        published = [shard for leaf in self.leaves for shard in leaf.published_shards()]
        for group, shards in mismatched_buckets(published, self._checksums):
            localise(group, shards, self._checksums, replica)
        # Tensor parallelism: the copies of replicated params on the TP peers must be equal too.
        tp = dict(group_of=tensor_parallel_group, keep=replicated_across_tensor_parallel)
        for group, shards in mismatched_buckets(published, self._checksums, **tp):
            localise(group, shards, self._checksums, replica, keep=replicated_across_tensor_parallel)
        for leaf in self.leaves:
            findings += cast_findings(leaf.owned_shards(), rank)
        return _Pending(self._calls, findings, loss_scale.detach().double().clone(),
                        [leaf.step.clone() for leaf in self.leaves],
                        [[_snapshot(s) for s in leaf.owned_shards()] for leaf in self.leaves],
                        [leaf.matrix_state_snapshot() if _keeps_matrix_state(leaf) else None for leaf in self.leaves])

    def finish(self, pending: _Pending, skipped: torch.Tensor, grad_norm: torch.Tensor, clip_grad: float) -> None:
        """After the step: check the update (or that a skipped step changed nothing), agree with every
        rank, then raise VerificationError or log a WARNING. ``skipped``, ``grad_norm``: the step
        decision's device tensors."""
        rank = _rank()
        findings = list(pending.findings)
        applied = not bool(skipped.reshape(-1)[0] != 0)
        clip = torch.ones((), dtype=torch.float64, device=grad_norm.device)
        if applied and clip_grad > 0.0:  # an applied step has a finite norm: the coefficient is exact here
            clip = clip_coefficient(grad_norm.reshape(-1)[0], clip_grad)
        for leaf, recompute, step_before, copies, matrix_states in zip(self.leaves, self._recompute, pending.steps,
                                                                       pending.shards, pending.matrix_states):
            expected_step = int(step_before.reshape(-1)[0]) + (1 if applied else 0)
            if int(leaf.step.reshape(-1)[0]) != expected_step:
                findings.append(Finding("update", "(update counter)", rank, 1.0, 1.0,
                                        f"the update counter is {int(leaf.step.reshape(-1)[0])}, expected "
                                        f"{expected_step}"))
            if not applied:
                findings += unchanged_findings(leaf.owned_shards(), copies, rank)
                if matrix_states is not None:
                    findings += matrix_unchanged_findings(leaf.matrix_state_snapshot(), matrix_states, rank)
                continue
            contexts = [_UpdateContext(recompute, leaf.param_groups, expected_step,
                                       s.shard.unscale_factor.reshape(()).double() / pending.loss_scale.reshape(())
                                       * clip.to(s.master.device),
                                       bool(getattr(leaf.rule, "stochastic_rounding", False)))
                        for s in leaf.owned_shards()]
            if _whole(leaf):  # every rank of the group gets here (applied is the same everywhere)
                extra = {} if matrix_states is None else {"matrix_states_before": matrix_states}
                expected = leaf.float64_expectation([c.master for c in copies],
                                                    [c.state for c in copies],
                                                    [ctx.multiplier for ctx in contexts], **extra)
                contexts = [dataclasses.replace(ctx, expected=e) for ctx, e in zip(contexts, expected)]
                if matrix_states is not None:
                    findings += matrix_state_findings(leaf.matrix_state_checks(), rank)
            findings += update_findings(leaf.owned_shards(), copies, contexts, rank)
        agreed = self._agree(findings)
        self._verified += 1
        self._last_verified = pending.call
        self._last_findings = tuple(agreed)
        if agreed:
            self._fail(pending.call, agreed)

    def _agree(self, findings: list[Finding]) -> list[Finding]:
        """Every rank's findings, identical on every rank of the first group: one MAX all-reduce of a
        flag per group, and an all_gather_object only when some rank found something."""
        if not self.groups:
            return findings
        flag = torch.tensor([1.0 if findings else 0.0], dtype=torch.float64,
                            device=collectives.flag_device(self.groups[0]))
        for group in self.groups:
            collectives.all_reduce(flag, group, op=torch.distributed.ReduceOp.MAX)
        if flag.item() == 0:
            return []
        everyone = collectives.agree("verify mode", None, self.groups[0], payload=findings)
        merged = list(dict.fromkeys(f for rank_findings in everyone for f in rank_findings))
        if not merged:  # seen only through a later group: a model-parallel peer's finding
            merged = [Finding("peer", "(unknown)", -1, float("nan"), float("nan"),
                              "a check failed on a rank of another process group (a model-parallel peer)")]
        return merged

    def _fail(self, call: int, findings: list[Finding]) -> None:
        lines = "\n".join(f"  - {f.describe()}" for f in findings)
        message = f"megatron_opt verify mode: step() call {call} failed {len(findings)} check(s):\n{lines}"
        if self.action == "warn":
            logger.warning("%s", message)
            return
        raise VerificationError(message)


__all__ = ["StepVerifier", "VerifyReport", "Finding", "recompute_of", "cast_findings", "update_findings",
           "unchanged_findings"]
