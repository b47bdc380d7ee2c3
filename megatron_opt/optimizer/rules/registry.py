"""The registry: the one list of the update rules ``OptimizerConfig.optimizer`` (and Megatron-LM's
``--optimizer``) can name. Config validation, the CLI flags and the optimizer factory read it; a new
rule is added here, once."""
from __future__ import annotations

from typing import Any, Optional

from ...errors import UnsupportedConfigError
from .adamw import AdamW
from .base import Needs, UpdateRule
from .lion import Lion
from .sgd import SGD

UPDATE_RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (AdamW, SGD, Lion)}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(UPDATE_RULES)


def names_in_words() -> str:
    """The optimizer names for a message: "'adam', 'sgd' or 'lion'"."""
    quoted = [repr(n) for n in OPTIMIZER_NAMES]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def update_rule_from_config(config: Any) -> UpdateRule:
    """The rule an OptimizerConfig asks for, with its hyperparameters."""
    cls = UPDATE_RULES.get(config.optimizer)
    if cls is None:
        raise ValueError(f"no update rule named {config.optimizer!r}; known: {sorted(UPDATE_RULES)}.")
    return cls.from_config(config)


def resolve_update_rule(config: Any, update_rule: Optional[UpdateRule] = None) -> UpdateRule:
    """The rule an optimizer runs: ``update_rule`` when given (a user's own), else the config's; refused
    when it needs what the step does not hand a rule yet (whole tensors: docs/design.md)."""
    rule = update_rule if update_rule is not None else update_rule_from_config(config)
    if rule.needs is not Needs.ELEMENTWISE:
        raise UnsupportedConfigError(
            f"update rule {type(rule).__name__} needs {rule.needs.value}; the distributed optimizer hands rules "
            f"owned element ranges only (docs/design.md, 'Rules that need whole tensors').")
    return rule


__all__ = ["UPDATE_RULES", "OPTIMIZER_NAMES", "names_in_words", "update_rule_from_config", "resolve_update_rule"]
