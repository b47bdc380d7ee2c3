"""train_step: one optimizer step over a list of micro-batches, with exact loss normalisation.

Normalisation happens exactly once (rules 10-12 of docs/contract.md): every micro-batch backpropagates its
*unnormalised* loss (times the loss scale), the buckets are reduced with SUM, and the step's
denominator is handed to the DDP (``set_loss_divisor``), which owns the normalisation and publishes
it to the optimizer as one unscale factor per shard. There is no pass over the gradients for
normalisation at any accumulation count.

Loss modes:
  * ``"per_token"`` (Megatron's calculate_per_token_loss): ``loss_fn`` returns
    ``(sum of token losses, supervised token count[, {aux name: aux sum}])``. The denominator is
    N = the token count summed over every micro-batch of the step and every data-parallel rank
    (not tensor/context-parallel copies), clamped to >= 1 only once it is global.
  * ``"mean"``: ``loss_fn`` returns ``(mean loss[, {aux name: aux mean}])`` per micro-batch; the
    denominator is GA * DP, so the result is the mean over micro-batches and ranks.
One all-reduce per step carries N and the loss sums; it is launched before the last micro-batch's
backward so it overlaps with it.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from . import collectives
from .errors import RankError
from .distributed.ddp import DistributedDataParallel
from .optimizer.step import phase_timers

logger = logging.getLogger("megatron_opt")

LossFn = Callable[[torch.nn.Module, Any], tuple]
LOSS_MODES = ("per_token", "mean")


@dataclass
class TrainStepResult:
    loss: float  # main loss / denominator, identical on every rank (rule 15 of docs/contract.md)
    success: bool
    grad_norm: Optional[float]  # unscaled global norm before clipping; None on a skipped step
    num_zeros: Optional[int]
    loss_scale: float
    lr: float
    skipped_steps: int  # running count
    num_tokens: int  # global denominator before clamping (tokens, or GA*DP in mean mode)
    skip_reason: Optional[str] = None
    aux_losses: dict[str, float] = field(default_factory=dict)


def _split_loss_output(out: Any, mode: str) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    if not isinstance(out, (tuple, list)):
        out = (out,)
    want = 2 if mode == "per_token" else 1
    if len(out) not in (want, want + 1):
        form = "(loss_sum, num_tokens[, aux_sums])" if mode == "per_token" else "(mean_loss[, aux_means])"
        raise ValueError(f"train_step(loss_mode={mode!r}): loss_fn must return {form}, got {len(out)} values.")
    what = "the sum of token losses" if mode == "per_token" else "the mean loss"
    loss = _scalar_tensor(out[0], f"loss_fn's first value ({what})", needs_graph=True)
    count = None
    if mode == "per_token":
        if isinstance(out[1], torch.Tensor) and out[1].numel() != 1:
            raise ValueError(f"train_step: loss_fn's second value must be the number of supervised tokens (one "
                             f"number), got a tensor of shape {tuple(out[1].shape)}; return labels.ne(-100).sum().")
        count = torch.as_tensor(out[1])
    aux: dict = {}
    if len(out) > want:
        if not isinstance(out[want], dict):
            raise ValueError(f"train_step: loss_fn's aux losses must be a dict {{name: scalar tensor}}, got "
                             f"{type(out[want]).__name__}.")
        aux = {k: _scalar_tensor(v, f"aux loss {k!r}", needs_graph=False) for k, v in out[want].items()}
    return loss, count, aux


def _scalar_tensor(value: Any, what: str, needs_graph: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"train_step: {what} must be a scalar torch.Tensor"
                         f"{' with its autograd graph' if needs_graph else ''}, got {type(value).__name__}.")
    if value.numel() != 1:
        raise ValueError(f"train_step: {what} must be a scalar tensor (sum or average it), got shape "
                         f"{tuple(value.shape)}.")
    return value.reshape(())


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_size(batch[0])
    raise ValueError("train_step cannot infer the micro-batch size; pass samples_per_step.")


def _agree(groups: list, failure: Optional[BaseException], aux_names: Optional[list]) -> None:
    """One small MAX all-reduce per group: every rank learns whether any rank failed or returned other
    aux losses, and all raise RankError together."""
    collectives.agree_each_step(
        "train_step failed", failure, groups, fingerprint=[("aux loss names", aux_names)], error_type=RankError,
        fix="The ranks' loss_fn returned different aux losses: every rank must return the same aux names "
            "(return 0 for a term a rank does not have).")


def canonical_lr(param_groups: Sequence[dict]) -> float:
    """The lr of the first group that follows the default schedule (what Megatron-LM logs)."""
    for group in param_groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(param_groups[0]["lr"])


def train_step(
    model: DistributedDataParallel,
    optimizer: Any,
    scheduler: Optional[Any],
    microbatches: Sequence[Any],
    loss_fn: LossFn,
    *,
    loss_mode: str = "per_token",
    samples_per_step: Optional[int] = None,
) -> TrainStepResult:
    """Forward and backward every micro-batch, step the optimizer once, advance the LR schedule by the
    step's sample count only if the step succeeded.

    ``loss_fn(model, microbatch)`` runs the forward pass and returns the loss terms described in the
    module docstring. Auxiliary terms (MoE load balancing, z-loss, ...) are added to the loss that is
    backpropagated and share its denominator; they are reported separately in ``aux_losses``.
    """
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}.")
    if not isinstance(model, DistributedDataParallel):
        raise TypeError("train_step needs the megatron_opt.DistributedDataParallel-wrapped model.")
    if loss_mode == "per_token" and model.ddp_config.average_in_collective:
        raise ValueError("per-token loss needs SUM reductions: set DistributedDataParallelConfig."
                         "average_in_collective=False (the 1/N normalisation replaces the average).")
    dp_group = model.data_parallel_group
    device = model.grad_scale_factor.device

    # Every rank reaches _agree() before the last backward, whatever failed before it, so one rank's
    # error (a bad micro-batch, a loss_fn raising, no micro-batches at all) is every rank's error
    # instead of a rank waiting in a collective the failed one never joins.
    aux_names: Optional[list[str]] = None
    totals: Optional[torch.Tensor] = None  # [denominator, samples, loss sum, aux sums...], local to this rank
    handle = None
    last = len(microbatches) - 1
    count_samples = scheduler is not None and samples_per_step is None
    try:
        model.zero_grad_buffer()  # also checks that the params were not changed after wrapping
        optimizer.zero_grad()
        if not microbatches:
            raise ValueError("train_step needs at least one micro-batch on every rank (this rank got none).")
        for i, batch in enumerate(microbatches):
            sync = contextlib.nullcontext() if i == last else model.no_sync()
            with sync:
                loss, count, aux = _split_loss_output(loss_fn(model, batch), loss_mode)
                if aux_names is None:
                    aux_names = sorted(aux)
                    totals = torch.zeros(3 + len(aux_names), dtype=torch.float64, device=device)
                if sorted(aux) != aux_names:
                    raise ValueError(f"micro-batch {i} returned aux losses {sorted(aux)}, earlier ones {aux_names}.")
                terms = [loss] + [aux[name] for name in aux_names]
                denominator = count if loss_mode == "per_token" else torch.ones(())
                totals += torch.stack([denominator.to(device, torch.float64),
                                       torch.tensor(float(_batch_size(batch)) if count_samples else 0.0,
                                                    dtype=torch.float64, device=device)] +
                                      [t.detach().to(device, torch.float64).reshape(()) for t in terms])
                if i == last:
                    _agree(model.agreement_groups, None, aux_names)
                    # all counts are known: overlap the one all-reduce with the last backward
                    handle = collectives.all_reduce(totals, dp_group, async_op=True)
                optimizer.scale_loss(sum(terms)).backward()
    except RankError:
        raise
    except Exception as exc:  # noqa: BLE001  (re-raised on every rank by _agree)
        if handle is not None:
            raise  # the last backward failed: the other ranks are already reducing (documented)
        _agree(model.agreement_groups, exc, aux_names)
    handle.wait()
    model.set_loss_divisor(totals[0].clamp(min=1.0))  # only the global count is clamped

    # Megatron-LM's train_step timers (phase_timers), from the optimizer's config: the gradient sync
    # (step() would wait for it first), then the step.
    config = getattr(optimizer, "config", None)
    with phase_timers.phase(config, "megatron_opt.all_grads_sync", phase_timers.GRAD_SYNC):
        model.finish_grad_sync()
    with phase_timers.phase(config, "megatron_opt.optimizer", phase_timers.OPTIMIZER):
        success, grad_norm, num_zeros = optimizer.step()
    if success and scheduler is not None:
        # The global sample count, summed over the ranks in the all-reduce above: ranks whose
        # micro-batches differ in size still advance their schedulers identically.
        scheduler.step(increment=samples_per_step if samples_per_step is not None else int(totals[1].item()))
    # One host read for the report (the optimizer already synchronised once for its decision).
    values = torch.cat([totals, optimizer.get_loss_scale().to(totals).reshape(1)]).tolist()
    reason = getattr(optimizer, "last_skip_reason", None)
    return TrainStepResult(
        loss=values[2] / max(values[0], 1.0),
        success=success,
        grad_norm=grad_norm,
        num_zeros=num_zeros,
        loss_scale=values[-1],
        lr=canonical_lr(optimizer.param_groups),
        skipped_steps=getattr(optimizer, "skipped_steps", 0),
        num_tokens=int(values[0]),
        skip_reason=None if success or reason is None else str(reason.value),
        aux_losses={name: values[3 + k] / max(values[0], 1.0) for k, name in enumerate(aux_names or [])},
    )
