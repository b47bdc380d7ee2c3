"""Every field megatron_opt's configs declare is read by the library, refused by config.py at a non-default
value (the class's ``_UNSUPPORTED``), or decided in core_config_fields.py's ``UNREAD_*_FIELDS`` (Inert or
DefaultOnly, with its reason): nothing is accepted and silently ignored (issue 38, item 5).

A read is found in the package's source (AST, not text): ``<receiver>.field`` or
``getattr(<receiver>, "field", ...)``, outside config.py's own validation (``__post_init__``,
``_check*``, ``_reject*``) and not off ``args`` (the argparse namespace the Megatron flag mapping reads
Megatron's same-named flags from). A name both configs declare (``overlap_param_gather``) counts for one
of them only when the receiver says which (``ddp_config`` / ``config``)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Optional

import pytest

import megatron_opt
from megatron_opt import core_config_fields
from megatron_opt.config import DistributedDataParallelConfig, OptimizerConfig, UnsupportedConfigError

PACKAGE = Path(megatron_opt.__file__).resolve().parent
CONFIGS = {DistributedDataParallelConfig: core_config_fields.UNREAD_DDP_FIELDS,
           OptimizerConfig: core_config_fields.UNREAD_OPTIMIZER_FIELDS}
# The receiver names that say which config a shared field name is read from.
RECEIVERS = {"ddp_config": DistributedDataParallelConfig, "ddp_cfg": DistributedDataParallelConfig,
             "config": OptimizerConfig, "optimizer_config": OptimizerConfig, "opt_config": OptimizerConfig}
NOT_A_CONFIG = {"args"}  # argparse.Namespace: Megatron's flags share the fields' names
VALIDATION = ("__post_init__", "_check", "_reject")


def _receiver(node: ast.expr) -> Optional[str]:
    """The last name of a receiver expression: ``self.ddp_config`` -> 'ddp_config', ``config`` -> 'config'."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def field_reads(source: str, is_config_module: bool = False) -> list[tuple[Optional[str], str]]:
    """(receiver, name) for each attribute read in ``source``; in config.py (``is_config_module``) the
    validation methods are skipped and ``self`` names its enclosing class (its properties read its fields)."""
    reads: list[tuple[Optional[str], str]] = []

    def visit(node: ast.AST, owner: Optional[str]) -> None:
        if isinstance(node, ast.ClassDef):
            owner = node.name
        if is_config_module and isinstance(node, ast.FunctionDef) and node.name.startswith(VALIDATION):
            return
        target: Optional[ast.expr] = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            target, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            target, name = node.args[0], node.args[1].value
        if target is not None:
            receiver = _receiver(target)
            reads.append((owner if is_config_module and receiver == "self" and owner else receiver, name))
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(ast.parse(source), None)
    return reads


def read_fields(config: type, reads: list[tuple[Optional[str], str]]) -> set[str]:
    """The fields of ``config`` that ``reads`` read (a name both configs declare needs a telling receiver)."""
    names = {f.name for f in dataclasses.fields(config)}
    others = set().union(*({f.name for f in dataclasses.fields(c)} for c in CONFIGS if c is not config))
    found = set()
    for receiver, name in reads:
        if name not in names or receiver in NOT_A_CONFIG:
            continue
        if receiver == config.__name__ or RECEIVERS.get(receiver or "") is config:
            found.add(name)
        elif name not in others and receiver not in RECEIVERS and receiver not in {c.__name__ for c in CONFIGS}:
            found.add(name)
    return found


def _package_reads() -> list[tuple[Optional[str], str]]:
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        reads += field_reads(path.read_text(), is_config_module=path == PACKAGE / "config.py")
    return reads


@pytest.fixture(scope="module")
def package_reads() -> list[tuple[Optional[str], str]]:
    return _package_reads()


def rule_constant_fields() -> set[str]:
    """The OptimizerConfig fields the update rules declare as their constants' sources: read by
    ``UpdateRule.constants_from(config)`` through the declaration, not by name in the source."""
    from megatron_opt.optimizer.rules.registry import RULES
    return {c.config_field for rule in RULES for c in rule.constants().values() if c.config_field is not None}


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.__name__)
def test_every_declared_field_is_read_refused_or_decided(config, package_reads):
    read = read_fields(config, package_reads) | (rule_constant_fields() if config is OptimizerConfig else set())
    assert len(read) > 5  # the package was scanned
    undecided = sorted(f.name for f in dataclasses.fields(config)
                       if f.name not in read and f.name not in config._UNSUPPORTED and f.name not in CONFIGS[config])
    assert not undecided, (
        f"{config.__name__} declares {undecided} but megatron_opt never reads them: use them, refuse a non-default "
        f"value (_UNSUPPORTED in config.py), or decide them (Inert / DefaultOnly) in "
        f"megatron_opt/core_config_fields.py's UNREAD_*_FIELDS.")


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.__name__)
def test_the_unread_table_holds_only_declared_unread_fields(config, package_reads):
    declared = {f.name for f in dataclasses.fields(config)}
    table = CONFIGS[config]
    assert set(table) <= declared, f"not {config.__name__} fields: {sorted(set(table) - declared)}"
    now_read = sorted(set(table) & read_fields(config, package_reads))
    assert not now_read, f"megatron_opt reads {now_read} now: remove them from core_config_fields.py"
    assert all(isinstance(t, (core_config_fields.Inert, core_config_fields.DefaultOnly)) for t in table.values())


@pytest.mark.parametrize("config, name", [(c, n) for c, table in CONFIGS.items() for n, t in table.items()
                                          if isinstance(t, core_config_fields.DefaultOnly)])
def test_a_default_only_unread_field_is_refused(config, name):
    default = {f.name: f.default for f in dataclasses.fields(config)}[name]
    assert config._UNSUPPORTED.get(name, object()) == default
    assert isinstance(default, bool)
    kwargs = {"lr": 1e-3} if config is OptimizerConfig else {}
    with pytest.raises(UnsupportedConfigError, match=name):
        config(**kwargs, **{name: not default})


def test_the_five_fields_of_issue_38_are_decided():
    assert {"align_param_gather", "delay_wgrad_compute"} <= set(core_config_fields.UNREAD_DDP_FIELDS)
    assert {"params_dtype", "config_logger_dir", "overlap_param_gather"} <= set(
        core_config_fields.UNREAD_OPTIMIZER_FIELDS)


def test_the_scan_tells_reads_apart():
    reads = field_reads(
        "def f(config, ddp_config, args, chunk):\n"
        "    a = config.clip_grad + ddp_config.overlap_param_gather + args.weight_decay\n"
        "    b = getattr(config, 'adam_eps', 1e-8), chunk.param_gather.use_distributed_optimizer\n"
        "    config.params_dtype = None\n")  # a write is not a read
    assert read_fields(OptimizerConfig, reads) == {"clip_grad", "adam_eps"}
    assert read_fields(DistributedDataParallelConfig, reads) == {"overlap_param_gather"}
    own = field_reads(
        "class OptimizerConfig:\n"
        "    def __post_init__(self):\n        self.hysteresis\n"
        "    def _check_ranges(self):\n        self.adam_beta1\n"
        "    @property\n    def model_dtype(self):\n        return self.fp16\n", is_config_module=True)
    assert read_fields(OptimizerConfig, own) == {"fp16"}
