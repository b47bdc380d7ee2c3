"""docs/design.md tells the truth about the modules (issue 38, item 1): its module table lists every module
under megatron_opt/, and every name in it exists. A name without a folder is in the folder of the name before
it in its row (``optimizer/rules/adamw.py``, ``sgd.py``). ``optimizer/rules/<rule>.py`` stands for every
module of that folder the registry finds a rule in (a new rule is its own file, its kernel and its test)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import megatron_opt
from megatron_opt.optimizer.rules.registry import RULES

PACKAGE = Path(megatron_opt.__file__).resolve().parent
DESIGN = PACKAGE.parent / "docs" / "design.md"


def table_names(text: str) -> list[str]:
    """The module paths (relative to megatron_opt/) in the first column of the "## Modules" table."""
    section = text[text.index("## Modules"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    names = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", cells[1]):
            if "/" in token:
                folder = token.rsplit("/", 1)[0] + "/"
                names.append(token)
            else:
                names.append(folder + token)
    return names


def must_be_listed(root: Path = PACKAGE) -> list[str]:
    """Every module under ``root``; a package's ``__init__.py`` only when it defines a function or class (the
    others only re-export or document their folder)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body):
                continue
        out.append(str(path.relative_to(root)))
    return out


RULE_FILES = "optimizer/rules/<rule>.py"


def rule_modules() -> list[str]:
    """The modules of optimizer/rules/ that hold a registered rule, as paths under megatron_opt/."""
    return sorted({"/".join(r.__module__.split(".")[1:]) + ".py" for r in RULES})


def problems(listed: list[str], root: Path = PACKAGE) -> list[str]:
    if RULE_FILES in listed:
        listed = [n for n in listed if n != RULE_FILES] + [m for m in rule_modules() if m not in listed]
    found = [f"missing from the module table: {m}" for m in must_be_listed(root) if m not in listed]
    found += [f"in the module table but not a module: {n}" for n in listed if not (root / n).is_file()]
    found += [f"listed twice: {n}" for n in sorted({n for n in listed if listed.count(n) > 1})]
    return found


def test_the_module_table_lists_every_module_and_nothing_else():
    listed = table_names(DESIGN.read_text())
    assert len(listed) > 50, listed  # the table was found
    assert not problems(listed), "\n".join(problems(listed))


def test_the_check_sees_a_missing_and_a_stale_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    for name in ("a.py", "b.py", "pkg/c.py", "pkg/d.py", "pkg/__init__.py"):
        (tmp_path / name).write_text("")
    text = ("## Modules\n\n| module | concept |\n|---|---|\n| `a.py` | x |\n| `pkg/c.py`, `d.py`, `e.py` | y |\n"
            "| `gone.py` | z |\n\n## Next\n| `b.py` | not in the section |\n")
    listed = table_names(text)
    assert listed == ["a.py", "pkg/c.py", "pkg/d.py", "pkg/e.py", "gone.py"]
    assert sorted(problems(listed, tmp_path)) == [
        "in the module table but not a module: gone.py", "in the module table but not a module: pkg/e.py",
        "missing from the module table: b.py"]
