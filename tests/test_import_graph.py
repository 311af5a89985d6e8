"""No import circles in the package: every module's imports, function-level ones included, form a DAG, and so do
the subpackages' (serve <-> bench would be a circle that no single module shows).

A function-level import still couples the two modules; it only hides the circle from the interpreter.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed names -> their folders.
PACKAGES = {"pagedchat": ROOT / "pagedchat"}


def modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's own modules that a module's source imports anywhere in it."""
    base = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                origin = f"{anchor}.{origin}" if origin else anchor
            # `from pkg import name` imports the submodule pkg.name where there is one, else pkg itself.
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != module}
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
            for name, path in found.items()}


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "pagedchat.model.loader" in graph["pagedchat.engine.engine"]
    assert "pagedchat.model.pull" in graph["pagedchat.cli"]  # imported inside a function


def test_no_import_circles():
    graph = import_graph()
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def package_of(module: str) -> str:
    """`pagedchat.serve.routes` -> `pagedchat.serve`; a top-level module (`pagedchat.cli`) is its own unit."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package_of(module)
        packages.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
    return packages


def test_the_package_graph_sees_cross_package_imports():
    packages = package_graph(import_graph())
    assert "pagedchat.engine" in packages["pagedchat.backends"]
    assert "pagedchat.kernels" in packages["pagedchat.model"]


def test_no_circles_between_packages():
    """Two packages that import each other (each module on its own may not) are one layer in two folders."""
    try:
        graphlib.TopologicalSorter(package_graph(import_graph())).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"package circle: {' -> '.join(exc.args[1])}") from None


# The engine's modules the app may name: plain records (sampling settings, finish reasons, page states). The
# rest reaches the app through a Backend, so the app never depends on how the engine computes.
ENGINE_RECORDS_FOR_THE_APP = {"pagedchat.engine.params", "pagedchat.engine.records"}


def test_the_app_imports_only_records_from_the_engine():
    graph = import_graph()
    reached = {(module, target) for module, targets in graph.items() if module.startswith("pagedchat.tui")
               for target in targets if package_of(target) == "pagedchat.engine"}
    assert {target for _, target in reached} <= ENGINE_RECORDS_FOR_THE_APP, sorted(
        (m, t) for m, t in reached if t not in ENGINE_RECORDS_FOR_THE_APP)
    assert ("pagedchat.tui.inspector_parts", "pagedchat.engine.records") in reached   # the check sees them


def test_each_module_name_means_one_thing():
    """A module's file name is unique across the packages, so that `pages.py` in a comment, a doc or a traceback
    names one file."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "pagedchat").rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
