"""megatron_opt.megatron is a leaf adapter: no module of the core imports it (issue 19, item 5)."""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_opt

PACKAGE = Path(megatron_opt.__file__).resolve().parent
ADAPTER = PACKAGE / "megatron"


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of the megatron_opt modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("megatron_opt",) + path.relative_to(PACKAGE).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_nothing_outside_the_adapter_imports_it():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for path in sorted(PACKAGE.rglob("*.py")) if ADAPTER not in path.parents
                 for name in _imported_modules(path)
                 if name == "megatron_opt.megatron" or name.startswith("megatron_opt.megatron.")]
    assert not offenders, offenders


def test_relative_imports_are_resolved():
    names = _imported_modules(PACKAGE / "distributed" / "ddp_call.py")  # from ..config_conversion import ...
    assert "megatron_opt.config_conversion.as_ddp_config" in names and "megatron_opt.distributed.layout" in names
