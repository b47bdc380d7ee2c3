"""optimizer/ in folders by concern (issue 38, item 2): at most 8 files at its top level, no two module names
alike, and every moved module still importable at its old path (the same module object), as docs/usage.md's
"Moved modules" table says."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import megatron_opt
from megatron_opt.old_module_paths import MOVED

PACKAGE = Path(megatron_opt.__file__).resolve().parent
REPO = PACKAGE.parent
MAX_TOP_LEVEL_FILES = 8


def test_optimizer_top_level_holds_at_most_8_files():
    files = sorted(p.name for p in (PACKAGE / "optimizer").iterdir() if p.is_file() and p.suffix == ".py")
    assert len(files) <= MAX_TOP_LEVEL_FILES, files


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is new  # `from parent import leaf` works too


def test_old_paths_are_not_files_any_more_and_new_ones_are():
    for old, new in MOVED.items():
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), old
        assert (REPO / (new.replace(".", "/") + ".py")).exists(), new


def test_the_old_verify_module_names_still_import():
    from megatron_opt.optimizer.verify import Finding, StepVerifier, VerifyReport, recompute_of
    from megatron_opt.optimizer.verify import step_verifier
    assert (Finding, StepVerifier, VerifyReport, recompute_of) == (
        step_verifier.Finding, step_verifier.StepVerifier, step_verifier.VerifyReport, step_verifier.recompute_of)
    with pytest.raises(ImportError):
        from megatron_opt.optimizer.verify import no_such_name  # noqa: F401


def test_usage_md_lists_exactly_the_moved_modules():
    text = (REPO / "docs" / "usage.md").read_text()
    section = text[text.index("## Moved modules"):]
    rows = dict(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", section, flags=re.M))
    assert rows == MOVED
