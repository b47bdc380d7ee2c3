"""A rule is declared once (issue 38, item 3): its file's dataclass fields hold its constants, their
defaults and valid values (``constant(...)``). This one test checks what is not derived from that
declaration against it: OptimizerConfig's fields and defaults, and the main job's flags (derived, checked
here end to end: a flag's value reaches the rule), the checkpoint's param-group fields, the synonyms of an
optimizer name. (The kernel op set is derived from the same registry: test_kernel_instantiations.py.)"""
from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

import megatron_opt
from megatron_opt import core_config_fields
from megatron_opt.config import OptimizerConfig
from megatron_opt.megatron import arguments as megatron_args
from megatron_opt.optimizer.rules.base import SAME_AS_CONFIG, Constant
from megatron_opt.optimizer.rules.base import Needs
from megatron_opt.optimizer.rules.registry import RULES, update_rule_from_config

PACKAGE = Path(megatron_opt.__file__).resolve().parent
CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(OptimizerConfig)}
# OptimizerConfig fields named like a rule's that are not its constants: the rule's check_config reads them.
READ_BY_CHECK_CONFIG = {"muon_coefficient_type", "adaptive_muon_moment2_method"}


def declared() -> list[tuple[type, str, Constant, Any]]:
    """(rule, field name, declaration, default) of every declared constant with a config field."""
    return [(rule, name, c, rule.constant_defaults()[name]) for rule in RULES for name, c in rule.constants().items()
            if c.config_field is not None]


def _ids(cases):
    return [f"{rule.__name__}.{name}" for rule, name, *_ in cases]


def another_valid(c: Constant, default: Any) -> Any:
    """A valid value of the constant other than ``default``."""
    if c.choices:
        return next(v for v in c.choices if v != default)
    if isinstance(default, bool):
        return not default
    if c.integer or isinstance(default, int):
        return default + 1
    low = c.low if math.isfinite(c.low) else default - 1.0
    value = (low + default) / 2 if default != low else default + (1.0 if not math.isfinite(c.high) else
                                                                    (c.high - default) / 2)
    c.check("test", "value", value)
    return value


@pytest.mark.parametrize("rule, name, c, default", declared(), ids=_ids(declared()))
def test_optimizer_config_has_megatron_cores_constants_with_the_declared_default(rule, name, c, default):
    if c.config_field in CONFIG_FIELDS:  # megatron-core's field: ours has it, with the same default
        assert CONFIG_FIELDS[c.config_field].default == default, (c.config_field, default)
    else:  # the rule's own: carried by OptimizerConfig.rule_constants
        value = another_valid(c, default)
        config = OptimizerConfig(lr=1e-3, optimizer=rule.name, rule_constants={c.config_field: value})
        assert getattr(update_rule_from_config(config), name) == value
    c.check("OptimizerConfig", c.config_field, default)  # the default is valid


def test_every_rule_named_config_field_is_declared():
    """An OptimizerConfig field named after a rule (``lion_*``) is one of its declared constants."""
    prefixes = tuple(f"{n}_" for rule in RULES for n in rule.names())
    fields = {c.config_field for _, _, c, _ in declared()}
    stray = sorted(n for n in CONFIG_FIELDS if n.startswith(prefixes) and n not in fields | READ_BY_CHECK_CONFIG)
    assert not stray, f"OptimizerConfig fields named after a rule but not declared by it: {stray}"


@pytest.mark.parametrize("rule, name, c, default", declared(), ids=_ids(declared()))
def test_a_flag_per_constant_reaches_the_rule(rule, name, c, default):
    flag = c.flag or "--" + c.config_field.replace("_", "-")
    flag_default = default if c.flag_default is SAME_AS_CONFIG else c.flag_default
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--optimizer", rule.name]
    args = megatron_args.parse_megatron_args(base, world_size=1)
    assert getattr(args, c.config_field) == flag_default
    built = update_rule_from_config(megatron_args.optimizer_config_from_args(args))
    assert getattr(built, name) == flag_default
    value = another_valid(c, flag_default)
    given = base + ([flag] if isinstance(default, bool) else [flag, str(value)])
    if isinstance(default, bool) and value == default:
        pytest.skip("a switch sets the other value only")
    built = update_rule_from_config(megatron_args.optimizer_config_from_args(
        megatron_args.parse_megatron_args(given, world_size=1)))
    assert getattr(built, name) == value


@pytest.mark.parametrize("rule, name, c, default", declared(), ids=_ids(declared()))
def test_the_checkpoint_records_each_constant(rule, name, c, default):
    """torch_dist's param-group fields (optimizer/state/torch_dist.py) come from the rule: each constant's
    value is there."""
    value = another_valid(c, default)
    fields = rule(**{name: value}).torch_group_fields()
    flat = [x for v in fields.values() for x in (v if isinstance(v, tuple) else (v,))]
    assert value in flat, (name, value, fields)


def _string_constants(path: Path) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_one_list_of_synonyms():
    """An optimizer's other names are declared by its rule (``aliases``) and read from there: no module
    spells one out, except core_config_fields.py, below the rules' layer, whose list must equal the names of the
    rules megatron-core runs through its emerging-optimizer path: the whole-tensor rules and Lion (megatron-core's
    lion takes the matrices: a rule whose param_split exists for it)."""
    aliases = {a for rule in RULES for a in rule.aliases}
    assert aliases == {"dist_muon"}
    spelled = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "muon.py" and p.name != "core_config_fields.py"
                     and aliases & set(_string_constants(p)))
    assert not spelled, f"modules naming an optimizer synonym: {spelled}"
    sharded = core_config_fields.OPTIMIZER_FIELDS["use_layer_wise_distributed_optimizer"]
    splits = {n for rule in RULES if rule.needs is Needs.WHOLE_TENSORS or "scope" in rule.constants()
              for n in rule.names()}
    assert set(sharded.optimizers) == splits


def test_qkv_split_attr_is_defined_once():
    defined = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name) and t.id == "QKV_SPLIT_ATTR"]
    assert defined == ["optimizer/rules/muon.py"], defined
