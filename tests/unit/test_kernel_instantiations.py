"""The moment-dtype pairs the CUDA AdamW kernel is compiled for are stated once in Python
(``megatron_opt.ops.precision.KERNEL_MOMENT_PAIRS``, read by the config check and the CUDA wrapper);
this test reads csrc/pass2.cuh as text, so it runs without a GPU or a built extension."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_opt.ops.precision import KERNEL_MOMENT_PAIRS, STATE_DTYPES

PASS2 = Path(__file__).resolve().parents[2] / "csrc" / "pass2.cuh"
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
