"""The csrc structure, read as text (no GPU or built extension needed):

* the moment-dtype pairs the precision-aware pass-2 kernels are compiled for are stated once in Python
  (``megatron_opt.ops.precision.KERNEL_MOMENT_PAIRS``, read by the config check and AdamW's op), and
  csrc/pass2.cuh instantiates exactly those;
* each rule's kernel file registers itself under its op's name (csrc/rules/), the ops registered are
  exactly those of the rules the registry finds that have a kernel (``kernel_op_set``, derived from the
  rules' declarations), and no shared file (the bindings, launch.h, pass2.cuh) names a rule: adding a rule
  touches its Python file, its kernel file and its test only."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_opt.ops.precision import KERNEL_MOMENT_PAIRS, STATE_DTYPES
from megatron_opt.optimizer.rules.registry import RULES

CSRC = Path(__file__).resolve().parents[2] / "csrc"
PASS2 = CSRC / "pass2.cuh"
REGISTRATION = r'MEGATRON_OPT_REGISTER_(?:RULE|PASS2)\(\s*"(\w+)"'
CODES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _function_body(text: str, signature: str) -> str:
    """The text between the braces of the first definition whose head matches ``signature``."""
    head = re.search(signature, text)
    assert head, f"{signature!r} not found in {PASS2}"
    start = text.index("{", head.end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    raise AssertionError(f"unbalanced braces after {signature!r}")


def _pairs(body: str, pattern: str) -> set:
    found = {(CODES[a], CODES[b]) for a, b in re.findall(pattern, body)}
    assert found, f"no pair matched {pattern!r}"
    return found


def test_supported_state_pair_matches_the_python_table():
    body = _function_body(PASS2.read_text(), r"bool\s+supported_state_pair\s*\(")
    assert _pairs(body, r"s0 == kCode(\w+) && s1 == kCode(\w+)") == set(KERNEL_MOMENT_PAIRS)


def test_the_precision_aware_launcher_instantiates_exactly_the_table():
    body = _function_body(PASS2.read_text(), r"void\s+run_pass2_master\s*\(")
    assert _pairs(body, r"launch_pass2<Rule, GT, PT, MP, kPO, (\w+), (\w+)>") == set(KERNEL_MOMENT_PAIRS)


def test_the_table_holds_distinct_pairs_of_state_dtypes():
    assert len(set(KERNEL_MOMENT_PAIRS)) == len(KERNEL_MOMENT_PAIRS)
    assert all(a in STATE_DTYPES and b in STATE_DTYPES for a, b in KERNEL_MOMENT_PAIRS)


def kernel_op_set() -> set[str]:
    """The ops with a compiled kernel, from the rules' declarations: the op record of every registered rule
    whose record has a kernel."""
    return {rule.op_record.op for rule in RULES if rule.op_record is not None and has_kernel(rule.op_record)}


def has_kernel(record: type) -> bool:
    """An op record declares the rule constants its kernel reads (``kernel_constants``; None: no kernel)."""
    return record.kernel_constants is not None


def _registered_in(path: Path) -> list:
    return re.findall(REGISTRATION, path.read_text())


def test_each_rule_kernel_file_registers_its_op():
    registered = {path.name: _registered_in(path) for path in sorted((CSRC / "rules").glob("*.cu"))}
    names = [n for found in registered.values() for n in found]
    assert sorted(names) == sorted(kernel_op_set()), registered
    assert len(set(names)) == len(names), "an op registered twice"
    assert {"adamw_step", "sgd_step", "lion_step"} <= kernel_op_set()  # the derivation finds the built-in kernels


def test_no_shared_file_names_a_rule():
    ops = sorted(kernel_op_set())
    shared = [p for p in sorted(CSRC.glob("*")) if p.is_file()]
    assert shared and not any(_registered_in(p) for p in shared)
    offenders = [f"{p.name} names {op}" for p in shared for op in ops if op in p.read_text()]
    assert not offenders, offenders
