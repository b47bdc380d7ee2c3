"""Update rules, one file each (adamw.py, sgd.py, lion.py, muon.py), the ``UpdateRule`` base (base.py) and the
registry of the names ``OptimizerConfig.optimizer`` takes (registry.py)."""
from .adamw import AdamW, AdamWStep
from .base import Needs, UpdateRule
from .lion import Lion, LionStep
from .muon import Muon
from .registry import OPTIMIZER_NAMES, UPDATE_RULES, resolve_update_rule, update_rule_from_config
from .sgd import SGD, SGDStep

__all__ = ["UpdateRule", "Needs", "AdamW", "AdamWStep", "SGD", "SGDStep", "Lion", "LionStep", "Muon", "UPDATE_RULES",
           "OPTIMIZER_NAMES", "update_rule_from_config", "resolve_update_rule"]
