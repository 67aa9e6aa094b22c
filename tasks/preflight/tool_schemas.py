"""A GRPO run's tools, read from the tools file's (or environment's) source without running any of it: which
functions are the tools, as TRL lists them, and each one's JSON schema as transformers' `get_json_schema` makes it
for the chat template.

The file is the user's code, and the control plane holds the keys (RunPod's, the Hub's, Prefect's): nothing of it
is imported, executed or evaluated here. Its source is parsed (`ast`) and compiled, never run; each tool's type hints
are rebuilt from an allow-list of names (the builtins, `typing`, `collections.abc` and a few more standard modules,
the file's own classes and its aliases of these) and handed, on a stand-in function with the tool's name, signature
and docstring, to transformers' own `get_json_schema`, so the schemas are transformers' by construction.

What only running the file could tell (a decorator, a hint naming another package's type, a class whose base lives
elsewhere, a tool defined under an `if`) is left to the worker, which imports the file and checks every tool as the
job starts: the reading says which and where (`ToolsRead.unread`), and gives no schemas then.
"""

from __future__ import annotations

import abc
import ast
import builtins
import importlib
import inspect
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow_worker.contract.reward_names import ENVIRONMENT_HOOKS

SCHEMA_FIX = ("give every parameter a type hint (str, int, float, bool, list[...], dict[str, ...], Literal[...], "
              "or a union of these) and the docstring an `Args:` line per parameter")

KNOWN_MODULES = frozenset({
    "typing", "typing_extensions", "collections", "collections.abc", "builtins", "types", "abc", "dataclasses",
    "functools", "enum", "datetime", "decimal", "fractions", "numbers", "pathlib", "uuid"})
"""Modules whose names a tool's hints may use, read by importing them here: the standard library's and
typing_extensions, never the user's, and none that does anything when imported."""


@dataclass(frozen=True)
class ToolsRead:
    """The tools of one file: their names in TRL's order, their schemas (None while anything is `unread`), what only
    running the file could tell (each naming its line), and warnings about the file."""

    names: list[str] = field(default_factory=list)
    schemas: list[dict[str, Any]] | None = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_tools_file(path: Path) -> ToolsRead:
    """The tools of a `grpo.tools` file, as TRL takes them from the imported module: its public top-level functions
    (`def` or `async def`; what it imports is not a tool), in the order the file first binds their names. ValueError
    (the problem, without the field) for what the worker would refuse."""
    source = _Source(path)
    tools: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    unread = []
    for name, node in source.bindings.items():
        value = _value_of(node, name)
        if name.startswith("_"):
            continue
        if isinstance(node, _DEFS) and node.decorator_list:
            unread.append(f"line {node.decorator_list[0].lineno}: `{name}` has a decorator, which only running the "
                          "file applies")
        elif isinstance(node, _DEFS):
            tools[name] = node
        elif isinstance(value, ast.Lambda):  # a function of the file, so a tool, and one without a docstring
            raise ValueError(schema_problem(name, f"line {node.lineno} makes it a lambda, which has no docstring; "
                                                  "define it with `def`"))
        elif isinstance(value, ast.Name) and isinstance(source.bindings.get(value.id), _DEFS):
            unread.append(f"line {node.lineno}: `{name}` is another name for a function")
        # Any other assignment binds a value (a setting, a client), not a tool.
    unread += [f"line {line}: `{name}` is defined under a compound statement (`if`, `try`, ...), which only "
               "running the file decides" for name, (line, is_def) in source.nested.items()
               if is_def and not name.startswith("_") and name not in tools]
    if not tools and not unread:
        raise ValueError(f"{path} defines no public function: define at least one tool, a top-level `def` whose "
                         "name does not start with `_` (functions imported from elsewhere are not tools)")
    return source.schemas(tools, {}, unread)


def read_environment(path: Path, class_name: str) -> ToolsRead:
    """The tools of a `grpo.environment` class, as TRL 1.16 lists them (`inspect.getmembers` of the class, by name):
    its public functions, inherited ones included, but `reset` and `get_reward`. ValueError (the problem, without
    the field) for what the worker would refuse."""
    source = _Source(path)
    node = source.bindings.get(class_name)
    classes = [name for name, bound in source.bindings.items() if isinstance(bound, ast.ClassDef)
               and not name.startswith("_")]
    if node is None:
        if class_name in source.nested or source.star_import:
            return ToolsRead(names=[], schemas=None, unread=[f"`{class_name}` is not bound by a top-level statement "
                                                             "of the file (a compound statement or a `*` import)"])
        raise ValueError(f"{path} has no `{class_name}` (its classes: {_listed(classes)}): name a class of the file")
    if isinstance(node, _DEFS):
        raise ValueError(f"`{class_name}` in {path} is a function, not a class: name a class")
    if not isinstance(node, ast.ClassDef):
        return ToolsRead(names=[], schemas=None, unread=[
            f"line {node.lineno}: `{class_name}` is bound by `{_short(ast.unparse(node), 60)}`, not by a `class` "
            "statement of the file"])
    try:
        members = source.members(class_name)
    except _Unread as e:
        return ToolsRead(names=[], schemas=None, unread=[str(e)])
    unread = [f"line {member.line}: `{name}` {member.why}" for name, member in sorted(members.items())
              if member.kind == "unknown" and (name == "reset" or _is_tool(name))]
    reset = members.get("reset")
    if reset is None or reset.kind == "value":
        raise ValueError(_NO_RESET.format(cls=class_name))
    tools = {name: member for name, member in sorted(members.items()) if member.kind == "function" and _is_tool(name)}
    if not tools and not any(member.kind == "unknown" and _is_tool(name) for name, member in members.items()):
        raise ValueError(_NO_TOOL_METHOD.format(cls=class_name))
    return source.schemas({name: member.node for name, member in tools.items()},
                          {name: member.owner for name, member in tools.items()}, unread)


def schema_problem(tool: str, error: str) -> str:
    """The refusal of a tool that transformers cannot render as a JSON schema."""
    return f"tool `{tool}` cannot be shown to the model: {error.strip().removesuffix('.')}; {SCHEMA_FIX}"


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_NO_RESET = ("class `{cls}` has no `reset` method: define `reset(self, **kwargs)`, which TRL calls with the prompt's "
             "dataset row before each completion")
_NO_TOOL_METHOD = ("class `{cls}` has no tool: define at least one public method besides `reset` and `get_reward` "
                   "(names starting with `_` are not tools)")
_NO_DEFAULT = object()
"""A parameter's default on a stand-in: only whether there is one matters to the schema (`required`)."""


class _Unread(Exception):
    """What only running the file could tell; its text names the line."""


class _HintError(Exception):
    """A hint that fails wherever the file runs (an undefined name, a bad subscript): the tool is refused."""


@dataclass
class _Member:
    """What a class binds to a name: a function (a tool, if public), a callable that is not one (a classmethod), a
    value, or what only running the class body tells (`why`)."""

    kind: str
    line: int
    node: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    owner: str = ""
    why: str = ""


class _Source:
    """One file's syntax tree and what its top level binds, read without running it."""

    def __init__(self, path: Path):
        self.path = path
        data = path.read_bytes()
        try:
            self.tree = ast.parse(data, filename=str(path))
            compile(self.tree, str(path), "exec", dont_inherit=True)  # the compiler's checks too; it runs nothing
        except SyntaxError as e:
            raise ValueError(f"{path} is not valid Python (line {e.lineno}: {e.msg}): fix the file") from None
        except (ValueError, RecursionError) as e:  # a null byte; nesting deeper than the parser goes
            raise ValueError(f"{path} is not valid Python ({type(e).__name__}: {e}): fix the file") from None
        self.bindings, self.nested, self.star_import = _bindings(self.tree.body)
        self._classes: dict[str, type] = {}
        self.warnings = _sibling_imports(self.tree, path)

    def schemas(self, tools: dict[str, ast.FunctionDef | ast.AsyncFunctionDef], owners: dict[str, str],
                unread: list[str]) -> ToolsRead:
        """Each tool's schema from transformers' `get_json_schema`, given a stand-in of it. ValueError for a tool
        it refuses: a refusal is certain even where a hint could not be read (a stand-in class never raises)."""
        from transformers.utils import get_json_schema

        schemas = []
        for name, node in tools.items():
            hints = _Hints(self, self._class_scope(owners.get(name)))
            stand_in = hints.stand_in(node, self._docstring(node, owners.get(name)))
            try:
                schema = get_json_schema(stand_in)
            except Exception as e:  # noqa: BLE001 - transformers' parsers raise their own and others (json's, typing's)
                own = type(e).__name__ in ("TypeHintParsingException", "DocstringParsingException")
                text = " ".join(str(arg) for arg in e.args)  # some carry (message, hint)
                raise ValueError(schema_problem(name, text if own else f"{type(e).__name__}: {text}")) from None
            if hints.error is not None:
                raise ValueError(schema_problem(name, hints.error))
            if hints.unknown:
                unread.append(f"line {node.lineno}: the hints of `{name}` name "
                              f"{', '.join(f'`{text}`' for text in hints.unknown)}, known only by running the file")
            schemas.append(schema)
        return ToolsRead(names=list(tools), schemas=None if unread else schemas, unread=unread,
                         warnings=self.warnings)

    def known_class(self, name: str) -> type:
        """A stand-in for a class of the file: transformers makes `{"type": "object"}` of any plain class."""
        if name not in self._classes:
            self._classes[name] = type(name, (), {"__module__": "loraflow_tools_file"})
        return self._classes[name]

    def mro(self, name: str, seen: tuple[str, ...] = ()) -> list[str]:
        """The class's method resolution order (C3) over the file's classes; _Unread where a base, a decorator or a
        metaclass is not the file's own."""
        node = self.bindings[name]
        if not isinstance(node, ast.ClassDef) or name in seen:
            raise _Unread(f"line {node.lineno}: `{name}` is not a class statement of the file")
        for decorator in node.decorator_list:
            if _decorated_by(self, decorator) is not _dataclass():
                raise _Unread(f"line {decorator.lineno}: class `{name}` has a decorator, which only running the "
                              "file applies")
        if node.keywords:
            raise _Unread(f"line {node.lineno}: class `{name}` names a metaclass or class keywords")
        bases = []
        for base in node.bases:
            resolved = _decorated_by(self, base)
            if resolved in (object, abc.ABC):
                continue
            if not (isinstance(base, ast.Name) and isinstance(self.bindings.get(base.id), ast.ClassDef)):
                raise _Unread(f"line {node.lineno}: class `{name}` inherits from `{ast.unparse(base)}`, which is not "
                              "a class of the file")
            bases.append(base.id)
        return [name, *_c3([self.mro(base, (*seen, name)) for base in bases] + [bases], name)]

    def members(self, class_name: str) -> dict[str, _Member]:
        """What the class binds, its bases' first (inherited), by name."""
        found: dict[str, _Member] = {}
        for owner in reversed(self.mro(class_name)):
            found |= _class_members(self, owner)
        return found

    def _class_scope(self, owner: str | None) -> frozenset[str]:
        """Names the class body binds: a method's hints evaluated there could mean them (so they are not read)."""
        if owner is None:
            return frozenset()
        return frozenset(_class_members(self, owner))

    def _docstring(self, node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None) -> str | None:
        """The docstring `inspect.getdoc` finds: the function's own, else (a method) the first of the same name up
        its class's method resolution order."""
        doc = ast.get_docstring(node, clean=False)
        if doc is not None or owner is None:
            return doc
        for base in self.mro(owner):
            member = self.members(base).get(node.name)
            if member is not None and member.node is not None and (doc := ast.get_docstring(member.node, clean=False)):
                return doc
        return None


class _Hints:
    """A tool's type hints rebuilt as the objects they name, from the file's source and an allow-list; a name the
    allow-list lacks becomes a plain class (transformers' `{"type": "object"}`) and is listed in `unknown`."""

    def __init__(self, source: _Source, class_scope: frozenset[str]):
        self.source = source
        self.class_scope = class_scope
        self.unknown: list[str] = []
        self.error: str | None = None
        self._aliases: set[str] = set()
        self._guesses = 0
        """How many stand-ins (for a class of the file or a name not read) the hints used so far."""

    def stand_in(self, node: ast.FunctionDef | ast.AsyncFunctionDef, doc: str | None) -> Callable[..., Any]:
        """A function transformers reads as it would the tool: its name, signature, hints (`__annotations__` in
        CPython's order: parameters, positional-only ones after the others, then `return`) and docstring."""
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        has_default = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
        kinds = [inspect.Parameter.POSITIONAL_ONLY] * len(args.posonlyargs) + \
            [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(args.args)
        listed = list(zip(positional, kinds, has_default))
        if args.vararg is not None:
            listed.append((args.vararg, inspect.Parameter.VAR_POSITIONAL, False))
        listed += [(arg, inspect.Parameter.KEYWORD_ONLY, default is not None)
                   for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
        if args.kwarg is not None:
            listed.append((args.kwarg, inspect.Parameter.VAR_KEYWORD, False))
        hints = {arg.arg: self.hint(arg.annotation) for arg, _, _ in listed if arg.annotation is not None}
        parameters = [inspect.Parameter(arg.arg, kind, default=_NO_DEFAULT if default else inspect.Parameter.empty,
                                        annotation=hints.get(arg.arg, inspect.Parameter.empty))
                      for arg, kind, default in listed]
        order = [*args.args, *args.posonlyargs, *filter(None, [args.vararg]), *args.kwonlyargs,
                 *filter(None, [args.kwarg])]
        annotations = {arg.arg: hints[arg.arg] for arg in order if arg.arg in hints}
        if node.returns is not None:
            annotations["return"] = self.hint(node.returns)
        stand_in = types.FunctionType(_never_called.__code__, {}, node.name)
        stand_in.__qualname__ = node.name
        stand_in.__module__ = "loraflow_tools_file"  # in no sys.modules: getdoc looks no further than __doc__
        stand_in.__doc__ = doc
        stand_in.__annotations__ = annotations
        stand_in.__signature__ = inspect.Signature(parameters)
        return stand_in

    def hint(self, node: ast.expr) -> Any:
        """The object the hint names (None for `None`: `get_type_hints` makes it NoneType)."""
        try:
            return self._resolve(node)
        except RecursionError:
            self.error = self.error or f"its hint (line {node.lineno}) nests deeper than Python evaluates"
            return type("unreadable", (), {})
        except _HintError as e:
            self.error = self.error or f"its hint `{_short(ast.unparse(node), 60)}` (line {node.lineno}): {e}"
            return type("unreadable", (), {})

    def _resolve(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):  # a forward reference: get_type_hints evaluates it in the module
                try:
                    parsed = ast.parse(node.value.strip(), mode="eval").body
                except SyntaxError as e:
                    raise _HintError(f"the string is not an expression ({e.msg})") from None
                return self._resolve(ast.copy_location(parsed, node))
            return node.value  # None, Ellipsis (tuple[int, ...]) and the like, as written
        if isinstance(node, ast.Name):
            return self._name(node)
        if isinstance(node, ast.Attribute):
            value = self._resolve(node.value)
            if not isinstance(value, types.ModuleType) or value.__name__ not in KNOWN_MODULES \
                    or not hasattr(value, node.attr):
                return self._unknown(node)
            return getattr(value, node.attr)
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            before = self._guesses
            return self._made(node, before, operator.or_, self._resolve(node.left), self._resolve(node.right))
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._resolve(item) for item in node.elts]
        return self._unknown(node)

    def _name(self, node: ast.Name) -> Any:
        name = node.id
        source = self.source
        if name in self.class_scope:
            return self._unknown(node)
        bound = source.bindings.get(name)
        if bound is None:
            if name in source.nested or source.star_import:
                return self._unknown(node)
            if hasattr(builtins, name):
                return getattr(builtins, name)
            raise _HintError(f"`{name}` is not defined in the file: import it or define it")
        if isinstance(bound, ast.ClassDef):
            self._guesses += 1
            return source.known_class(name)
        if isinstance(bound, (ast.Import, ast.ImportFrom)):
            return self._imported(bound, name, node)
        value = _value_of(bound, name)
        if value is not None and name not in self._aliases:  # an alias: `Unit = Literal["c", "f"]`
            self._aliases.add(name)
            try:
                return self._resolve(value)
            finally:
                self._aliases.discard(name)
        return self._unknown(node)

    def _imported(self, statement: ast.Import | ast.ImportFrom, name: str, node: ast.expr) -> Any:
        for alias in statement.names:
            if isinstance(statement, ast.ImportFrom):
                if (alias.asname or alias.name) == name and statement.level == 0 and statement.module in KNOWN_MODULES:
                    module = importlib.import_module(statement.module)
                    if hasattr(module, alias.name):
                        return getattr(module, alias.name)
            elif alias.asname == name and alias.name in KNOWN_MODULES:
                return importlib.import_module(alias.name)
            elif alias.asname is None and alias.name.split(".")[0] == name and alias.name in KNOWN_MODULES:
                importlib.import_module(alias.name)
                return importlib.import_module(name)
        return self._unknown(node)

    def _subscript(self, node: ast.Subscript) -> Any:
        before, noted = self._guesses, len(self.unknown)
        base = self._resolve(node.value)
        if self._guesses > before:  # a class of the file, or a name not read: what its subscript makes is unknown
            return self._unknown(node, record=len(self.unknown) == noted)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base is _typing("Literal"):
            if not all(_is_literal(item) for item in items):
                return self._unknown(node)
            values = tuple(ast.literal_eval(item) for item in items)
            return self._made(node, before, operator.getitem, base, values if len(values) != 1 else values[0])
        if base is _typing("Annotated"):  # get_type_hints drops the metadata
            return self._resolve(items[0])
        args = [self._resolve(item) for item in items]
        return self._made(node, before, operator.getitem, base,
                          tuple(args) if isinstance(node.slice, ast.Tuple) else args[0])

    def _made(self, node: ast.expr, before: int, make: Callable[[Any, Any], Any], *parts: Any) -> Any:
        """`make(*parts)`, as the file would make it; where that raises, the hint fails wherever the file runs, unless
        a part is a stand-in (`before`: the count of stand-ins used before the parts were read)."""
        try:
            return make(*parts)
        except Exception as e:  # noqa: BLE001 - typing raises TypeError, and stand-ins anything
            if self._guesses > before:
                return self._unknown(node)
            raise _HintError(f"{type(e).__name__}: {e}") from None

    def _unknown(self, node: ast.expr, record: bool = True) -> type:
        """A plain class standing in for what the hint names, which only running the file could tell."""
        text = _short(ast.unparse(node), 60)
        if record and text not in self.unknown:
            self.unknown.append(text)
        self._guesses += 1
        return type(text, (), {"__module__": "loraflow_tools_file"})


def _never_called(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a stand-in for a tool read from its source: only its name, signature and docstring are read")


def _bindings(body: Sequence[ast.stmt]) -> tuple[dict[str, ast.stmt], dict[str, tuple[int, bool]], bool]:
    """(what each name is last bound by at the top level, in the order names are first bound, as the module's dict
    keeps them; names bound only under compound statements, with their line and whether a `def` binds them; whether a
    `*` import binds more)."""
    bound: dict[str, ast.stmt] = {}
    nested: dict[str, tuple[int, bool]] = {}
    star = False
    for statement in body:
        if isinstance(statement, (*_DEFS, ast.ClassDef)):
            bound[statement.name] = statement
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if isinstance(statement, ast.AnnAssign) and statement.value is None:
                continue  # `x: int` binds nothing
            for target in statement.targets if isinstance(statement, ast.Assign) else [statement.target]:
                for name in _stored_names(target):
                    bound[name] = statement
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                if alias.name == "*":
                    star = True
                else:
                    bound[alias.asname or (alias.name if isinstance(statement, ast.ImportFrom)
                                           else alias.name.split(".")[0])] = statement
        elif isinstance(statement, ast.Delete):
            for target in statement.targets:
                for name in _stored_names(target, ast.Del):
                    bound.pop(name, None)
        elif not _main_guard(statement):  # what runs only as a script does not run on import
            for node in _walk_scope(statement):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    nested.setdefault(node.id, (node.lineno, False))
                elif isinstance(node, (*_DEFS, ast.ClassDef)):
                    nested.setdefault(node.name, (node.lineno, isinstance(node, _DEFS)))
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    star = star or any(alias.name == "*" for alias in node.names)
                    for alias in node.names:
                        nested.setdefault(alias.asname or alias.name.split(".")[0], (node.lineno, False))
    return bound, nested, star


def _main_guard(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.If) and ast.unparse(statement.test) in ('__name__ == "__main__"',
                                                                           "__name__ == '__main__'")


def _class_members(source: _Source, class_name: str) -> dict[str, _Member]:
    """What one class's own body binds, each name's last binding winning. As for a tools file's top level, a name
    bound by an assignment is a value, not a tool, unless it is plainly a function (a lambda, another name for a
    method)."""
    node = source.bindings[class_name]
    bound, nested, _ = _bindings(node.body)
    members = {}
    for name, statement in bound.items():
        value = _value_of(statement, name)
        if isinstance(statement, _DEFS):
            members[name] = _method(source, statement, class_name)
        elif isinstance(value, ast.Lambda):
            members[name] = _Member("unknown", statement.lineno, why="is a lambda; define it with `def`")
        elif isinstance(value, ast.Name) and isinstance(bound.get(value.id), _DEFS):
            members[name] = _Member("unknown", statement.lineno, why="is another name for a method")
        else:
            members[name] = _Member("value", statement.lineno)
    for name, (line, _) in nested.items():
        members.setdefault(name, _Member("unknown", line, why="is bound under a compound statement (`if`, `try`, "
                                                              "...), which only running the class decides"))
    return members


def _method(source: _Source, node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str) -> _Member:
    """A `def` in a class body: a function as `getmembers` sees it (plain, static or abstract), a callable that is not
    one (a classmethod), a value (a property) or, under any other decorator, unknown."""
    kinds = set()
    for decorator in node.decorator_list:
        made = _decorated_by(source, decorator)
        if made in (staticmethod, abc.abstractmethod):
            kinds.add("function")
        elif made is classmethod:
            kinds.add("callable")
        elif made is property or made is _functools_cached_property():
            kinds.add("value")
        else:
            return _Member("unknown", decorator.lineno, why="has a decorator, which only running the file applies")
    kind = "value" if "value" in kinds else "callable" if "callable" in kinds else "function"
    return _Member(kind, node.lineno, node=node, owner=owner)


def _decorated_by(source: _Source, node: ast.expr) -> Any:
    """What a decorator or base expression names, from the allow-list; None when that takes running the file."""
    hints = _Hints(source, frozenset())
    target = node.func if isinstance(node, ast.Call) else node
    try:
        found = hints._resolve(target)
    except _HintError:
        return None
    return None if hints._guesses else found


def _dataclass() -> Any:
    import dataclasses

    return dataclasses.dataclass


def _functools_cached_property() -> Any:
    import functools

    return functools.cached_property


def _typing(name: str) -> Any:
    import typing

    return getattr(typing, name)


def _value_of(statement: ast.stmt, name: str) -> ast.expr | None:
    """The expression a simple assignment gives `name` (`name = value` or `name: hint = value`); None otherwise."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == name:
        return statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.target.id == name:
        return statement.value
    return None


def _stored_names(target: ast.expr, context: type = ast.Store) -> list[str]:
    return [node.id for node in ast.walk(target) if isinstance(node, ast.Name) and isinstance(node.ctx, context)]


def _walk_scope(node: ast.AST):
    """The nodes of a statement that bind in the enclosing scope: not inside a function, a lambda, a class body or a
    comprehension (each a scope of its own), though a `def` or `class` itself binds its name."""
    yield node
    if isinstance(node, (*_DEFS, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                         ast.GeneratorExp)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk_scope(child)


def _is_literal(node: ast.expr) -> bool:
    """A value `Literal[...]` takes as the file wrote it: a constant, or a signed number."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and not isinstance(node.value, type(...))


def _is_tool(name: str) -> bool:
    return not name.startswith("_") and name not in ENVIRONMENT_HOOKS


def _c3(sequences: list[list[str]], name: str) -> list[str]:
    """C3 linearization of the bases' orders, as Python orders a class's bases (`class A(B, C)`)."""
    order = []
    sequences = [list(sequence) for sequence in sequences if sequence]
    while sequences:
        head = next((seq[0] for seq in sequences if not any(seq[0] in other[1:] for other in sequences)), None)
        if head is None:
            raise _Unread(f"class `{name}` has bases Python cannot order")
        order.append(head)
        sequences = [rest for rest in ([item for item in seq if item != head] for seq in sequences) if rest]
    return order


def _sibling_imports(tree: ast.Module, path: Path) -> list[str]:
    """A warning for each module the file imports that is a file or folder beside it here: the run ships the tools
    file alone, so on the worker such an import finds an installed package of that name or fails."""
    warnings = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if (path.parent / f"{top}.py").is_file() or (path.parent / top / "__init__.py").is_file():
                warnings.append(f"line {node.lineno} imports `{top}`, a module beside it here that the run does not "
                                "ship: on the worker that import finds only an installed package of that name "
                                "(`worker.extra_packages`)")
    return warnings


def _listed(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names) or "none"


def _short(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"

