"""The registry: every update rule of this folder, found by its file, and the names
``OptimizerConfig.optimizer`` (and Megatron-LM's ``--optimizer``) can give it. The optimizer factory, the
main job's flags and the checks of a config read it; a new rule is one more file here, registered by being
there (a rule class with a ``name`` defined in a module of this folder).

Where rules are built (``update_rule_from_config``: get_megatron_optimizer, DistributedOptimizer, the main
job's flag checks) the config is checked against the rule it names: the name, the precision-aware
optimizer, the rule's own settings (``check_config``) and its declared constants' ranges. OptimizerConfig
itself knows no rule (config.py imports nothing from optimizer/)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any, Optional

from ...errors import UnsupportedConfigError
from .base import CONFIG_OWNER, Needs, UpdateRule

_NOT_RULES = ("base", "registry", "whole_tensor_rule")  # the modules of this folder that hold no rule


def _rules_of_this_folder() -> tuple[type[UpdateRule], ...]:
    """The rule classes defined in this folder's modules, modules by name, classes in definition order."""
    found: list[type[UpdateRule]] = []
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if info.name in _NOT_RULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found += [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, UpdateRule)
                  and c.__module__ == module.__name__ and not inspect.isabstract(c) and "name" in vars(c)]
    return tuple(found)


RULES: tuple[type[UpdateRule], ...] = _rules_of_this_folder()
UPDATE_RULES: dict[str, type[UpdateRule]] = {n: cls for cls in RULES for n in cls.names()}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(UPDATE_RULES)


def names_in_words(names: tuple[str, ...] = OPTIMIZER_NAMES) -> str:
    """Optimizer names for a message: "'adam', 'sgd' or 'lion'"."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


# Names megatron-core reaches (Megatron-LM's --optimizer soap; its emerging-optimizer registry through the Python
# API: emerging-optimizers 0.3.0's) that megatron_opt does not run yet (issue #39, item 7): refused by name.
NOT_YET: dict[str, str] = {
    **{name: "an emerging-optimizers rule not implemented by megatron_opt yet" for name in (
        "scion", "polargrad", "mop", "spel", "sinkhorn_muon", "muon_hyperball", "laprop", "rekls")},
}


def rule_class(optimizer: str) -> type[UpdateRule]:
    """The rule an ``OptimizerConfig.optimizer`` value names (UnsupportedConfigError for an unknown name, and by
    name for the ones megatron-core has that megatron_opt does not run yet: ``NOT_YET``)."""
    cls = UPDATE_RULES.get(optimizer)
    if cls is None and optimizer in NOT_YET:
        raise UnsupportedConfigError(
            f"{CONFIG_OWNER}.optimizer={optimizer!r} is megatron-core's, but not supported by megatron_opt: "
            f"{NOT_YET[optimizer]} (issue #39). megatron_opt runs {names_in_words()}.")
    if cls is None:
        raise UnsupportedConfigError(
            f"{CONFIG_OWNER}.optimizer={optimizer!r} is not supported; use {names_in_words()}.")
    return cls


def update_rule_from_config(config: Any) -> UpdateRule:
    """The rule an OptimizerConfig asks for, with its constants, the config checked against it: the
    optimizer name, the precision-aware optimizer, the rule's own checks and its constants' ranges."""
    cls = rule_class(config.optimizer)
    if getattr(config, "use_precision_aware_optimizer", False) and not cls.precision_aware:
        takes = tuple(n for rule in RULES if rule.precision_aware for n in rule.names())
        raise UnsupportedConfigError(f"{CONFIG_OWNER}.use_precision_aware_optimizer=True supports optimizer "
                                     f"{names_in_words(takes)} only (got {config.optimizer!r}).")
    unknown = sorted(set(getattr(config, "rule_constants", None) or {}) - _own_constant_fields())
    if unknown:
        raise UnsupportedConfigError(f"{CONFIG_OWNER}.rule_constants names {unknown}, which no update rule "
                                     f"declares; known: {sorted(_own_constant_fields())}.")
    return cls.from_config(config)


def _own_constant_fields() -> set[str]:
    """The config names of every rule's declared constants (those ``rule_constants`` may carry)."""
    return {c.config_field for rule in RULES for c in rule.constants().values() if c.config_field is not None}


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


__all__ = ["NOT_YET", "RULES",
           "UPDATE_RULES", "OPTIMIZER_NAMES", "names_in_words", "rule_class", "update_rule_from_config",
           "resolve_update_rule"]
