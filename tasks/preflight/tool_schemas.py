"""Reads a GRPO run's tools file or environment class as TRL will, for `tasks.preflight.tools`: which functions are
the tools, and whether transformers can show each one to the model (`transformers.utils.get_json_schema`, the very
function that renders tools into the chat template).

Run as a script, in a process of its own: the file is the user's code, and importing it runs it.

    python tool_schemas.py tools PATH
    python tool_schemas.py environment PATH CLASS

It prints one JSON object: `tools` (names), `problem` (what to refuse, without the field's name; null when fine),
`unimported` (null, or why the file could not be imported here; its tools were then read from its source with
`ast`, without running it) and, for a file that imported, `schemas` (each tool's JSON schema as the chat template
receives it). Standard library, transformers and the worker's contract only.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from loraflow_worker.contract.reward_names import ENVIRONMENT_HOOKS

SCHEMA_FIX = ("give every parameter a type hint (str, int, float, bool, list[...], dict[str, ...], Literal[...], "
              "or a union of these) and the docstring an `Args:` line per parameter")

_MODULE_NAME = "loraflow_tools_file"


def read_live(kind: str, path: Path, class_name: str | None) -> dict[str, Any] | str:
    """Import the file and read its tools, with the problem text when they cannot be offered to the model; a string
    (why) when the file needs a module this machine does not have."""
    from transformers.utils import get_json_schema  # before the user's file, so its failures are the file's own

    module = _import(path)
    if isinstance(module, (dict, str)):
        return module
    if kind == "tools":
        functions = {name: value for name, value in vars(module).items()
                     if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")}
        if not functions:
            return _problem(f"{path} defines no public function: define at least one tool, a top-level `def` whose "
                            "name does not start with `_` (functions imported from elsewhere are not tools)")
    else:
        cls = vars(module).get(class_name)
        if cls is None:
            classes = [name for name, value in vars(module).items()
                       if inspect.isclass(value) and not name.startswith("_")]
            return _problem(f"{path} has no `{class_name}` (its classes: {_listed(classes)}): name a class of the file")
        if not inspect.isclass(cls):
            return _problem(f"`{class_name}` in {path} is a {type(cls).__name__}, not a class: name a class")
        # As TRL 1.16's GRPOTrainer: listed on the class (on an instance, getmembers would evaluate properties).
        members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
        if "reset" not in members:
            return _problem(_NO_RESET.format(cls=class_name))
        functions = {name: value for name, value in members.items()
                     if name not in ENVIRONMENT_HOOKS and not name.startswith("_")}
        if not functions:
            return _problem(_NO_TOOL_METHOD.format(cls=class_name))
    schemas = []
    for name, function in functions.items():
        try:
            schemas.append(get_json_schema(function))
        except Exception as e:  # noqa: BLE001 - the hint parser can also raise NameError etc. on the user's hints
            own = type(e).__name__ in ("TypeHintParsingException", "DocstringParsingException")
            text = " ".join(str(arg) for arg in e.args)  # some carry (message, hint)
            return _problem(schema_problem(name, text if own else f"{type(e).__name__}: {text}"), list(functions))
    return {"tools": list(functions), "problem": None, "unimported": None, "schemas": schemas}


def read_static(kind: str, path: Path, class_name: str | None, why: str) -> dict[str, Any]:
    """Read the tools from the file's source without running it, mirroring get_json_schema's rules on their hints
    and docstrings (whether each hint converts to a JSON schema is not checked)."""
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    tree = ast.parse(path.read_bytes(), filename=str(path))
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    if kind == "tools":
        functions = {node.name: node for node in tree.body if isinstance(node, defs) and not node.name.startswith("_")}
        if not functions:
            return _problem(f"{path} defines no public function: define at least one tool, a top-level `def` whose "
                            "name does not start with `_`", unimported=why)
    else:
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        if class_name not in classes:
            return _problem(f"{path} defines no class `{class_name}` (its classes: {_listed(list(classes))}): name a "
                            "class of the file", unimported=why)
        node = classes[class_name]
        methods = {item.name: item for item in node.body if isinstance(item, defs)}
        inherits = any(not (isinstance(base, ast.Name) and base.id == "object") for base in node.bases)
        if "reset" not in methods and not inherits:  # an inherited `reset` cannot be seen without importing
            return _problem(_NO_RESET.format(cls=class_name), unimported=why)
        functions = {name: item for name, item in methods.items() if name not in ENVIRONMENT_HOOKS and not name.startswith("_")}
        if not functions and not inherits:
            return _problem(_NO_TOOL_METHOD.format(cls=class_name), unimported=why)
    for name, node in functions.items():
        # In get_json_schema's order and words: the docstring, then the hints, then a description per hinted argument.
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            return _problem(schema_problem(name, f"Cannot generate JSON schema for {name} because it has no "
                                                 "docstring!"), list(functions), why)
        args = node.args
        params = [*args.posonlyargs, *args.args, *filter(None, [args.vararg]), *args.kwonlyargs,
                  *filter(None, [args.kwarg])]
        if params and params[0].arg in ("self", "cls") and params[0].annotation is None:
            params = params[1:]
        for param in params:
            if param.annotation is None:
                return _problem(schema_problem(name, f"Argument {param.arg} is missing a type hint in function "
                                                     f"{name}"), list(functions), why)
        _, described, _ = parse_google_format_docstring(doc.strip())
        for param in params:
            if param.arg not in described:
                return _problem(schema_problem(name, f"Cannot generate JSON schema for {name} because the docstring "
                                                     f"has no description for the argument '{param.arg}'"),
                                list(functions), why)
    return {"tools": list(functions), "problem": None, "unimported": why}


def schema_problem(tool: str, error: str) -> str:
    """The refusal of a tool that transformers cannot render as a JSON schema."""
    return f"tool `{tool}` cannot be shown to the model: {error.strip().removesuffix('.')}; {SCHEMA_FIX}"


_NO_RESET = ("class `{cls}` has no `reset` method: define `reset(self, **kwargs)`, which TRL calls with the prompt's "
             "dataset row before each completion")
_NO_TOOL_METHOD = ("class `{cls}` has no tool: define at least one public method besides `reset` and `get_reward` "
                   "(names starting with `_` are not tools)")


def _import(path: Path) -> Any:
    """The file as a module of its own; a result dict when it raises, a string (why) when an import in it fails."""
    # Not its folder on sys.path: the run ships the file alone, so on the worker its siblings are not there either.
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # as an import would: the file's dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        # Perhaps installed on the worker only (`worker.extra_packages`): read the source instead of refusing.
        if isinstance(e, ModuleNotFoundError) and e.name:
            return f"module `{e.name}` is not installed here"
        return f"{type(e).__name__}: {_short(str(e))}"
    except BaseException as e:  # noqa: BLE001 - whatever the user's file raises (SystemExit too) is its problem
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f" at line {frames[-1].lineno}: `{_short(frames[-1].line or '', 80)}`" if frames else ""
        return _problem(f"importing {path} raised {type(e).__name__}: {_short(str(e))}{where}; fix the file so "
                        "that it imports")
    return module


def _problem(text: str, tools: list[str] | None = None, unimported: str | None = None) -> dict[str, Any]:
    return {"tools": tools or [], "problem": text, "unimported": unimported}


def _listed(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names) or "none"


def _short(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def main(argv: list[str]) -> int:
    kind, path_text, class_name = argv[0], argv[1], (argv[2] if len(argv) > 2 else None)
    # The user's file may print: what it writes to stdout goes to stderr, and the JSON to the real stdout alone.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    path = Path(path_text)
    result = read_live(kind, path, class_name)
    if isinstance(result, str):
        result = read_static(kind, path, class_name, result)
    out.write(json.dumps(result))
    out.flush()
    return 0


if __name__ == "__main__":
    # Run by its path, Python puts this folder first on sys.path, where `tools.py` and its neighbours would shadow
    # the user's own modules of those names.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
