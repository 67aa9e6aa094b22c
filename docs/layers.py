"""The control plane's packages (`tasks/`) in layers, read from their imports: the table of docs/layout.md.

    .venv/bin/python docs/layers.py           # rewrite the table in docs/layout.md
    .venv/bin/python docs/layers.py --check   # exit 1 when the table is not what the imports say

Each package may import only the packages of the layers before it; `tests/test_layout.py` fails on one that imports a
package at or above its own layer.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tasks"
PAGE = REPO / "docs" / "layout.md"
COMMAND = ".venv/bin/python docs/layers.py"
LAYERS = ("runpod", "settings", "reports", "placement", "lifecycle", "storage", "jobs", "preflight")
"""The order, bottom first: RunPod's wire; where keys and settings come from; what a run shows and sends; where a run
may go and what it costs; the building blocks of an endpoint's life; what is kept; the jobs that rent an endpoint;
the checks before renting."""
APART = ("deploy_steps",)
"""Modules of `tasks/` in no layer: prefect.yaml's own steps, which import nothing of the control plane."""
BEGIN, END = "<!-- layers: begin (docs/layers.py) -->", "<!-- layers: end -->"


def package_of(path: Path) -> str:
    """`tasks/<package>/x.py` → `<package>`; `tasks/settings.py` → `settings`."""
    parts = path.relative_to(TASKS).with_suffix("").parts
    return parts[0]


def imports() -> dict[str, dict[str, list[str]]]:
    """package → imported package → the `file: module` lines that import it (other packages of `tasks/` only)."""
    found: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(TASKS.rglob("*.py")):
        if path == TASKS / "__init__.py":
            continue
        package = package_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "tasks" and len(parts) > 1 and parts[1] != package:
                    found[package][parts[1]].append(f"{path.relative_to(REPO)}: {name}")
    return found


def upward_imports() -> list[str]:
    """Every import of a package at or above the importer's own layer, as `importer → imported (file: module)`."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    problems = []
    for package, imported in imports().items():
        for other, where in imported.items():
            if package in APART or other in APART or rank.get(other, len(LAYERS)) >= rank.get(package, -1):
                problems += [f"{package} → {other} ({line})" for line in where]
    return problems


def packages() -> list[str]:
    """The packages and modules of `tasks/` (a package's folder, or a module of its own)."""
    return sorted({package_of(p) for p in TASKS.rglob("*.py") if p != TASKS / "__init__.py"})


def table() -> str:
    found = imports()
    lines = ["| layer | package | modules | imports |", "|---|---|---|---|"]
    for i, name in enumerate(LAYERS, start=1):
        folder = TASKS / name
        modules = (len([p for p in folder.glob("*.py") if p.name != "__init__.py"]) if folder.is_dir() else 1)
        where = f"`tasks/{name}/`" if folder.is_dir() else f"`tasks/{name}.py`"
        below = ", ".join(f"`{other}`" for other in LAYERS if other in found.get(name, {})) or "nothing of `tasks/`"
        lines.append(f"| {i} | {where} | {modules} | {below} |")
    return "\n".join(lines)


def page_with_table(page: str) -> str:
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return f"{page[:start]}\n{table()}\n{page[end:]}"


def main() -> int:
    page = PAGE.read_text()
    current = page_with_table(page)
    if "--check" in sys.argv[1:]:
        if current != page:
            print(f"docs/layout.md's layer table is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(current)
    print("wrote docs/layout.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
