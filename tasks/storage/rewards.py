"""Reward files of a GRPO run (`grpo.rewards[i].name = "path/to/file.py:function"`), seen from the control plane.

They are checked before anything is rented, as they were read once with the run's files (`run_files.py`): the file
must define the function at its top level. The file is parsed with `ast`, never run here: it is the worker's code, run
on the worker.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraflow_worker.contract import RewardSpec, run_prefix
from loraflow_worker.contract.reward_names import reward_kind, split_file_reward

from tasks.storage.run_files import RunFile, reward_fields


def check_reward_files(rewards: Sequence[RewardSpec], files: Mapping[str, RunFile]) -> dict[int, RunFile]:
    """The reward files of `rewards` by the index of the reward that names them, as they were read (`files`: the run's
    files by their field, `read_run_files`); ValueError naming `grpo.rewards[i].name` for a file that was not read,
    is not Python, or has no top-level function of that name."""
    read = reward_fields(files)
    found = {}
    for index, spec in enumerate(rewards):
        if reward_kind(spec.name) != "file":
            continue
        field = f"grpo.rewards[{index}].name"
        function = split_file_reward(spec.name)[1]
        if index not in read:
            raise ValueError(f"{field} `{spec.name}`: its reward file was not read with the run's files")
        top_level_function(read[index], function, f"{field} `{spec.name}`: reward file")
        found[index] = read[index]
    return found


def reward_store_paths(files: Mapping[int, RunFile], run_id: str) -> dict[Path, str]:
    """Where each distinct reward file (by where it was read) goes in the run's store: `runs/<run_id>/rewards/<file
    name>`, the name made store-safe, and numbered when two different files share a name."""
    store_paths: dict[Path, str] = {}
    for file in files.values():
        path = file.location
        if path in store_paths:
            continue
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem).lstrip(".-") or "reward"
        name, n = f"{stem}.py", 1
        while f"{run_prefix(run_id)}/rewards/{name}" in store_paths.values():
            n += 1
            name = f"{stem}-{n}.py"
        store_paths[path] = f"{run_prefix(run_id)}/rewards/{name}"
    return store_paths


def top_level_function(file: RunFile, function: str, what: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The top-level `def` of `function` in a user's Python file as it was read (`file`), parsed as text, never run:
    the last one, as Python keeps; None when the file binds the name otherwise (an assignment, an import, a class: a
    callable only the worker sees). ValueError beginning with `what` (e.g. "grpo.rewards[0].name `f.py:score`: reward
    file") when the file is not Python or does not bind the name."""
    path = file.location
    try:
        tree = ast.parse(file.copy.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as e:
        line = f", line {e.lineno}" if isinstance(e, SyntaxError) else ""
        raise ValueError(f"{what} {path} is not valid Python{line}: {e}") from e
    definitions = [node for node in tree.body
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function]
    if definitions:
        return definitions[-1]
    defined = _top_level_names(tree)
    if function not in defined:
        functions = ", ".join(f"`{name}`" for name, is_function in defined.items() if is_function) or "none"
        raise ValueError(f"{what} {path} defines no top-level function `{function}` (its functions: {functions})")
    return None


def _top_level_names(tree: ast.Module) -> dict[str, bool]:
    """Names the module binds at its top level, each with whether a `def` binds it. Names bound otherwise
    (`score = make_reward(...)`, `from x import score`, a class) count too: they may well be callables."""
    names: dict[str, bool] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = True
        elif isinstance(node, ast.ClassDef):
            names.setdefault(node.name, False)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names.setdefault(name.id, False)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], False)
    return names
