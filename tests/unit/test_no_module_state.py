"""No module-level mutable state in the package (issue 19): no function rebinds a module global, and
no module starts an empty container or a weak registry at import time to fill in later. Constant
tables (dtype codes, flag tables) are built full at import and only read."""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_opt

PACKAGE = Path(megatron_opt.__file__).resolve().parent
REGISTRY_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary",
                  "WeakSet", "deque", "Counter"}


def _offences(source: str) -> list[str]:
    tree = ast.parse(source)
    found = [f"line {node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty_literal = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None))
        call = value.func if isinstance(value, ast.Call) else None
        name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", None)
        if empty_literal or (name in REGISTRY_CALLS and not value.args and not value.keywords):
            found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_the_check_finds_module_state():
    assert _offences("_CACHE = {}\n")
    assert _offences("import weakref\n_R = weakref.WeakKeyDictionary()\n")
    assert _offences("X = None\ndef f():\n    global X\n    X = 1\n")
    assert not _offences("CODES = {'a': 1}\nNAMES = ('a', 'b')\n")


def test_no_module_level_mutable_state():
    offences = [f"{path.relative_to(PACKAGE)} {o}" for path in sorted(PACKAGE.rglob("*.py"))
                for o in _offences(path.read_text())]
    assert not offences, "module-level mutable state:\n" + "\n".join(offences)


def test_no_module_level_mutable_state_in_the_application():
    import megatron_opt_train

    app = Path(megatron_opt_train.__file__).resolve().parent
    offences = [f"{path.relative_to(app)} {o}" for path in sorted(app.rglob("*.py"))
                for o in _offences(path.read_text())]
    assert not offences, "module-level mutable state:\n" + "\n".join(offences)
