"""The registry: the one list of the update rules ``OptimizerConfig.optimizer`` (and Megatron-LM's
``--optimizer``) can name. Config validation, the CLI flags and the optimizer factory read it; a new
rule is added here, once."""
from __future__ import annotations

from typing import Any, Optional

from ...errors import UnsupportedConfigError
from .adamw import AdamW
from .base import Needs, UpdateRule
from .lion import Lion
from .muon import Muon
from .sgd import SGD

UPDATE_RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (AdamW, SGD, Lion, Muon)}
UPDATE_RULES["dist_muon"] = Muon  # Megatron-LM's synonym (its distributed Muon): the same rule here
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


def resolve_update_rule(config: Any, update_rule: Optional[UpdateRule] = None,
                        whole_tensors: bool = False) -> UpdateRule:
    """The rule an optimizer runs: ``update_rule`` when given (a user's own), else the config's; a rule
    that needs whole tensors is refused unless the caller runs it through the whole-tensor leaf
    (``whole_tensors=True``: get_megatron_optimizer does for Muon; docs/design.md)."""
    rule = update_rule if update_rule is not None else update_rule_from_config(config)
    if rule.needs is Needs.WHOLE_TENSORS and whole_tensors:
        return rule
    if rule.needs is not Needs.ELEMENTWISE:
        raise UnsupportedConfigError(
            f"update rule {type(rule).__name__} needs {rule.needs.value}; the distributed optimizer hands rules "
            f"owned element ranges only; get_megatron_optimizer(OptimizerConfig(optimizer='muon')) builds Muon with "
            f"its AdamW companion (docs/design.md, 'Rules that need whole tensors').")
    return rule


__all__ = ["UPDATE_RULES", "OPTIMIZER_NAMES", "names_in_words", "update_rule_from_config", "resolve_update_rule"]
