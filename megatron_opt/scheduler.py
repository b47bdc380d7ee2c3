"""Learning-rate and weight-decay schedule, compatible with megatron-core's OptimizerParamScheduler.

The clock counts whatever the caller increments it by (Megatron-LM passes the global batch size, so
the clock is in samples). After every ``step(increment)`` each dict in ``optimizer.param_groups``
gets ``lr = get_lr(group)`` and ``weight_decay = get_wd(group) * group.get('wd_mult', 1.0)``.
Groups may override ``max_lr``, ``min_lr``, ``start_wd`` and ``end_wd``; ``init_lr`` and ``lr_mult``
are not per-group (``lr_mult`` is not read by the schedule at all).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Protocol

from .optimizer.build.param_groups import group_weight_decay

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class HasParamGroups(Protocol):
    """Anything with a torch-style ``param_groups`` list of dicts."""

    param_groups: list[dict[str, Any]]


def _cosine_down(ratio: float) -> float:
    """1 at ratio 0, falling along half a cosine period to 0 at ratio 1."""
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _wsd_anneal_coeff(style: str, ratio: float) -> float:
    """Fraction of (max_lr - min_lr) kept after ``ratio`` of the WSD annealing phase."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return _cosine_down(ratio)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unsupported lr_wsd_decay_style {style!r}; expected one of {WSD_DECAY_STYLES}")


class OptimizerParamScheduler:
    """Warmup-then-decay learning rate and increasing weight decay, written onto param groups.

    Arguments, defaults and checkpoint keys follow ``megatron.core.optimizer_param_scheduler``.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self) -> None:
        """Reject the configurations megatron-core asserts against (as ValueError)."""
        checks = [
            (self.min_lr >= 0.0, f"min_lr={self.min_lr} must be >= 0"),
            (self.max_lr >= self.min_lr, f"max_lr={self.max_lr} must be >= min_lr={self.min_lr}"),
            (self.init_lr <= self.max_lr, f"init_lr={self.init_lr} must be <= max_lr={self.max_lr}"),
            (self.lr_decay_steps > 0, f"lr_decay_steps={self.lr_decay_steps} must be > 0"),
            (
                self.lr_warmup_steps < self.lr_decay_steps,
                f"lr_warmup_steps={self.lr_warmup_steps} must be < lr_decay_steps={self.lr_decay_steps}",
            ),
            (self.start_wd >= 0.0, f"start_wd={self.start_wd} must be >= 0"),
            (self.end_wd >= self.start_wd, f"end_wd={self.end_wd} must be >= start_wd={self.start_wd}"),
            (
                self.lr_decay_style in LR_DECAY_STYLES,
                f"unsupported lr_decay_style {self.lr_decay_style!r}; expected one of {LR_DECAY_STYLES}",
            ),
            (
                self.wd_incr_style in WD_INCR_STYLES,
                f"unsupported wd_incr_style {self.wd_incr_style!r}; expected one of {WD_INCR_STYLES}",
            ),
            (
                not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set",
            ),
        ]
        if self.lr_decay_style == "WSD":
            checks += [
                (self.wsd_decay_steps is not None, "lr_decay_style='WSD' needs wsd_decay_steps"),
                (
                    self.lr_wsd_decay_style in WSD_DECAY_STYLES,
                    f"unsupported lr_wsd_decay_style {self.lr_wsd_decay_style!r}; "
                    f"expected one of {WSD_DECAY_STYLES}",
                ),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"OptimizerParamScheduler: {message}")

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """Weight decay at the current step, before the group's ``wd_mult``."""
        group = param_group if param_group is not None else {}
        start_wd = group.get("start_wd", self.start_wd)
        end_wd = group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps:
            return end_wd
        if self.wd_incr_style == "constant":
            if start_wd != end_wd:
                raise ValueError(
                    f"wd_incr_style='constant' needs start_wd == end_wd, got {start_wd} and {end_wd}"
                )
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = _cosine_down(1.0 - ratio)  # rises from 0 to 1; same rounding as megatron-core
        else:
            raise ValueError(f"unsupported wd_incr_style {self.wd_incr_style!r}")
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at the current step for ``param_group`` (its max_lr/min_lr win)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        step, warmup, decay_end = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps

        if warmup > 0 and step <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * step / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if step > decay_end:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # Measured from step 0, not from the end of warmup; continuous with warmup at its end.
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))

        ratio = (step - warmup) / (decay_end - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = _cosine_down(ratio)
        elif self.lr_decay_style == "WSD":
            # The annealing phase is the last wsd_decay_steps before lr_decay_steps.
            anneal_start = decay_end - self.wsd_decay_steps
            if step <= anneal_start:
                coeff = 1.0
            else:
                anneal_ratio = (step - anneal_start) / self.wsd_decay_steps
                coeff = _wsd_anneal_coeff(self.lr_wsd_decay_style, anneal_ratio)
        else:
            raise ValueError(f"unsupported lr_decay_style {self.lr_decay_style!r}")
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance the clock by ``increment`` and write lr / weight_decay onto every param group.

        Empty groups are updated too, so every rank reports the same lr.
        """
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            group["weight_decay"] = group_weight_decay(self.get_wd(group), group)

    def state_dict(self) -> dict:
        """The schedule's checkpoint entries (same keys as megatron-core)."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """Pick the constructor value (override) or the checkpoint value, refusing a silent change."""
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: constructor value {cls_value!r} and checkpoint value "
                f"{sd_value!r} for {name} differ; set override_opt_param_scheduler to keep the "
                f"constructor value or use_checkpoint_opt_param_scheduler to take the checkpoint's"
            )
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the schedule (legacy Megatron key names accepted), then recompute lr / wd."""

        def first(*keys: str) -> Any:
            for key in keys:
                if key in state_dict:
                    return state_dict[key]
            raise KeyError(f"OptimizerParamScheduler state dict has none of {keys}")

        self.max_lr = self._check_and_set(self.max_lr, first("start_lr", "max_lr"), "max_lr")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "min_lr")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps,
            first("warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "lr_warmup_steps",
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, first("end_iter", "decay_steps", "lr_decay_steps"), "lr_decay_steps"
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, first("decay_style", "lr_decay_style"), "lr_decay_style"
        )
        if "start_wd" in state_dict:  # checkpoints older than weight-decay scheduling lack these
            for name in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
                setattr(self, name, self._check_and_set(getattr(self, name), state_dict[name], name))
        self._validate()
        # The clock restarts from the checkpoint's value, then one step writes the restored values.
        self.num_steps = 0
        self.step(first("num_iters", "num_steps"))
