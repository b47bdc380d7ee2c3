"""megatron_opt.megatron is a leaf adapter: no module of the core imports it (issue 19, item 5)."""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_opt

PACKAGE = Path(megatron_opt.__file__).resolve().parent
ADAPTER = PACKAGE / "megatron"


def _imports_of(path: Path, root: Path, root_name: str, with_members: bool = True) -> list[str]:
    """Absolute names of the modules ``path`` (inside package ``root_name`` at ``root``) imports, relative
    imports resolved; with ``with_members``, also ``module.member`` for each name a from-import takes."""
    package = ".".join((root_name,) + path.relative_to(root).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + ([f"{module}.{a.name}" for a in node.names] if with_members else [])
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of the megatron_opt modules ``path`` imports (relative imports resolved)."""
    return _imports_of(path, PACKAGE, "megatron_opt")


def test_nothing_outside_the_adapter_imports_it():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for path in sorted(PACKAGE.rglob("*.py")) if ADAPTER not in path.parents
                 for name in _imported_modules(path)
                 if name == "megatron_opt.megatron" or name.startswith("megatron_opt.megatron.")]
    assert not offenders, offenders


def test_relative_imports_are_resolved():
    names = _imported_modules(PACKAGE / "distributed" / "ddp_call.py")  # from ..config_conversion import ...
    assert "megatron_opt.config_conversion.as_ddp_config" in names and "megatron_opt.distributed.layout" in names


def _application_imports() -> dict[str, list[str]]:
    """{module path: the absolute names it imports} for every module of megatron_opt_train."""
    import megatron_opt_train

    app = Path(megatron_opt_train.__file__).resolve().parent
    return {str(path.relative_to(app)): _imports_of(path, app, "megatron_opt_train", with_members=False)
            for path in sorted(app.rglob("*.py"))}


def test_the_library_does_not_import_the_application():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sorted(PACKAGE.rglob("*.py"))
                 for name in _imported_modules(path) if name.split(".")[0] == "megatron_opt_train"]
    assert not offenders, offenders


def test_only_the_application_parts_that_need_megatron_core_import_it():
    """megatron-core stays optional for the main job: its data flags, its CPU patches and the
    model-parallel runner import it (inside functions), nothing else."""
    allowed = {"components/data.py", "components/megatron_core_on_cpu.py", "runners/megatron_core.py",
               "runners/megatron_core_model.py", "fixture.py"}
    offenders = [f"{path} imports {name}" for path, names in _application_imports().items() if path not in allowed
                 for name in names if name == "megatron" or name.startswith("megatron.")]
    assert not offenders, offenders


# docs/design.md "Layers", bottom first: a module imports only from its own component or a lower layer
# (issue 38, item 1). A component is a top-level module or folder of megatron_opt.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"errors", "_C"},  # _C: the compiled extension (csrc/)
    {"ops"},
    {"config", "core_config_fields"},
    {"host_reduction"},
    {"config_conversion", "collectives"},
    {"distributed"},
    {"optimizer"},
    {"scheduler", "training", "checkpoint"},
    {"megatron"},
))
PACKAGE_FRONT = {"__init__", "old_module_paths"}  # the package's own front, above every layer


def _component(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _rank(component: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if component in layer)


def upward_imports() -> list[str]:
    """Every import of a megatron_opt module from a component in the same or a higher layer (another
    component of it)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _component(path)
        if source in PACKAGE_FRONT:
            continue
        for name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] != "megatron_opt" or len(parts) < 2 or parts[1] == source:
                continue
            if _rank(parts[1]) >= _rank(source):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


def test_every_component_is_in_a_layer():
    components = {_component(p) for p in PACKAGE.rglob("*.py")} - PACKAGE_FRONT
    assert components <= set().union(*LAYERS), sorted(components - set().union(*LAYERS))


def test_config_imports_nothing_from_the_optimizer():
    """Importing OptimizerConfig loads no rule, no ops backend: what depends on the rule is checked where
    rules are built (optimizer/rules/registry.py)."""
    offenders = [n for n in _imported_modules(PACKAGE / "config.py")
                 if n == "megatron_opt.optimizer" or n.startswith("megatron_opt.optimizer.")]
    assert not offenders, offenders


def test_each_import_points_down_the_layers():
    assert not upward_imports(), "\n".join(upward_imports())
