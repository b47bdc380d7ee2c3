"""Per-step validation of the hyperparameters held in an optimizer's torch-style ``param_groups``.

``OptimizerConfig`` checks its values once, at construction. The values the update actually uses are
read from ``optimizer.param_groups`` on every step, and those dicts are written after construction:
by the LR scheduler (``OptimizerParamScheduler.step`` sets ``lr`` and ``weight_decay``), by a
checkpoint load, and by user code. A NaN or negative ``lr`` there trains silently wrong (NaN weights,
or steps in the wrong direction), so :func:`check_param_groups` is meant to run once per step,
before the update, and costs a few Python float comparisons per group.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from ...errors import InvalidConfigError

_INF = math.inf

# Keys every group must hold (the update reads them), and keys checked only when present.
# Each must be a finite number >= 0.
REQUIRED_KEYS: tuple[str, ...] = ("lr", "weight_decay")
OPTIONAL_KEYS: tuple[str, ...] = ("max_lr", "min_lr", "lr_mult", "wd_mult")

_CULPRIT = "set by the LR scheduler or by code writing optimizer.param_groups"


def _bad_value(index: int, key: str, value: Any) -> InvalidConfigError:
    return InvalidConfigError(
        f"param_groups[{index}][{key!r}]={value!r} is out of range: it must be a finite number in [0, inf) "
        f"({_CULPRIT})."
    )


def check_param_groups(param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Raise InvalidConfigError unless every group's ``lr`` and ``weight_decay`` (and, where present,
    ``max_lr``, ``min_lr``, ``lr_mult`` and ``wd_mult``) are finite numbers >= 0.

    The message names the group index, the key, the value and the valid range. Python floats and
    ints are checked without conversion; a one-element tensor also works (at the cost of a sync).
    """
    for index, group in enumerate(param_groups):
        for key in REQUIRED_KEYS:
            if key not in group:
                raise InvalidConfigError(
                    f"param_groups[{index}] has no {key!r}: every group needs a finite {key} in [0, inf) "
                    f"(removed by the LR scheduler or by code writing optimizer.param_groups)."
                )
        for key in REQUIRED_KEYS + OPTIONAL_KEYS:
            value = group.get(key)
            if value is None and key in OPTIONAL_KEYS:
                continue
            try:
                ok = 0.0 <= value < _INF  # False for NaN, inf and negatives
            except (TypeError, RuntimeError):  # None in a required key, a string, a multi-element tensor
                ok = False
            if not ok:
                raise _bad_value(index, key, value)


__all__ = ["check_param_groups", "REQUIRED_KEYS", "OPTIONAL_KEYS"]
