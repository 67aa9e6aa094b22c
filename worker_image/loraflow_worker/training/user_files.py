"""Python files a run ships in its artifact store (reward files, a tools file, an environment's file), imported on
the worker: each read from the store into the job's work dir and imported as a module of its own."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraflow_worker.artifacts import ArtifactStore


class UserFileError(ValueError):
    """A run's file cannot be read from the store or imported."""


def import_stored_file(store: ArtifactStore, store_path: str, files_dir: Path) -> ModuleType:
    """The module of the file at `store_path` in `store`, copied into `files_dir` first. UserFileError when the file
    is not in the store or raises while it is imported."""
    from loraflow_worker.artifacts import ArtifactNotFound

    try:
        source = store.read_bytes(store_path)
    except ArtifactNotFound as e:
        raise UserFileError(f"{store_path} is not in the artifact store ({e})") from e
    local = files_dir / store_path
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(source)
    # One module per stored file, under a name no installed package has; registered before it runs, as an
    # import would, so that the file's dataclasses and pickling find their module.
    module_name = "loraflow_run_file_" + re.sub(r"\W", "_", store_path.removesuffix(".py"))
    module_spec = importlib.util.spec_from_file_location(module_name, local)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises, the job must say which file failed
        del sys.modules[module_name]
        raise UserFileError(f"importing it failed: {type(e).__name__}: {e}") from e
    return module
