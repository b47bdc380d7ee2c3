"""tests/unit is single-process pure logic, runnable without megatron-core: no module in it imports
megatron-core, at module level or inside a test (those tests live in tests/mcore)."""
from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent
IMPORTERS = {"importorskip", "import_module", "__import__"}  # pytest.importorskip, importlib.import_module


def _is_megatron_core(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")  # megatron_opt is not megatron-core


def _megatron_core_imports(path: Path) -> list[str]:
    """Where ``path`` imports megatron-core: import statements anywhere, and importorskip /
    import_module / __import__ calls with a literal module name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in IMPORTERS):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {name}" for name in names if _is_megatron_core(name)]
    return found


def test_no_unit_test_imports_megatron_core():
    modules = sorted(UNIT.glob("*.py"))
    assert len(modules) > 10  # the folder was found
    offenders = [where for path in modules for where in _megatron_core_imports(path)]
    assert not offenders, f"move these tests to tests/mcore: {offenders}"


def test_the_scan_sees_every_form_of_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import megatron.core\nfrom megatron.core import parallel_state\n"
                      "def f():\n    from megatron.core.optimizer import OptimizerConfig\n"
                      "    pytest.importorskip('megatron.core')\n    importlib.import_module('megatron.core.timers')\n"
                      "import megatron_opt\nfrom megatron_opt.megatron import arguments\n")
    assert [w.split(" ", 1)[1] for w in _megatron_core_imports(sample)] == [
        "megatron.core", "megatron.core", "megatron.core.optimizer", "megatron.core", "megatron.core.timers"]
