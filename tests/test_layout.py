"""The house's structure, read from the files (nothing runs): the control plane's packages form layers, each importing
only the layers before it, so no two packages import each other; no module of the repository imports itself round
through others; docs/layout.md shows the layers the imports make."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("docs_layers", REPO / "docs" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)

ROOTS = {"flows": REPO / "flows", "tasks": REPO / "tasks", "localpod": REPO / "localpod", "bench": REPO / "bench",
         "deployments": REPO / "deployments", "tests": REPO / "tests",
         "loraflow_worker": REPO / "worker_image" / "loraflow_worker"}


def test_every_package_of_the_control_plane_has_its_layer():
    assert set(layers.packages()) == set(layers.LAYERS) | set(layers.APART)


def test_no_package_imports_one_at_or_above_its_own_layer():
    assert layers.upward_imports() == []


def test_no_two_packages_import_each_other():
    found = layers.imports()
    assert [(a, b) for a in found for b in found[a] if a < b and a in found.get(b, {})] == []


def test_the_layout_page_shows_the_layers_the_imports_make():
    page = (REPO / "docs" / "layout.md").read_text()
    assert layers.page_with_table(page) == page, f"docs/layout.md's layer table is stale: run `{layers.COMMAND}`"


def test_no_module_of_the_repository_imports_itself_round():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == []


def _modules() -> dict[str, Path]:
    modules = {}
    for top, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports (a name imported from a module counts as that module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    resolved = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        # A package's own __init__ is not a circle: importing `a.b` runs `a` first.
        if target and target != name and not name.startswith(target + "."):
            resolved.add(target)
    return resolved


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                circles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return circles
