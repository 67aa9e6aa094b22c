"""The README and docs/ stay true to the repository: the run-form reference is what the pydantic models say,
every repository path, module, make target and link they name exists, and the README stays two screens.
Fast: reads files and imports the run-form models; starts nothing."""

from __future__ import annotations

import functools
import glob
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200

# A repository path as the docs write it: a top-level folder of this repository, then a path.
REPO_PATH = re.compile(r"(?<![\w./<>~-])((?:flows|tasks|deployments|worker_image|localpod|bench|tests|docs)/[\w./*-]*)")
# A file at the root, named alone: `prefect.yaml`, `requirements.lock`.
ROOT_FILE = re.compile(r"`([\w-]+\.(?:lock|txt|toml|yaml))`")
# `python -m flows.train`, and module names written in backticks (`loraflow_worker.memory.plan`).
MODULE_ROOTS = {"flows": REPO / "flows", "tasks": REPO / "tasks", "deployments": REPO / "deployments",
                "localpod": REPO / "localpod", "bench": REPO / "bench",
                "loraflow_worker": REPO / "worker_image" / "loraflow_worker"}
RUN_MODULE = re.compile(r"-m\s+([A-Za-z_][\w.]*)")
MODULE_NAME = re.compile(rf"`((?:{'|'.join(MODULE_ROOTS)})(?:\.[A-Za-z_]\w*)+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
MAKE_TARGET = re.compile(r"\bmake ([a-z][\w-]*)")


@functools.cache
def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_run_form", DOCS / "run_form.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (backticks and punctuation dropped, spaces to dashes)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _names(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_the_run_form_page_is_what_the_models_generate():
    generator = _load_generator()
    page = DOCS / "run-form.md"
    assert page.exists(), f"docs/run-form.md is missing: generate it with `{generator.COMMAND}`"
    assert page.read_text() == generator.render(), (
        f"docs/run-form.md is stale (a run-form model changed): regenerate it with `{generator.COMMAND}`")


def test_the_run_form_page_lists_every_field_of_the_run_spec():
    from flows.forms.run import RunSpec

    model_in = _load_generator()._model_in
    text = (DOCS / "run-form.md").read_text()
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            sub, is_list = model_in(field.annotation)
            dotted = f"{prefix}{name}"
            if sub is None:
                if f"`{dotted}`" not in text:
                    missing.append(dotted)
            else:
                walk(sub, f"{dotted}[]." if is_list else f"{dotted}.")

    walk(RunSpec, "")
    assert not missing, f"fields missing from docs/run-form.md: {missing}"


def test_the_readme_is_two_screens():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move the rest to docs/"


@pytest.mark.parametrize("page", PAGES, ids=_names)
def test_every_repository_path_a_page_names_exists(page: Path):
    text = page.read_text()
    missing = []
    missing += [name for name in ROOT_FILE.findall(text) if not (REPO / name).exists()]
    for raw in REPO_PATH.findall(text):
        path = raw.rstrip(".,:;")
        if "*" in path:
            if not glob.glob(str(REPO / path)):
                missing.append(path)
        elif not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{_names(page)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_names)
def test_every_module_a_page_runs_or_names_exists(page: Path):
    text = page.read_text()
    missing = []
    for name in RUN_MODULE.findall(text):
        root, *rest = name.split(".")
        if root not in MODULE_ROOTS:
            continue  # pip, venv, pytest, ...
        base = MODULE_ROOTS[root].joinpath(*rest)
        if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
            missing.append(f"python -m {name}")
    for name in MODULE_NAME.findall(text):
        root, *rest = name.split(".")
        base = MODULE_ROOTS[root].joinpath(*rest)
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
            missing.append(name)
    assert not missing, f"{_names(page)} names modules that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_names)
def test_every_make_target_a_page_names_exists(page: Path):
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    named = {t for code in CODE.findall(page.read_text()) for t in MAKE_TARGET.findall(code)}
    assert named <= targets, f"{_names(page)} names make targets the Makefile lacks: {sorted(named - targets)}"


@pytest.mark.parametrize("page", PAGES, ids=_names)
def test_every_link_a_page_has_leads_somewhere(page: Path):
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{_names(page)} has links to nothing: {broken}"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    unlinked = [p.name for p in DOCS.glob("*.md") if f"](docs/{p.name}" not in text]
    assert not unlinked, f"README.md's 'Read on' does not link {unlinked}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=_names)
def test_every_docs_page_opens_by_saying_what_it_covers(page: Path):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), f"{_names(page)} does not open with a title"
    assert len(lines) > 2 and lines[1] == "" and lines[2][:1].isalpha(), (
        f"{_names(page)}: the title is not followed by a sentence saying what the page covers")
